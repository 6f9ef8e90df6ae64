"""``megatron-cg bench <launcher flags>``: eager, Megatron's own graphs and the plugin's graphs,
measured in one process, in interleaved blocks (``plan.bench``).

The launcher builds Megatron's model, optimizer and data from the flags and enters Megatron's own
``train()``, which sets up the step (loss scaling, gradient sync hooks) as for training. Its first
``train_step`` call runs the whole bench (``patches.SCOPED``, ``bench-train-step``), then ends the
loop. One model serves every arm: each graphed block makes a fresh helper (Megatron's
``TECudaGraphHelper`` for ``stock``, the plugin's for ``plugin``, the plugin's without replay
checks for ``plugin-no-check``, the plugin's with the session's per-step recording for
``plugin-recording``, the plugin's with slot-shared
capture for ``slot``, with offload too for ``slot-offload`` (copies inside the graphs),
``slot-offload-staged`` (copies between replays), each also as ``<arm>-w<N>``, with
``--cg-offload-window N``, and with ``-f<P>``, offloading as ``--activation-offload-fraction P/100``
would), captures, trains its
steps and tears down, so the next graphed block captures again. Every step is a real Megatron
``train_step`` on the next batch, so the weights move on through the run as in training.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from megatron_cg_plugin import bench_output, diagnostics, integration, patch_builders, patches, rules
from megatron_cg_plugin.bench_output import (
    ALL_ARMS, ARMS, OFFLOAD_ARM, RECORDING_ARM, UNCHECKED_ARM, BenchResult, BlockRecord, is_known_arm, is_slot_arm,
)
from megatron_cg_plugin.capture.offload_groups import OffloadCopies
from megatron_cg_plugin.capture.slot_backend import SlotBackend
from megatron_cg_plugin.config import ContractCheck, PluginConfig
from megatron_cg_plugin.helper import bind_helper_class
from megatron_cg_plugin.launch import pretrain_gpt, run_script
from megatron_cg_plugin.launch.rendezvous import single_process_rendezvous
from megatron_cg_plugin.session import RunSession
from megatron_cg_plugin.plan.bench import (
    Block, DeviceTime, interleaved_blocks, intervals_by_kind, run_schedule, summarize,
)

METHOD = ("one model and optimizer for every arm in one process; each graphed block builds a fresh helper, "
          "captures, trains and tears down (capture runs again in the next block)")


class BenchError(ValueError):
    """The bench cannot run as asked; the message names what to change."""


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    rounds: int = 8
    steps: int = 20
    skip_steps: int = 2  # per block: the first steps after a capture warm up
    arms: tuple[str, ...] = ARMS
    warmup_steps: int = 3  # eager steps before the first block (Megatron's --cuda-graph-warmup-steps)
    profile_steps: int = 3  # per arm, after the schedule: the GPU-busy fraction
    out: Path = Path("bench-out")
    plot: bool = True
    profile_dir: Path | None = None  # per arm, the profiled steps' host operators and device timeline
    # Global batches read once before the schedule and cycled through by every step (0: the live loader).
    # The loader's host time is the same in every arm; cached, it stops adding its noise to the ratios.
    cached_batches: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(arm for arm in self.arms if not is_known_arm(arm))
        if unknown or not self.arms:
            raise BenchError(f"--bench-arms {','.join(self.arms)}: use a comma-separated subset of "
                             f"{','.join(ALL_ARMS)} (and slot-offload-w<N>, slot-offload-staged-w<N>: --cg-offload-window N; "
                             "-f<P> after either, P from 0 to 100: --activation-offload-fraction P/100).")
        if self.cached_batches < 0:
            raise BenchError(f"--bench-cached-batches {self.cached_batches}: use 0 (the live loader) or a count of "
                             "global batches to cycle through.")
        if self.steps <= self.skip_steps:
            raise BenchError(f"--bench-steps {self.steps} must exceed --bench-skip-steps {self.skip_steps}.")
        try:
            interleaved_blocks(self.arms, self.rounds)
        except ValueError as error:
            raise BenchError(f"--bench-rounds {self.rounds}: {error}") from None

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.rounds * len(self.arms) * self.steps + len(self.arms) * self.profile_steps


def parse_bench_argv(argv: Sequence[str]) -> tuple[BenchOptions, list[str]]:
    """The bench's own ``--bench-*`` options, and the launcher flags left."""
    parser = argparse.ArgumentParser(prog="megatron-cg bench", add_help=False)
    parser.add_argument("--bench-rounds", type=int, default=BenchOptions.rounds)
    parser.add_argument("--bench-steps", type=int, default=BenchOptions.steps)
    parser.add_argument("--bench-skip-steps", type=int, default=BenchOptions.skip_steps)
    parser.add_argument("--bench-arms", default=",".join(ARMS))
    parser.add_argument("--bench-out", type=Path, default=BenchOptions.out)
    parser.add_argument("--bench-no-plot", action="store_true")
    parser.add_argument("--bench-profile-dir", type=Path)
    parser.add_argument("--bench-cached-batches", type=int, default=BenchOptions.cached_batches)
    known, flags = parser.parse_known_args(list(argv))
    options = BenchOptions(rounds=known.bench_rounds, steps=known.bench_steps, skip_steps=known.bench_skip_steps,
                           arms=tuple(a for a in known.bench_arms.split(",") if a), out=known.bench_out,
                           plot=not known.bench_no_plot, profile_dir=known.bench_profile_dir,
                           cached_batches=known.bench_cached_batches)
    return options, flags


class Trainer(Protocol):
    """What the bench needs of training: a step, a capture per graphed arm, its teardown."""

    def step(self) -> None: ...

    def capture(self, arm: str) -> Any: ...

    def release(self, helper: Any) -> None: ...

    def synchronize(self) -> None: ...

    def peak_allocated(self, reset: bool = False) -> int: ...

    def pool_bytes(self) -> dict: ...


def run_bench(options: BenchOptions, trainer: Trainer, *, flags: Sequence[str] = (),
              clock: Callable[[], float] = time.perf_counter, progress: Callable[[str], None] = print,
              profile: Callable[[Callable[[], None], int, str], DeviceTime | None] | None = None,
              contract_cost: Callable[[Any], tuple[dict[str, float], int]] | None = None) -> BenchResult:
    """Runs the interleaved schedule through ``trainer`` and measures every block; then, per arm,
    ``profile`` (device time per step: the GPU-busy fraction, host copies and their overlap) and,
    on a plugin capture, ``contract_cost``."""
    records: list[BlockRecord] = []

    def timed_steps(count: int) -> list[float]:
        seconds = []
        for _ in range(count):
            trainer.synchronize()
            start = clock()
            trainer.step()
            trainer.synchronize()
            seconds.append(clock() - start)
        return seconds

    def run_block(block: Block) -> list[float]:
        helper, capture_seconds, pool_bytes = _capture(trainer, block.arm, clock)
        trainer.peak_allocated(reset=True)
        try:
            steps = timed_steps(options.steps)
        finally:
            trainer.release(helper)
        records.append(BlockRecord(block.round, block.arm, tuple(steps), trainer.peak_allocated(), capture_seconds,
                                   pool_bytes, *_arena_bytes(helper)))
        return steps

    timed_steps(options.warmup_steps)
    run_schedule(interleaved_blocks(options.arms, options.rounds), run_block, progress, skip_steps=options.skip_steps)
    busy: dict[str, float | None] = {}
    copies: dict[str, dict[str, float]] = {}
    costs: dict[str, float] = {}
    replays = None
    medians = summarize({r.block: r.step_seconds for r in records}, skip_steps=options.skip_steps).arms
    for arm in options.arms:
        helper, _, _ = _capture(trainer, arm, clock)
        try:
            # Device time per step over the arm's unprofiled median step (the profiler slows the host down).
            device = None if profile is None else profile(trainer.step, options.profile_steps, arm)
            busy[arm] = None if device is None else device.busy_seconds / medians[arm].median
            if device is not None:
                copies[arm] = dataclasses.asdict(device)
            if arm == "plugin" and contract_cost is not None:
                costs, replays = contract_cost(helper)
        finally:
            trainer.release(helper)
        progress(f"profiled {arm}: GPU busy {'-' if busy[arm] is None else f'{busy[arm]:.2f}'}")
    method = METHOD if not options.cached_batches else (
        f"{METHOD}; every step cycles through {options.cached_batches} global batch(es) read before the schedule "
        "(--bench-cached-batches: the data loader's time is left out of every arm)")
    return BenchResult(method, options.steps, options.skip_steps, tuple(records), busy, costs, replays, tuple(flags),
                       copies)


def _arena_bytes(helper: Any) -> tuple[int | None, int | None]:
    """A slot arm's GPU and pinned host arenas (outside the graph pools); None for other arms."""
    live = getattr(getattr(helper, "capture_stats", None), "slot_layers", None)
    if live is None:
        return None, None
    layers = live()
    return sum(layer.arena_bytes for layer in layers), sum(layer.host_arena_bytes for layer in layers)


def _capture(trainer: Trainer, arm: str, clock: Callable[[], float]) -> tuple[Any, float | None, int | None]:
    if arm == "eager":
        return None, None, None
    before = trainer.pool_bytes()
    trainer.synchronize()
    start = clock()
    helper = trainer.capture(arm)
    trainer.synchronize()
    seconds = clock() - start
    return helper, seconds, diagnostics.new_pool_bytes(before, trainer.pool_bytes())


# -- Megatron's side ------------------------------------------------------------------------------

class MegatronTrainer:
    """Megatron's ``train_step`` with the arguments ``train()`` passes it, on the model, optimizer
    and data ``pretrain()`` built; graph helpers as Megatron's ``train()`` makes them."""

    def __init__(self, train_step: Callable[..., Any], step_args: tuple, step_kwargs: dict, *,
                 cached_microbatches: int = 0) -> None:
        import torch
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper
        from megatron.training import get_args
        from megatron.training import training

        self.torch, self.training, self.args = torch, training, get_args()
        self.train_step, self.step_args, self.step_kwargs = train_step, step_args, dict(step_kwargs)
        _, data_iterator, self.model, self.optimizer, _, self.config, _ = step_args
        if cached_microbatches:
            self.step_args = (step_args[0], cycled_microbatches(data_iterator, cached_microbatches), *step_args[2:])
        self.iteration = self.step_kwargs.pop("iteration", None) or 0
        self.last: Any = None
        plugin = training.TECudaGraphHelper  # swapped by install() (patch helper-swap)
        if getattr(plugin, "session", None) is None:
            raise BenchError("the plugin is not installed in this process; run the bench through megatron-cg bench.")
        # The same helper without replay checks, reporting to a session of its own (the bench's figures only).
        unchecked = RunSession(dataclasses.replace(plugin.session.config, contract_check=ContractCheck.OFF))
        self._te_helper, self._session = TECudaGraphHelper, plugin.session
        self.helpers = {"stock": TECudaGraphHelper, "plugin": plugin,
                        UNCHECKED_ARM: bind_helper_class(TECudaGraphHelper, unchecked)}
        self.recording: RunSession | None = None  # the plugin-recording block's session, while it runs
        self._recorded_step: Callable[..., Any] | None = None

    def helper_class(self, arm: str) -> Any:
        """The helper class of ``arm``; slot arms are bound at their first capture."""
        if arm not in self.helpers:
            assert is_slot_arm(arm), arm  # BenchOptions refused the others
            offloaded = OFFLOAD_ARM.fullmatch(arm)
            base, window, percent = offloaded.groups() if offloaded else (arm, None, None)
            copies = OffloadCopies("between-replays" if base.endswith("staged") else "in-graph",
                                   self._session.config.offload_window if window is None else int(window))
            fraction = None if percent is None else int(percent) / 100
            self.helpers[arm] = bind_helper_class(self._te_helper, self._session, SlotBackend(
                offload=arm != "slot", copies=copies, offload_fraction=fraction))
        return self.helpers[arm]

    def step(self) -> None:
        self.args.curr_iteration = self.iteration
        if self.recording is None:
            self.last = self.train_step(*self.step_args, iteration=self.iteration, **self.step_kwargs)
        else:  # what a run's train-step-timer and training-log-tap patches call, and nothing more
            self.last = self._recorded_step(*self.step_args, iteration=self.iteration, **self.step_kwargs)
            loss_dict, num_zeros_in_grad = logged_values(self.last)
            # train() logs the iteration counted after the step (training.py l.3986, iteration += 1 before it)
            self.recording.on_training_log(iteration=self.iteration + 1, loss_dict=loss_dict,
                                           num_zeros_in_grad=num_zeros_in_grad)
        self.iteration += 1

    def capture(self, arm: str) -> Any:
        helper_class = self._recording_block() if arm == RECORDING_ARM else self.helper_class(arm)
        helper = helper_class(model=self.model, config=self.config, seq_length=self.args.seq_length,
                              micro_batch_size=self.args.micro_batch_size, optimizers=[self.optimizer])
        helper.create_cudagraphs()
        if not helper.graphs_created():
            raise BenchError(f"the {arm} arm captured no graphs (is --cuda-graph-impl transformer_engine set, and "
                             "did the capture fail? see the log above).")
        return helper

    def _recording_block(self) -> type:
        """The plugin-recording arm's block: a session of its own with the run's config (a run has
        one session and one helper), the plugin's helper reporting to it, and Megatron's train_step
        wrapped by the train-step-timer patch's code for it; ``step`` then hands it the values the
        training_log tap would. Its session is never finished: no file is written. (Every arm's
        step also passes the installed timer of the run's own session, whose mark is a no-op after
        the bench's first step: no training_log runs inside the bench to end that iteration.)"""
        self.recording = RunSession(self._session.config)
        self._recorded_step = patch_builders.build_train_step_timer(self.train_step, self.recording)
        return bind_helper_class(self._te_helper, self.recording)

    def release(self, helper: Any) -> None:
        if helper is not None and helper.graphs_created():
            helper.delete_cuda_graphs()
        self.recording = self._recorded_step = None

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def peak_allocated(self, reset: bool = False) -> int:
        if reset:
            self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.max_memory_allocated()

    def pool_bytes(self) -> dict:
        return diagnostics.memory_state().pools


def logged_values(step_result: Any) -> tuple[Any, Any]:
    """The loss dict and num-zeros of a ``train_step`` result, which train() hands training_log."""
    try:  # 0.19.2: loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros, logit
        loss_dict, _skipped, _checkpoint, _exit, _code, _grad_norm, num_zeros_in_grad, _logit = step_result
    except (TypeError, ValueError):
        raise BenchError(f"Megatron's train_step returned {type(step_result).__name__} of another shape than "
                         "0.19.2's eight values: install the supported megatron-core (docs/versions.md).") from None
    return loss_dict, num_zeros_in_grad


def cycled_microbatches(data_iterator: Any, count: int) -> Any:
    """A data iterator that serves ``count`` microbatches of ``data_iterator``, read now, again and
    again; wrapped as Megatron wraps its own (``RerunDataIterator``) so the rerun state machine
    takes it. The original iterator is not touched again. A rank without an iterator (a TP rank
    that is handed its batches by broadcast) keeps None."""
    import itertools

    from megatron.core.rerun_state_machine import RerunDataIterator

    if data_iterator is None:
        return None
    if isinstance(data_iterator, list):  # refuse_unbenchable stops this on every rank before any GPU work
        raise BenchError("--bench-cached-batches needs one data iterator (no virtual pipeline stages): "
                         "drop --bench-cached-batches for this run.")
    try:
        cached = [next(data_iterator) for _ in range(count)]
    except StopIteration:
        raise BenchError(f"--bench-cached-batches: the dataset ran out before {count} microbatches; "
                         "ask for fewer.") from None
    return RerunDataIterator(itertools.cycle(cached))


def device_time_per_step(step: Callable[[], None], steps: int, arm: str, *,
                         table_dir: Path | None = None) -> DeviceTime | None:
    """Device time of one step under torch's profiler, over ``steps`` steps: GPU-busy seconds (the
    union of its device activity; over the step's wall time it says how close the step is to the
    sum of its kernels, 1.0 being the physical limit), device-to-host and host-to-device copy
    seconds, and how much of the copying ran while a kernel ran. None if the profiler saw no
    device activity. With
    ``table_dir``, the arm's host operators by self CPU time go to ``<arm>.host_ops.txt`` there,
    to compare where two arms spend their host time, and its device activity, stream by stream, to
    ``<arm>.device_timeline.json.gz`` (where a copy holds the compute stream up)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if table_dir is not None:
        table_dir.mkdir(parents=True, exist_ok=True)
        averages = trace.key_averages()
        (table_dir / f"{arm}.host_ops.txt").write_text(
            f"{steps} profiled steps of the {arm} arm\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        bench_output.write_host_ops(table_dir / f"{arm}.host_ops.json", steps,
                                    {op.key: (op.count, op.self_cpu_time_total) for op in averages})
    timeline = [(event.time_range.start, event.time_range.end,
                 "d2h" if "DtoH" in event.name else "h2d" if "HtoD" in event.name else "kernel",
                 event.device_resource_id, event.name)
                for event in trace.events() if event.device_type == DeviceType.CUDA]
    if not timeline:
        return None
    by_kind = intervals_by_kind(timeline)
    if table_dir is not None:
        bench_output.write_device_timeline(table_dir / f"{arm}.device_timeline.json.gz", steps, timeline)
    return DeviceTime.of(by_kind["kernel"], by_kind["d2h"], by_kind["h2d"], steps=steps, scale=1e-6)


def contract_check_cost(helper: Any, *, microbatches: int, repeats: int = 2000) -> tuple[dict[str, float], int]:
    """Host microseconds of one layer replay's contract check per mode (the first graphed layer's
    first graph, replayed with fresh tensors of its captured inputs), and layer replays per step
    (every graphed layer once per microbatch)."""
    import torch
    from torch.utils import _pytree as pytree

    layer, args, kwargs = helper.first_capture_sample
    fresh = pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, (args, kwargs))
    costs = {}
    for mode in ContractCheck:
        check = helper._contract_check(layer, "bench", args, kwargs, mode)
        start = time.perf_counter()
        for _ in range(repeats):
            check(*fresh)
        costs[mode.value] = (time.perf_counter() - start) / repeats * 1e6
    return costs, len(helper.flattened_callables) * microbatches


def bench_train_step(options: BenchOptions, flags: Sequence[str], train_step: Callable[..., Any],
                     sink: list[BenchResult], before: Callable[[], None] | None = None) -> Callable[..., Any]:
    """Stands in for Megatron's ``train_step``: its first call runs ``before`` (if any), then the
    bench through the real ``train_step``, and returns the last step's result; ``train()``'s loop
    then ends."""

    @functools.wraps(train_step)  # install()'s signature check, run after this patch for a script, looks through it
    def step(*args: Any, **kwargs: Any) -> Any:
        if sink:
            raise BenchError("Megatron's loop went on after the bench; this megatron-core reads --train-iters "
                             "differently: install the supported version (docs/versions.md).")
        if before is not None:
            before()
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        trainer = MegatronTrainer(train_step, args, kwargs,
                                  cached_microbatches=options.cached_batches * get_num_microbatches())
        cost = functools.partial(contract_check_cost, microbatches=get_num_microbatches())
        profile = functools.partial(device_time_per_step, table_dir=options.profile_dir)
        sink.append(run_bench(options, trainer, flags=flags, profile=profile,
                              contract_cost=cost if "plugin" in options.arms else None))
        trainer.args.train_iters = trainer.args.iteration = (kwargs.get("iteration") or 0) + 1  # the loop's last
        return trainer.last

    return step


def refuse_unbenchable(args: Any, config: PluginConfig, options: BenchOptions) -> None:
    """Flags the bench cannot measure faithfully, refused (``BenchError``) before any GPU work; ``config``
    is the plugin's config in force (the plugin arm's)."""
    graphed = [arm for arm in options.arms if arm != "eager"]
    if graphed and args.cuda_graph_impl != "transformer_engine":
        raise BenchError(f"the {'/'.join(graphed)} arm(s) capture TE graphs: pass --cuda-graph-impl transformer_engine "
                         "(or --bench-arms eager).")
    packed = (getattr(args, "dataloader_inter_document_masking", False) or getattr(args, "sft", False)) \
        and not getattr(args, "hybrid_context_parallel", False)
    if "stock" in options.arms and packed:
        raise BenchError("the stock arm replays Megatron's own graphs, which refuse packed batches (rule "
                         "packed-sequences-te-graphs): bench packed data with --bench-arms eager,plugin.")
    if args.cuda_graph_impl == "transformer_engine" and args.cuda_graph_warmup_steps < 1:
        raise BenchError("--cuda-graph-warmup-steps 0 would make Megatron capture its own graphs before the bench's "
                         "first step; leave it at its default (3) or set it >= 1.")
    if args.use_distributed_optimizer and args.overlap_param_gather:
        raise BenchError("the bench runs inside Megatron's first train_step, while the forward pre-hooks that "
                         "--overlap-param-gather needs are still off: drop --overlap-param-gather for the bench.")
    if UNCHECKED_ARM in options.arms and config.contract_check is not ContractCheck.FULL:
        raise BenchError(f"the {UNCHECKED_ARM} arm measures what --cg-contract-check full costs against the plugin arm: "
                         f"leave --cg-contract-check at full (it is {config.contract_check}).")
    if options.cached_batches and (args.pipeline_model_parallel_size > 1
                                   or getattr(args, "virtual_pipeline_model_parallel_size", None)):
        raise BenchError("--bench-cached-batches caches the batches of a PP = 1 run (each stage of a pipeline reads "
                         "its own part): drop --bench-cached-batches, or run the bench with "
                         "--pipeline-model-parallel-size 1.")
    if args.save:
        raise BenchError("--save would checkpoint the weights the bench's blocks trained: drop --save for the bench.")
    if any(is_slot_arm(arm) for arm in options.arms):  # the rules --cg-slot-capture itself would get
        facts = rules.facts_from_args(args, te_available=True, apex_fused_wgrad=True,
                                      config=PluginConfig(slot_capture=True))
        broken = [message for name, message in rules.violations(facts) if name.startswith("slot-capture")]
        offloading = [arm for arm in options.arms if arm.startswith("slot-offload")]
        if offloading and not (getattr(args, "fine_grained_activation_offloading", False)
                               and getattr(args, "offload_modules", None)):
            broken.append(f"the {'/'.join(offloading)} arm(s) offload what Megatron's flags select, and these offload "
                          "nothing: add --fine-grained-activation-offloading --offload-modules ...")
        if broken:
            raise BenchError(f"the {'/'.join(a for a in options.arms if is_slot_arm(a))} arm(s) capture with "
                             f"--cg-slot-capture, which these flags break: {' '.join(broken)}")


def user_script(flags: Sequence[str]) -> Path | None:
    """The training script when the bench's first flag names one (``megatron-cg bench [--bench-*]
    SCRIPT.py <its flags>``), else None (the launcher's flags)."""
    if flags and flags[0].endswith(".py"):
        script = Path(flags[0])
        if not script.is_file():
            raise BenchError(f"no such script {script}: give the path of a Megatron training script "
                             "(e.g. Megatron-LM's pretrain_gpt.py), or the launcher's flags alone.")
        return script
    return None


def main(argv: Sequence[str]) -> int:
    from megatron.training import training

    options, flags = parse_bench_argv(argv)
    if options.plot:
        bench_output.plot_available()
    script = user_script(flags)
    if script is not None:
        flags = flags[1:]
    # Enough iterations for every block, and no validation pass after them (the bench's values win).
    flags = [*flags, "--train-iters", str(options.total_steps), "--eval-iters", "0"]
    results: list[BenchResult] = []
    if script is None:
        _bench_launcher(options, flags, training, results)
    else:
        _bench_script(script, options, flags, training, results)
    if not results:
        raise BenchError("Megatron's pretrain() returned without training (are --train-iters and --do-train "
                         "set? see the log above).")
    for path in bench_output.write(results[0], options.out, with_plot=options.plot):
        print(f"megatron-cg bench: wrote {path}")
    print(bench_output.markdown(results[0]))
    return 0


def _bench_launcher(options: BenchOptions, flags: Sequence[str], training: Any, results: list[BenchResult]) -> None:
    """The launcher's model and data: its flags are parsed (and refused) before any GPU work."""
    with single_process_rendezvous():
        session = integration.install(launcher=True)
        try:
            args = pretrain_gpt.parse_megatron_args(flags)
            refuse_unbenchable(args, session.config, options)  # the config the flags resolved
            driver = bench_train_step(options, flags, training.train_step, results)
            with patches.scoped(training, "train_step", driver, "bench-train-step"):
                pretrain_gpt.run(args, session)
        finally:
            integration.uninstall()


def _bench_script(script: Path, options: BenchOptions, flags: Sequence[str], training: Any,
                  results: list[BenchResult]) -> None:
    """A user's own script, run as ``megatron-cg run`` runs it: the script parses its flags and
    builds its model and data, so the bench's refusals come at its first train_step, before any block."""
    from megatron.training import get_args

    def refuse() -> None:
        session = getattr(training.TECudaGraphHelper, "session", None)  # install() swapped the helper
        if session is None:
            raise BenchError(f"{script} ran without the plugin installed; run it through megatron-cg bench.")
        refuse_unbenchable(get_args(), session.config, options)

    driver = bench_train_step(options, flags, training.train_step, results, before=refuse)
    with patches.scoped(training, "train_step", driver, "bench-train-step"):
        code = run_script.run_in_process(script, run_script.expand_preset(flags))
    if code and not results:
        raise BenchError(f"{script} exited with code {code} before the bench ran; its output is above.")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
