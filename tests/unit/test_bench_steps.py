"""megatron-cg bench --bench-interleave steps on CPU: every arm captured once, single steps in
mirrored cycles on a host whose speed shifts as a GPU shared with other jobs does, the arms' switching on a
trainer with Megatron's real graphable layers, and the refusals of what cannot be switched."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import types
from typing import ClassVar

import pytest
import torch
from _doubles.installed import plugin_installed

from megatron_cg_plugin.bench import command as bench
from megatron_cg_plugin.bench import output as bench_output
from megatron_cg_plugin.bench.command import BenchError, BenchOptions, parse_bench_argv, run_bench
from megatron_cg_plugin.bench.schedule import DeviceTime
from megatron_cg_plugin.config import PluginConfig

TRUE_RATIO = 1.02  # plugin / stock
SPEEDS = {"eager": 0.300, "stock": 0.130, "plugin": 0.130 * TRUE_RATIO, "plugin-recording": 0.130 * 1.005}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ShiftingHost:
    """The host's speed as a realistic MoE's blocks showed it on a GPU shared with other jobs: steps of one arm at
    ~0.123 s or ~0.139 s, the regime switching every few steps (here with probability 0.2 a step: five on
    average), a slow drift of +1% per 100 steps, and 1% jitter per step. Seeded: every run of a test is the same."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.slow = False
        self.steps = 0

    def factor(self) -> float:
        if self.rng.random() < 0.2:
            self.slow = not self.slow
        self.steps += 1
        return (1.13 if self.slow else 1.0) * (1 + 1e-4 * self.steps) * self.rng.lognormvariate(0.0, 0.01)


class NoisyTrainer:
    """Steps at their arm's speed times the host's factor; captures, switches and teardowns logged.
    Like Megatron's layers, a capture must find no arm's graphs in place."""

    def __init__(self, clock: Clock, host: ShiftingHost) -> None:
        self.clock, self.host = clock, host
        self.arm = "eager"  # whose graphs the layers hold
        self.alive: dict[str, str] = {}  # arm -> its helper, captured and not torn down
        self.events: list[str] = []
        self.pools: dict = {}
        self.stepped: list[str] = []
        self.recording_costs: list[str] = []  # the arm in place when the recording hooks were timed

    def step(self) -> None:
        self.stepped.append(self.arm)
        self.clock.now += SPEEDS[self.arm] * self.host.factor()

    def capture(self, arm: str) -> str:
        assert self.arm == "eager", f"captured {arm} while {self.arm}'s graphs were in place"
        self.events.append(f"capture {arm}")
        self.pools[(len(self.pools) + 1, 0)] = 64 << 20
        self.clock.now += 1.0
        self.arm = self.alive[arm] = arm
        return arm

    def activate(self, arm: str) -> None:
        assert arm == "eager" or arm in self.alive, arm
        self.arm = arm

    def deactivate(self) -> None:
        self.arm = "eager"

    def release(self, helper) -> None:
        assert helper is None or helper == self.arm, f"released {helper} while {self.arm} was active"
        self.events.append(f"release {helper}")
        self.alive.pop(helper, None)
        self.arm = "eager"

    def synchronize(self) -> None:
        pass

    def peak_allocated(self, reset: bool = False) -> int:
        return (1 << 30) + (len(self.alive) << 20)

    def pool_bytes(self) -> dict:
        return dict(self.pools)


def run(seed: int = 0, *, profile=None, **options):
    clock = Clock()
    trainer = NoisyTrainer(clock, ShiftingHost(seed))
    lines: list[str] = []
    result = run_bench(
        BenchOptions(**({"arms": ("stock", "plugin")} | options)),
        trainer,
        clock=clock,
        progress=lines.append,
        profile=profile,
        contract_cost=lambda helper: ({"full": 7.0, "shapes": 4.0, "off": 0.5}, 24),
        recording_cost=lambda: (trainer.recording_costs.append(trainer.arm), 63.0)[1],
    )
    return result, trainer, lines


def recovers(result, truth: float = TRUE_RATIO, half_width: float = 0.01) -> bool:
    """The bench told the ratio: its median's 95% interval holds the truth and is within +-1%."""
    found = result.ratio_intervals().get(("plugin", "stock"))
    return found is not None and found.low <= truth <= found.high and found.half_width < half_width


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_steps_in_mirrored_cycles_tell_two_percent_where_blocks_of_the_same_steps_cannot(seed):
    """400 steps each way on the same shifting host. The block schedule's ratio is one per pair of
    rounds, and a block's median moves with the share of slow steps in it: its interval spans
    several percent. The step schedule's per-cycle ratio only moves where the host shifted inside
    a cycle of four steps, and its median's interval is under +-1% and holds 1.02."""
    steps, *_ = run(seed, interleave="steps", cycles=100, skip_steps=2)
    blocks, *_ = run(seed, rounds=20, steps=10, skip_steps=1)
    assert recovers(steps), steps.ratio_intervals()
    assert not recovers(blocks)
    assert blocks.ratio_intervals()["plugin", "stock"].half_width > 0.02  # the same estimator, over blocks
    # What the interval says of its own width holds: the cycles it asks for +-1% are fewer than it ran.
    assert steps.ratio_intervals()["plugin", "stock"].pairs_for(0.01) < 98


def test_every_arm_is_captured_once_up_front_stepped_in_mirrored_cycles_and_torn_down_last_first():
    profiled = []

    def profile(step, count, arm):
        profiled.append(arm)
        for _ in range(count):
            step()
        return DeviceTime(0.05)

    result, trainer, lines = run(
        arms=("eager", "stock", "plugin", "plugin-recording"),
        interleave="steps",
        cycles=8,
        skip_steps=1,
        profile=profile,
    )
    graphed = ["stock", "plugin", "plugin-recording"]
    # The eager arm has no helper: it is released (None) like the others, last as it was first.
    assert trainer.events == [f"capture {arm}" for arm in graphed] + [f"release {arm}" for arm in reversed(graphed)] + [
        "release None"
    ]
    assert trainer.stepped[:3] == ["eager"] * 3  # the warmup steps
    schedule = trainer.stepped[3 : 3 + 8 * 8]
    forward = ["eager", "stock", "plugin", "plugin-recording"]
    backward = forward[::-1]
    assert schedule == (forward + backward + backward + forward) * 4  # the outer arm alternates cycle by cycle
    assert profiled == ["eager", "stock", "plugin", "plugin-recording"]
    assert trainer.stepped[3 + 64 :] == [arm for arm in profiled for _ in range(3)]  # profiled with its graphs in place
    assert [r.arm for r in result.steps] == schedule and all(r.cycle == i // 8 for i, r in enumerate(result.steps))
    assert len(lines) == 3 + 8 + 4 and lines[0].startswith("captured stock: 1.00 s, graph pools 64 MiB")
    assert lines[3].startswith("cycle 1/8: eager 3") and "plugin-recording" in lines[3]
    records = {r.arm: r for r in result.blocks}
    assert records["eager"].capture_seconds is None and records["plugin"].capture_seconds == pytest.approx(1.0)
    assert records["plugin"].pool_bytes == 64 << 20 and records["plugin"].step_seconds == ()
    assert records["plugin"].peak_allocated_bytes == (1 << 30) + (3 << 20)  # all three captures alive
    assert result.contract_check_us["full"] == 7.0 and result.replays_per_step == 24
    assert result.recording_us == 63.0 and trainer.recording_costs == ["plugin-recording"]
    medians = result.summary().arms
    assert result.busy_fraction["plugin"] == pytest.approx(0.05 / medians["plugin"].median)


def test_a_failing_step_still_tears_every_capture_down():
    class Failing(NoisyTrainer):
        def step(self):
            if self.arm == "plugin" and len(self.stepped) > 10:
                raise RuntimeError("step failed")
            super().step()

    clock = Clock()
    trainer = Failing(clock, ShiftingHost(0))
    with pytest.raises(RuntimeError, match="step failed"):
        run_bench(
            BenchOptions(arms=("stock", "plugin"), interleave="steps", cycles=8),
            trainer,
            clock=clock,
            progress=lambda _: None,
        )
    assert trainer.events[-2:] == ["release plugin", "release stock"] and not trainer.alive


def test_the_step_schedules_outputs_say_which_schedule_ran(tmp_path):
    result, *_ = run(arms=("stock", "plugin", "plugin-recording"), interleave="steps", cycles=30, skip_steps=2)
    assert result.schedule == "steps" and result.method.startswith(bench.STEPS_METHOD)
    assert "the first 2 of 30 cycles dropped" in result.method
    written = bench_output.write(result, tmp_path, with_plot=False)
    data = json.loads(written[0].read_text())
    assert data["schedule"] == "steps" and len(data["steps"]) == 30 * 6 and data["ratios"]["plugin/stock"]["n"] == 28
    assert data["ratio_precision"] == {}  # rounds for +-1% are the block schedule's; cycles are in ratio_intervals
    interval = data["ratio_intervals"]["plugin/stock"]
    found = result.ratio_intervals()["plugin", "stock"]
    assert interval["low"] == found.low and interval["pairs_for_half_width"] == {
        "0.01": found.pairs_for(0.01),
        "0.02": found.pairs_for(0.02),
    }
    assert bench_output.from_json(data) == result
    table = written[1].read_text()
    assert table.startswith(f"Method: {result.method}.")
    assert "| arm | step ms: median of its steps [spread] |" in table
    assert (
        "| ratio | median [spread] over mirrored cycles | median [95% interval] | +- | cycles for +-1% | "
        "cycles for +-2% |"
    ) in table
    assert (
        f"| plugin / stock | {result.summary().ratios['plugin', 'stock'].format()} | "
        f"{found.median:.4f} [{found.low:.4f}, {found.high:.4f}] | {found.half_width:.2%} | {found.pairs_for(0.01)} | "
        f"{found.pairs_for(0.02)} |"
    ) in table
    few = dataclasses.replace(result, steps=result.steps[: 5 * 6], skip_steps=0)  # read back from a short run
    assert (
        "| plugin / stock | " in (short := bench_output.markdown(few)) and "| - (under 6 cycles) | - | - | - |" in short
    )
    points = bench_output._plotted(result)
    assert len(points["plugin"]) == 2 * 28 and points["stock"][0][0] == 2 * 6  # the kept steps, at their places


def _cycle_ends(result, per_cycle: int = 4) -> list[float]:
    """Seconds of cycles at the end of each cycle (the fake clock moves only with the steps)."""
    seconds = [record.seconds for record in result.steps]
    return [sum(seconds[:end]) for end in range(per_cycle, len(seconds) + 1, per_cycle)]


@pytest.mark.parametrize(
    "seconds, skip, stops_after",
    [
        (5.0, 2, 10),  # 5 s are passed inside cycle 9: 7 kept, so the stop waits for cycle 10 (8 kept, a pair)
        (5.0, 3, 9),  # skipping 3, cycle 9 leaves 6 kept: a pair, and the interval's fewest
        (0.5, 2, 8),  # passed in the first cycle: the stop waits for the 6 kept cycles the interval needs
    ],
)
def test_a_time_limit_stops_the_cycles_at_pairs_of_enough_kept_cycles_and_the_bench_still_ends_with_its_summary(
    seconds, skip, stops_after
):
    profiled = []

    def profile(step, count, arm):
        profiled.append(arm)
        return None

    result, trainer, lines = run(interleave="steps", cycles=60, skip_steps=skip, seconds=seconds, profile=profile)
    ends = _cycle_ends(result)
    assert len(ends) == stops_after and ends[-1] >= seconds
    first_past = next(index for index, end in enumerate(ends) if end >= seconds) + 1
    assert first_past == {5.0: 9, 0.5: 1}[seconds]  # where the limit was passed: the cases above test the rule
    kept = stops_after - skip
    assert f"--bench-seconds {seconds:g} reached: the cycles stop after {stops_after} of 60" in lines
    assert f"the first {skip} of {stops_after} cycles dropped" in result.method
    assert result.method.endswith(f"stopped after {stops_after} of 60 cycles at --bench-seconds {seconds:g}")
    assert len(result.summary().ratios["plugin", "stock"].values) == kept
    assert result.ratio_intervals()["plugin", "stock"] is not None
    assert profiled == ["stock", "plugin"]  # the profiling after the cycles ran as after the last one
    assert trainer.events[-2:] == ["release plugin", "release stock"]
    full, *_ = run(interleave="steps", cycles=8, seconds=1000.0)
    assert len(full.steps) == 8 * 4 and "stopped after" not in full.method


def test_the_step_schedules_options_and_what_they_refuse():
    options, flags = parse_bench_argv(
        [
            "--bench-interleave",
            "steps",
            "--bench-cycles",
            "40",
            "--bench-arms",
            "plugin-recording,plugin,stock",
            "--num-layers",
            "8",
        ]
    )
    assert (options.interleave, options.cycles, options.arms) == ("steps", 40, ("plugin-recording", "plugin", "stock"))
    assert flags == ["--num-layers", "8"] and options.total_steps == 3 + 40 * 6 + 3 * 3
    assert parse_bench_argv(["--bench-interleave", "steps"])[0].cycles == BenchOptions.cycles
    assert parse_bench_argv(["--bench-interleave", "steps", "--bench-seconds", "90"])[0].seconds == 90.0
    assert parse_bench_argv([])[0].interleave == "blocks"
    for argv, message in [
        (["--bench-interleave", "steps", "--bench-rounds", "4"], "--bench-rounds size\\(s\\) the block schedule"),
        (["--bench-interleave", "steps", "--bench-steps", "4"], "give --bench-cycles N instead"),
        (["--bench-cycles", "40"], "--bench-cycles size\\(s\\) the step schedule.*add --bench-interleave steps"),
        (["--bench-interleave", "cycles"], "--bench-interleave cycles: use blocks or steps"),
        (
            ["--bench-interleave", "steps", "--bench-cycles", "7"],
            "keeps 5 cycle\\(s\\) after --bench-skip-steps 2; .* raise --bench-cycles to 8",
        ),
        (
            ["--bench-interleave", "steps", "--bench-arms", "stock,slot-offload"],
            "the slot-offload arm\\(s\\) capture slot-shared graphs.*--bench-interleave blocks",
        ),
        (
            ["--bench-capture-rounds", "8"],
            "the block schedule captures every block already.*add --bench-interleave steps",
        ),
        (
            ["--bench-seconds", "60"],
            "--bench-seconds 60 stops the step schedule's cycles: add --bench-interleave steps",
        ),
        (["--bench-interleave", "steps", "--bench-seconds", "-1"], "--bench-seconds -1: give the seconds"),
        (["--bench-interleave", "steps", "--bench-seconds", "nan"], "--bench-seconds nan: give the seconds"),
        (
            ["--bench-interleave", "steps", "--bench-capture-rounds", "13"],
            "--bench-capture-rounds 13: .* needs 6 pairs of mirrored rounds: give an even number of rounds, 12 or more",
        ),
        (["--bench-interleave", "steps", "--bench-capture-rounds", "4"], "12 or more"),
        (
            ["--bench-interleave", "steps", "--bench-arms", "eager,plugin", "--bench-capture-rounds", "12"],
            "compares the captures of two or more graphed arms, and --bench-arms eager,plugin names 1: add one",
        ),
    ]:
        with pytest.raises(BenchError, match=message):
            parse_bench_argv(argv)


class SlowerCapture(NoisyTrainer):
    """The plugin's capture takes 1.08 times stock's, on a host whose speed drifts and shifts."""

    CAPTURE_SECONDS: ClassVar[dict[str, float]] = {"stock": 1.0, "plugin": 1.08}

    def capture(self, arm: str) -> str:
        helper = super().capture(arm)
        self.clock.now += self.CAPTURE_SECONDS[arm] * self.host.factor() - 1.0  # NoisyTrainer's capture took 1 s
        return helper


def test_capture_rounds_time_each_arm_against_the_other_in_mirrored_rounds(tmp_path):
    clock = Clock()
    trainer = SlowerCapture(clock, ShiftingHost(3))
    lines: list[str] = []
    options, _ = parse_bench_argv(
        [
            "--bench-interleave",
            "steps",
            "--bench-cycles",
            "8",
            "--bench-arms",
            "eager,stock,plugin",
            "--bench-capture-rounds",
            "24",
        ]
    )
    result = run_bench(options, trainer, clock=clock, progress=lines.append)
    # Captured and released round by round, mirrored, before the schedule's own captures (no eager arm).
    rounds = [
        f"{event} {arm}"
        for r in range(24)
        for arm in (("stock", "plugin") if r % 2 == 0 else ("plugin", "stock"))
        for event in ("capture", "release")
    ]
    assert trainer.events[:96] == rounds and trainer.events[96:98] == ["capture stock", "capture plugin"]
    assert [(r.round, r.arm) for r in result.capture_rounds] == [
        (i // 2, e.split()[1]) for i, e in enumerate(rounds[::2])
    ]
    assert lines[0].startswith("capture round 1/24: stock 1.")
    summary = result.capture_summary()
    ratios = summary.ratios["plugin", "stock"]
    assert len(ratios.values) == 12  # one per pair of mirrored rounds
    seconds = {(r.round, r.arm): r.seconds for r in result.capture_rounds}
    first = (seconds[0, "plugin"] / seconds[0, "stock"] * seconds[1, "plugin"] / seconds[1, "stock"]) ** 0.5
    assert ratios.values[0] == pytest.approx(first)  # the pair's geometric mean: a linear drift cancels
    found = bench_output.median_interval(ratios.values)
    assert found.low <= 1.08 <= found.high  # (29 of the first 30 seeds: a 95% interval)
    written = bench_output.write(result, tmp_path, with_plot=False)
    table = written[1].read_text()
    assert (
        "; before the cycles, each graphed arm captured and released in 24 mirrored rounds (--bench-capture-rounds)"
        in table
    )
    assert "| capture rounds (24, mirrored) | median [spread] | median [95% interval] |" in table
    assert f"| plugin / stock capture | {ratios.format()} | {found.median:.3f} [" in table
    assert f"| stock capture s | {summary.arms['stock'].format()} | - |" in table
    data = json.loads(written[0].read_text())
    assert data["capture_ratios"]["plugin/stock"]["interval"]["n"] == 12
    assert data["capture_ratios"]["plugin/stock"]["interval"]["half_width"] == pytest.approx(found.half_width)
    assert bench_output.from_json(data) == result
    short = dataclasses.replace(result, capture_rounds=result.capture_rounds[:8])  # 2 pairs, read back
    assert "| plugin / stock capture | " in (table := bench_output.markdown(short)) and "- (under 6 pairs)" in table
    plain, *_ = run(interleave="steps", cycles=8)
    assert plain.capture_rounds == () and "capture rounds" not in bench_output.markdown(plain)
    assert bench_output.to_json(plain)["capture_ratios"] == {}


def test_a_capture_round_stopped_after_its_capture_still_releases_the_arm():
    clock = Clock()
    trainer = NoisyTrainer(clock, ShiftingHost(0))

    def progress(line: str) -> None:
        if line.startswith("capture round"):
            raise KeyboardInterrupt  # the user stops the bench between capture and release

    with pytest.raises(KeyboardInterrupt):
        run_bench(
            BenchOptions(arms=("stock", "plugin"), interleave="steps", cycles=8, capture_rounds=12),
            trainer,
            clock=clock,
            progress=progress,
        )
    assert trainer.events == ["capture stock", "release stock"] and not trainer.alive


ARGS = dict(
    cuda_graph_impl="transformer_engine",
    cuda_graph_warmup_steps=3,
    use_distributed_optimizer=False,
    overlap_param_gather=False,
    save=None,
)
STEPS = BenchOptions(arms=("stock", "plugin"), interleave="steps")


def run_settings(**flags):
    """The run's settings of Megatron's flags ``ARGS | flags``, read as validation reads them."""
    from megatron_cg_plugin.settings import read_settings

    return read_settings(types.SimpleNamespace(**({"num_layers": 2, "micro_batch_size": 1} | ARGS | flags)))[0]


@pytest.mark.parametrize(
    "args, config, message",
    [
        ({}, PluginConfig(slot_capture=True), "--cg-slot-capture: the plugin arm\\(s\\) would capture slot-shared"),
        ({}, PluginConfig(graph_banks=True), "--cg-graph-banks: the plugin arm"),
        (dict(fine_grained_activation_offloading=True), PluginConfig(), "--fine-grained-activation-offloading"),
        (dict(fp8="hybrid"), PluginConfig(), "--fp8-format/--fp4-format"),
    ],
)
def test_what_keeps_state_per_capture_outside_the_layers_is_refused_with_steps(args, config, message):
    with pytest.raises(
        BenchError,
        match=f"--bench-interleave steps keeps every arm's graphs alive.*{message}.*"
        "Run this bench with --bench-interleave blocks",
    ):
        bench.refuse_unbenchable(run_settings(**args), config, STEPS)
    bench.refuse_unbenchable(run_settings(), PluginConfig(), STEPS)  # the plain run is benchable
    # The block schedule captures one arm at a time: it takes them all.
    bench.refuse_unbenchable(run_settings(**args), config, dataclasses.replace(STEPS, interleave="blocks"))
    if not args:  # stock alone captures TE's graphs whatever the plugin's config
        bench.refuse_unbenchable(run_settings(), config, dataclasses.replace(STEPS, arms=("eager", "stock")))


# ---------------------------------------------------------------- switching Megatron's layers


class Replay:
    """A captured graph of one arm for one layer: replaying it says whose it is."""

    def __init__(self, arm: str, layer: int) -> None:
        self.arm, self.layer, self.resets = arm, layer, 0

    def __call__(self, *args, **kwargs):
        return f"{self.arm} graph of layer {self.layer}"

    def reset(self) -> None:
        self.resets += 1


class FakeMegatronHelper:
    """Megatron's TECudaGraphHelper's lifecycle on CPU: hands each graphable layer its graphs and
    hooks, and takes them back as Megatron's delete_cuda_graphs does (reset, then empty lists)."""

    flattened_callables: ClassVar[list] = []  # the plugin's mixin then runs this class's capture as it is
    handed: ClassVar[list] = []

    def __init__(self, *, model, **kwargs) -> None:
        self.layers = [m for chunk in model for m in chunk.modules() if hasattr(m, "cuda_graphs")]
        self._created = False

    def create_cudagraphs(self) -> None:
        arm = (
            getattr(getattr(self, "session", None), "bench_arm", "plugin") if "session" in vars(type(self)) else "stock"
        )
        for index, layer in enumerate(self.layers):
            assert not layer.cuda_graphs, "a capture found another arm's graphs in place"
            layer.cuda_graphs = [Replay(arm, index)]
            layer.cuda_graph_manual_hooks = [(lambda *a: None, (arm,))]
            FakeMegatronHelper.handed.append(layer.cuda_graphs[0])
        self._created = True

    def graphs_created(self) -> bool:
        return self._created

    def delete_cuda_graphs(self) -> None:
        for layer in self.layers:
            for graph in layer.cuda_graphs:
                graph.reset()
            layer.cuda_graphs, layer.cuda_graph_manual_hooks = [], []
        self._created = False


def validated(session):
    """``session`` as Megatron's validate_args leaves it: with the run's settings (the helpers' shapes)."""
    from megatron_cg_plugin.settings import RunSettings

    session.settings = RunSettings(seq_length=8, micro_batch_size=1)
    return session


def graphable_model():
    from megatron.core.transformer.module import GraphableMegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=4, num_attention_heads=1, cuda_graph_impl="transformer_engine")

    class Layer(GraphableMegatronModule):  # Megatron's own __call__: replays whatever cuda_graphs holds
        def __init__(self) -> None:
            super().__init__(config)
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, hidden_states):
            return "eager"

    chunk = torch.nn.Module()
    chunk.layers = torch.nn.ModuleList([Layer(), Layer()])
    return [chunk]


def test_switching_puts_each_arms_own_graphs_hooks_and_recording_in_place(monkeypatch):
    import megatron.core.transformer.cuda_graphs as cuda_graphs
    import megatron.training as megatron_training

    from megatron_cg_plugin.session import RunSession

    class Tagged(RunSession):  # which arm's session a plugin helper reports to
        bench_arm = "plugin"

    class Recording(RunSession):
        bench_arm = "plugin-recording"
        marks = 0

        def mark_iteration_start(self):
            Recording.marks += 1
            super().mark_iteration_start()

    model = graphable_model()
    layers = [m for m in model[0].modules() if hasattr(m, "cuda_graphs")]
    monkeypatch.setattr(FakeMegatronHelper, "handed", [])
    monkeypatch.setattr(bench, "RunSession", Recording)  # the recording arm's own session
    plugin_installed(monkeypatch, FakeMegatronHelper, validated(Tagged(PluginConfig())))
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", FakeMegatronHelper)  # the stock arm's
    monkeypatch.setattr(megatron_training, "get_args", types.SimpleNamespace)  # what the steps set, as train() does
    served = []

    def train_step(*args, iteration):  # a forward through Megatron's layers, and 0.19.2's eight values
        served.append(tuple(layer(torch.ones(2, 4)) for layer in layers))
        return {"lm loss": torch.tensor(1.0)}, 0, False, False, 0, 1.0, 0.0, 0.0

    trainer = bench.MegatronTrainer(train_step, (None, None, model, "optimizer", None, "config", None), {})
    assert trainer.graphable_layers() == layers
    helpers = {}
    for arm in ("stock", "plugin", "plugin-recording"):
        trainer.deactivate()
        assert all(layer.cuda_graphs == [] and layer.cuda_graph_manual_hooks == [] for layer in layers)
        helpers[arm] = trainer.capture(arm)
    plugin_helper_session = helpers["plugin"].session
    assert isinstance(plugin_helper_session, Tagged) and helpers["plugin-recording"].session is trainer.recording
    graphs = {arm: [g for g in FakeMegatronHelper.handed if g.arm == arm] for arm in helpers}
    for arm in ("eager", "stock", "plugin-recording", "plugin", "plugin", "stock", "eager", "plugin-recording"):
        trainer.activate(arm)
        trainer.step()
        expected = ("eager", "eager") if arm == "eager" else tuple(f"{arm} graph of layer {i}" for i in (0, 1))
        assert served[-1] == expected, arm
        if arm != "eager":  # the very graph objects and hooks the arm's capture handed out
            assert [layer.cuda_graphs[0] for layer in layers] == graphs[arm]
            assert all(layer.cuda_graph_manual_hooks[0][1] == (arm,) for layer in layers)
        assert (trainer.recording is not None) == (arm == "plugin-recording")
    assert Recording.marks == 2 and len(trainer.recording.iterations) == 2  # only its own steps
    with pytest.raises(AssertionError, match="capture from eager layers"):
        trainer.capture("stock")  # plugin-recording's graphs are in place
    for arm in ("plugin-recording", "plugin", "stock"):  # torn down while active, each its own graphs
        trainer.activate(arm)
        trainer.release(helpers[arm])
        assert all(g.resets == 1 for g in graphs[arm]) and all(layer.cuda_graphs == [] for layer in layers)
    assert all(g.resets == 1 for arm_graphs in graphs.values() for g in arm_graphs)
    trainer.step()
    assert served[-1] == ("eager", "eager")


def test_releasing_another_arms_helper_than_the_active_ones_is_an_error(monkeypatch):
    import megatron.core.transformer.cuda_graphs as cuda_graphs
    import megatron.training as megatron_training

    from megatron_cg_plugin.session import RunSession

    plugin_installed(monkeypatch, FakeMegatronHelper, validated(RunSession(PluginConfig())))
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", FakeMegatronHelper)
    monkeypatch.setattr(megatron_training, "get_args", types.SimpleNamespace)  # what the steps set, as train() does
    trainer = bench.MegatronTrainer(
        lambda *a, **k: None, (None, None, graphable_model(), "optimizer", None, "config", None), {}
    )
    stock = trainer.capture("stock")
    trainer.deactivate()
    trainer.capture("plugin")
    with pytest.raises(AssertionError, match="release the active arm's helper"):
        trainer.release(stock)
    with pytest.raises(KeyError):
        trainer.activate("plugin-no-check")  # never captured


def test_a_capture_failing_half_way_is_raised_as_itself_and_every_earlier_arm_torn_down(monkeypatch, capsys):
    """Megatron's own capture is not transactional: one that fails after the first layer leaves that layer
    its graph. The arms captured before it used to be restored onto that layer for their teardown, and
    the restore's assert replaced the capture's error."""
    import megatron.core.transformer.cuda_graphs as cuda_graphs
    import megatron.training as megatron_training

    from megatron_cg_plugin.session import RunSession

    class HalfCapture(FakeMegatronHelper):
        def create_cudagraphs(self) -> None:  # as Megatron's: capture flag set, GC frozen, one layer's graph made
            cuda_graphs._set_capture_start()
            gc.freeze()
            frozen_by_capture.append(gc.get_freeze_count())
            self.layers[0].cuda_graphs = [Replay("stock", 0)]
            FakeMegatronHelper.handed.append(self.layers[0].cuda_graphs[0])
            raise RuntimeError("stock capture failed at layer 2")

        def delete_cuda_graphs(self) -> None:  # Megatron's asserts a finished capture
            assert self._created, "No CUDA Graphs were created to delete."
            super().delete_cuda_graphs()

    monkeypatch.setattr(FakeMegatronHelper, "handed", [])
    plugin_installed(monkeypatch, FakeMegatronHelper, validated(RunSession(PluginConfig())))
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", HalfCapture)
    monkeypatch.setattr(megatron_training, "get_args", types.SimpleNamespace)  # what the steps set, as train() does
    model = graphable_model()
    layers = [m for m in model[0].modules() if hasattr(m, "cuda_graphs")]
    trainer = bench.MegatronTrainer(lambda *a, **k: None, (None, None, model, "optimizer", None, "config", None), {})
    monkeypatch.setattr(trainer, "synchronize", lambda: None)  # no GPU here
    monkeypatch.setattr(trainer, "pool_bytes", dict)
    progress: list[str] = []
    gc.unfreeze()  # nothing frozen before the capture (gc_freeze undoes a freeze only then)
    frozen_by_capture: list[int] = []
    with (
        pytest.raises(RuntimeError, match="stock capture failed at layer 2"),
        bench.captured_arms(("plugin", "stock"), trainer, Clock(), progress.append),
    ):
        pass
    # the plugin arm's two graphs torn down, and the failed capture's one graph reset
    assert [g.resets for g in FakeMegatronHelper.handed] == [1, 1, 1]
    assert all(layer.cuda_graphs == [] and layer.cuda_graph_manual_hooks == [] for layer in layers)
    assert not cuda_graphs.is_graph_capturing() and gc.get_freeze_count() < frozen_by_capture[0]
    assert not any("also failed" in line for line in progress) and "failed too" not in capsys.readouterr().err


def test_a_fraction_arm_captures_as_megatrons_offload_fraction_flag_would_and_puts_the_runs_back(monkeypatch):
    """``slot-offload-f<P>`` captures with ``--activation-offload-fraction P/100`` where the flag lands, the
    layers' TransformerConfig (slot-shared capture reads it there); the run's value is back after the capture,
    whether it succeeds or fails."""
    import megatron.core.transformer.cuda_graphs as cuda_graphs
    import megatron.training as megatron_training

    from megatron_cg_plugin.session import RunSession

    seen = []

    class Seeing(FakeMegatronHelper):
        fail = False

        def create_cudagraphs(self) -> None:
            seen.append({layer.config.activation_offload_fraction for layer in self.layers})
            if Seeing.fail:
                raise RuntimeError("capture failed")
            super().create_cudagraphs()

    monkeypatch.setattr(FakeMegatronHelper, "handed", [])
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", Seeing)  # every arm's base helper
    session = validated(RunSession(PluginConfig(slot_capture=True)))
    plugin_installed(monkeypatch, Seeing, session)
    monkeypatch.setattr(megatron_training, "get_args", types.SimpleNamespace)
    model = graphable_model()
    config = next(m for m in model[0].modules() if hasattr(m, "cuda_graphs")).config
    trainer = bench.MegatronTrainer(lambda *a, **k: None, (None, None, model, "optimizer", None, "config", None), {})
    for arm in ("slot-offload-w1-f50", "slot-offload", "slot-offload-staged-f0"):
        trainer.release(trainer.capture(arm))
        assert config.activation_offload_fraction == 1.0  # the run's
    Seeing.fail = True
    with pytest.raises(RuntimeError, match="capture failed"):
        trainer.capture("slot-offload-f25")
    assert seen == [{0.5}, {1.0}, {0.0}, {0.25}] and config.activation_offload_fraction == 1.0
