"""Issue 31 diagnosis (s95): runs `megatron-cg bench` in this process with one of two changes.

DIAG_TIME=1: every replay's contract check is timed where it runs, inside the step, and at once again
(hot); quick accepts, full checks and learns are counted; garbage collections are timed; all per arm.
DIAG_SWAP=1: the plugin arm's helper is a bound copy with its own session (checks on), built the way
the plugin-no-check arm's is, so the two arms differ in the check alone.
Figures go to $DIAG_OUT as JSON. Diagnosis only: the timing changes what it measures."""
import atexit, collections, dataclasses, gc, json, os, sys, time

from megatron_cg_plugin.capture import contracts
from megatron_cg_plugin.launch import bench
from megatron_cg_plugin import cli

arm = ["setup"]
stats = collections.defaultdict(lambda: collections.defaultdict(float))
samples = collections.defaultdict(lambda: {"in_step_ns": [], "hot_ns": []})

step = bench.MegatronTrainer.step


def tagged_step(self):
    arm[0] = self._active.arm if self._active is not None else "eager"
    stats[arm[0]]["steps"] += 1
    try:
        step(self)
    finally:
        arm[0] = "between"


bench.MegatronTrainer.step = tagged_step
gc_start = [0]


def on_gc(phase, info):
    if phase == "start":
        gc_start[0] = time.perf_counter_ns()
    else:
        stats[arm[0]][f"gc{info['generation']}_count"] += 1
        stats[arm[0]][f"gc{info['generation']}_ns"] += time.perf_counter_ns() - gc_start[0]


gc.callbacks.append(on_gc)

def timed(check):
    def timed_check(*a, **k):
        t0 = time.perf_counter_ns()
        check(*a, **k)
        t1 = time.perf_counter_ns()
        check(*a, **k)
        t2 = time.perf_counter_ns()
        samples[arm[0]]["in_step_ns"].append(t1 - t0)
        samples[arm[0]]["hot_ns"].append(t2 - t1)
    return timed_check


if os.environ.get("DIAG_TIME") == "1":
    if hasattr(contracts.QuickAccept, "accept"):  # s99 on: replay_check returns a closure over the compiled accept
        replay_check = contracts.ReplayContract.replay_check

        def timed_replay_check(self, mode):
            return timed(replay_check(self, mode))

        contracts.ReplayContract.replay_check = timed_replay_check
        counted_methods = ((contracts.QuickAccept, "learn"), (contracts.ReplayContract, "_check_in_full"),
                           (contracts.QuickState, "held_accepts"))
    else:  # the replay's entry: check_as since s98 (bound by replay_check), check before it
        entry = "check_as" if hasattr(contracts.ReplayContract, "check_as") else "check"
        check = getattr(contracts.ReplayContract, entry)
        setattr(contracts.ReplayContract, entry, timed(check))
        counted_methods = ((contracts.QuickAccept, "accepts"), (contracts.QuickAccept, "learn"),
                           (contracts.ReplayContract, "_check_in_full"), (contracts.QuickAccept, "_held_accepts"))
    for cls, name in counted_methods:
        def counted(*a, __f=getattr(cls, name), __n=name, **k):
            result = __f(*a, **k)
            stats[arm[0]][f"{__n}_{result}" if __n in ("accepts", "_held_accepts", "held_accepts") else __n] += 1
            return result
        setattr(cls, name, counted)

if os.environ.get("DIAG_SWAP") == "1":
    init = bench.MegatronTrainer.__init__

    def swapped_init(self, *a, **k):
        init(self, *a, **k)
        from megatron_cg_plugin.helper import bind_helper_class
        from megatron_cg_plugin.session import RunSession
        self.helpers["plugin"] = bind_helper_class(self._te_helper, RunSession(dataclasses.replace(self._session.config)))

    bench.MegatronTrainer.__init__ = swapped_init


def dump():
    def summary(values):
        values = sorted(values)
        return {"n": len(values), "median_us": values[len(values) // 2] / 1e3 if values else None,
                "p10_us": values[len(values) // 10] / 1e3 if values else None,
                "p90_us": values[9 * len(values) // 10] / 1e3 if values else None}
    out = {"stats": {k: dict(v) for k, v in stats.items()},
           "checks": {k: {kind: summary(v) for kind, v in d.items()} for k, d in samples.items()}}
    with open(os.environ["DIAG_OUT"], "w") as handle:
        json.dump(out, handle, indent=1)


atexit.register(dump)
sys.exit(cli.main(sys.argv[1:]))
