"""``megatron-cg bench <launcher flags>``: eager, Megatron's own graphs and the plugin's graphs,
measured in one process, in interleaved blocks (``bench.schedule``).

The launcher builds Megatron's model, optimizer and data from the flags and enters Megatron's own
``train()``, which sets up the step (loss scaling, gradient sync hooks) as for training. Its first
``train_step`` call runs the whole bench (``ledger.SCOPED``, ``bench-train-step``), then ends the
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

``--bench-interleave steps`` captures every graphed arm once up front instead, each with its own
helper and graph pool, all alive together, and then alternates single steps in mirrored cycles
(``bench.schedule.interleaved_steps``), switching the layers to an arm's graphs between steps
(``MegatronTrainer.activate``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from megatron_cg_plugin import console, foreign_state, installation, rules
from megatron_cg_plugin.bench import output as bench_output
from megatron_cg_plugin.bench.output import (
    ALL_ARMS,
    ARMS,
    OFFLOAD_ARM,
    RECORDING_ARM,
    SCHEDULES,
    UNCHECKED_ARM,
    BenchResult,
    BlockRecord,
    CaptureRecord,
    StepRecord,
    is_known_arm,
    is_slot_arm,
)
from megatron_cg_plugin.bench.schedule import (
    Block,
    DeviceTime,
    fewest_for_interval,
    interleaved_blocks,
    interleaved_steps,
    intervals_by_kind,
    run_schedule,
)
from megatron_cg_plugin.capture import accounting
from megatron_cg_plugin.capture.contracts import (
    FIRST_MICROBATCH,
    CheckedGraph,
    ReplayContract,
    StaticInput,
)
from megatron_cg_plugin.capture.transaction import (
    CaptureTransaction,
    attribute,
    megatron_capture_state,
)
from megatron_cg_plugin.capture_lifecycle import bind_helper_class
from megatron_cg_plugin.config import ContractCheck, PluginConfig
from megatron_cg_plugin.inputs import input_path_problem, output_folder_problem
from megatron_cg_plugin.launch import pretrain_gpt, run_script
from megatron_cg_plugin.launch.presets import find_preset
from megatron_cg_plugin.launch.rendezvous import single_process_rendezvous
from megatron_cg_plugin.parse_errors import OneLineErrors, unknown_own_flag
from megatron_cg_plugin.patching import builders as patch_builders
from megatron_cg_plugin.session import RunSession
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.slot_sharing.megatron_backend import SlotBackend
from megatron_cg_plugin.slot_sharing.offload_groups import OffloadCopies

__all__ = [
    "BenchError",
    "BenchOptions",
    "BenchTrainer",
    "METHOD",
    "MegatronTrainer",
    "STEPS_METHOD",
    "StepCycles",
    "slot_bytes",
    "bench_train_step",
    "capture_arm",
    "captured_arms",
    "contract_check_cost",
    "cycled_microbatches",
    "device_time_per_step",
    "first_train_step",
    "logged_values",
    "main",
    "parse_bench_argv",
    "patch_builders",
    "python_calls_per_step",
    "recording_cost",
    "refuse_unbenchable",
    "run_bench",
    "run_in_first_train_step",
    "run_step_cycles",
    "timed_step",
    "user_script",
]

METHOD = (
    "one model and optimizer for every arm in one process; each graphed block builds a fresh helper, "
    "captures, trains and tears down (capture runs again in the next block)"
)
STEPS_METHOD = (
    "one model and optimizer for every arm in one process; every graphed arm captured once up front, "
    "each with its own helper and graph pool, all alive together; single steps alternate the arms in "
    "mirrored cycles (A B B A, then B A A B), the layers switched to an arm's graphs between steps "
    "(--bench-interleave steps)"
)


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
    # blocks: the block schedule above; steps: every arm captured once, single steps in mirrored cycles,
    # ``cycles`` of them, the first ``skip_steps`` cycles dropped.
    interleave: str = "blocks"
    cycles: int = 60
    # steps: before the schedule's own captures, each graphed arm captured and released this many mirrored
    # rounds, so capture times compare capture against capture in one process (the block schedule
    # recaptures every block already).
    capture_rounds: int = 0
    # steps: the cycles stop at the first even count of kept cycles (6 at least, the interval's fewest) past this
    # many seconds of cycles (0: all ``cycles``), so a bench on a host slower than planned still ends with its
    # summary (a bench that runs into its job's limit otherwise writes none). Start-up, capture and profiling come
    # on top.
    seconds: float = 0.0

    def __post_init__(self) -> None:
        unknown = sorted(arm for arm in self.arms if not is_known_arm(arm))
        if unknown or not self.arms:
            raise BenchError(
                f"--bench-arms {','.join(self.arms)}: use a comma-separated subset of "
                f"{','.join(ALL_ARMS)} (and slot-offload-w<N>, slot-offload-staged-w<N>: --cg-offload-window N; "
                "-f<P> after either, P from 0 to 100: --activation-offload-fraction P/100)."
            )
        for problem in (
            output_folder_problem("--bench-out", self.out),
            output_folder_problem("--bench-profile-dir", self.profile_dir),
        ):
            if problem is not None:  # said before the model is built, not when the figures are written
                raise BenchError(problem)
        if self.skip_steps < 0:
            raise BenchError(f"--bench-skip-steps {self.skip_steps}: give the steps left out of each block, 0 or more.")
        if self.cached_batches < 0:
            raise BenchError(
                f"--bench-cached-batches {self.cached_batches}: use 0 (the live loader) or a count of "
                "global batches to cycle through."
            )
        if self.interleave not in SCHEDULES:
            raise BenchError(f"--bench-interleave {self.interleave}: use {' or '.join(SCHEDULES)}.")
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise BenchError(
                f"--bench-seconds {self.seconds:g}: give the seconds of cycles after which the bench stops "
                "(0, the default: no limit)."
            )
        if self.interleave == "steps":
            self._check_steps()
            return
        if self.capture_rounds:
            raise BenchError(
                f"--bench-capture-rounds {self.capture_rounds}: the block schedule captures every block "
                "already (its capture column spans them): drop the flag, or add --bench-interleave steps."
            )
        if self.seconds:
            raise BenchError(
                f"--bench-seconds {self.seconds:g} stops the step schedule's cycles: add --bench-interleave "
                "steps, or size the blocks with --bench-rounds."
            )
        if self.steps <= self.skip_steps:
            raise BenchError(f"--bench-steps {self.steps} must exceed --bench-skip-steps {self.skip_steps}.")
        try:
            interleaved_blocks(self.arms, self.rounds)
        except ValueError as error:
            raise BenchError(f"--bench-rounds {self.rounds}: {error}") from None

    def _check_steps(self) -> None:
        slots = [arm for arm in self.arms if is_slot_arm(arm)]
        if slots:
            raise BenchError(
                f"--bench-interleave steps keeps every arm's graphs alive and switches them between steps; "
                f"the {'/'.join(slots)} arm(s) capture slot-shared graphs, whose arenas and saved-tensor "
                "hooks are not switched: drop them from --bench-arms, or run them with "
                "--bench-interleave blocks."
            )
        fewest = fewest_for_interval()
        if self.capture_rounds:
            self._check_capture_rounds(2 * fewest)
        if self.cycles - self.skip_steps < fewest:
            raise BenchError(
                f"--bench-cycles {self.cycles} keeps {max(0, self.cycles - self.skip_steps)} cycle(s) after "
                f"--bench-skip-steps {self.skip_steps}; the ratios' 95% interval needs at least {fewest}: "
                f"raise --bench-cycles to {self.skip_steps + fewest} or more."
            )

    def _check_capture_rounds(self, fewest: int) -> None:
        """Capture rounds give ratios over pairs of mirrored rounds: two graphed arms, and pairs
        enough for the median's interval."""
        graphed = [arm for arm in self.arms if arm != "eager"]
        if len(graphed) < 2:
            raise BenchError(
                f"--bench-capture-rounds {self.capture_rounds} compares the captures of two or more graphed "
                f"arms, and --bench-arms {','.join(self.arms)} names {len(graphed)}: add one (e.g. "
                "--bench-arms plugin,stock), or drop --bench-capture-rounds."
            )
        if self.capture_rounds < fewest or self.capture_rounds % 2:
            raise BenchError(
                f"--bench-capture-rounds {self.capture_rounds}: the capture ratios' 95% interval needs "
                f"{fewest // 2} pairs of mirrored rounds: give an even number of rounds, {fewest} or more."
            )

    @property
    def step_cycles(self) -> StepCycles:
        return StepCycles(self.arms, self.cycles, self.skip_steps, self.seconds)

    @property
    def total_steps(self) -> int:
        if self.interleave == "steps":
            timed = self.cycles * 2 * len(self.arms)
        else:
            timed = self.rounds * len(self.arms) * self.steps
        profiled = 2 if self.profile_dir is not None else 1  # with a profile dir, the Python profile's steps too
        return self.warmup_steps + timed + len(self.arms) * self.profile_steps * profiled


def parse_bench_argv(argv: Sequence[str]) -> tuple[BenchOptions, list[str]]:
    """The bench's own ``--bench-*`` options, and the launcher flags left."""
    parser = OneLineErrors(prog="megatron-cg bench", add_help=False)
    # Sizes without a default here: a size the chosen schedule does not use is refused, not ignored.
    parser.add_argument("--bench-rounds", type=int)
    parser.add_argument("--bench-steps", type=int)
    parser.add_argument("--bench-cycles", type=int)
    parser.add_argument("--bench-interleave", default=BenchOptions.interleave)
    parser.add_argument("--bench-skip-steps", type=int, default=BenchOptions.skip_steps)
    parser.add_argument("--bench-arms", default=",".join(ARMS))
    parser.add_argument("--bench-out", type=Path, default=BenchOptions.out)
    parser.add_argument("--bench-no-plot", action="store_true")
    parser.add_argument("--bench-profile-dir", type=Path)
    parser.add_argument("--bench-cached-batches", type=int, default=BenchOptions.cached_batches)
    parser.add_argument("--bench-capture-rounds", type=int, default=BenchOptions.capture_rounds)
    parser.add_argument("--bench-seconds", type=float, default=BenchOptions.seconds)
    known, flags = parser.parse_known_args(list(argv))
    typo = unknown_own_flag(parser, flags, "--bench-", "bench")
    if typo is not None:
        raise BenchError(typo)
    try:
        find_preset(flags)  # a misspelt preset, named before anything is imported or built
    except ValueError as error:
        raise BenchError(str(error)) from None
    stepwise = known.bench_interleave == "steps"
    unused = (
        [f"--bench-{name}" for name in ("rounds", "steps") if getattr(known, f"bench_{name}") is not None]
        if stepwise
        else ["--bench-cycles"]
        if known.bench_cycles is not None
        else []
    )
    if unused:
        raise BenchError(
            f"{' and '.join(unused)} size(s) the {'block' if stepwise else 'step'} schedule, which this "
            f"bench does not run (--bench-interleave {known.bench_interleave}): "
            + ("give --bench-cycles N instead." if stepwise else "add --bench-interleave steps, or drop it.")
        )
    sizes = {
        name: value
        for name, value in (
            ("rounds", known.bench_rounds),
            ("steps", known.bench_steps),
            ("cycles", known.bench_cycles),
        )
        if value is not None
    }
    options = BenchOptions(
        skip_steps=known.bench_skip_steps,
        arms=tuple(a for a in known.bench_arms.split(",") if a),
        out=known.bench_out,
        plot=not known.bench_no_plot,
        profile_dir=known.bench_profile_dir,
        cached_batches=known.bench_cached_batches,
        interleave=known.bench_interleave,
        capture_rounds=known.bench_capture_rounds,
        seconds=known.bench_seconds,
        **sizes,
    )
    return options, flags


class BenchTrainer(Protocol):
    """What the bench needs of training: a step, a capture per graphed arm (the arm is active after
    it), its teardown (of the active arm), and for the step schedule the switch between captured arms."""

    def step(self) -> None: ...

    def capture(self, arm: str) -> Any: ...

    def release(self, helper: Any) -> None: ...

    def activate(self, arm: str) -> None: ...  # the step schedule: the next steps run as ``arm``'s

    def deactivate(self) -> None: ...  # the step schedule: the layers eager, the active arm's graphs kept aside

    def synchronize(self) -> None: ...

    def peak_allocated(self, reset: bool = False) -> int: ...

    def pool_bytes(self) -> dict: ...


def run_bench(
    options: BenchOptions,
    trainer: BenchTrainer,
    *,
    flags: Sequence[str] = (),
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] = print,
    profile: Callable[[Callable[[], None], int, str], DeviceTime | None] | None = None,
    contract_cost: Callable[[Any], tuple[dict[str, float], int]] | None = None,
    recording_cost: Callable[[], float] | None = None,
) -> BenchResult:
    """Runs the chosen schedule through ``trainer`` and measures every step; then, per arm,
    ``profile`` (device time per step: the GPU-busy fraction, host copies and their overlap), on a
    plugin capture ``contract_cost``, and on the plugin-recording arm's ``recording_cost``."""
    for _ in range(options.warmup_steps):
        timed_step(trainer, clock)
    run = _bench_steps if options.interleave == "steps" else _bench_blocks
    return run(
        options,
        trainer,
        tuple(flags),
        clock,
        progress,
        functools.partial(
            _profiled,
            options,
            trainer=trainer,
            profile=profile,
            contract_cost=contract_cost,
            recording_cost=recording_cost,
            progress=progress,
        ),
    )


def _bench_steps(
    options: BenchOptions,
    trainer: BenchTrainer,
    flags: tuple[str, ...],
    clock: Callable[[], float],
    progress: Callable[[str], None],
    profiled: Callable[..., BenchResult],
) -> BenchResult:
    """The step schedule: the capture rounds (if any), every arm captured once, then single steps in
    mirrored cycles, then each arm profiled with its graphs in place, then the teardown."""
    capture_rounds = _capture_rounds(options, trainer, clock, progress)
    with captured_arms(options.arms, trainer, clock, progress) as captured:
        steps, peaks = run_step_cycles(options.step_cycles, trainer, clock, progress)
        records = tuple(
            BlockRecord(0, arm, (), peaks[arm], seconds, pool) for arm, (_, seconds, pool) in captured.items()
        )
        cycles_run = len(steps) // (2 * len(options.arms))
        result = BenchResult(
            _method(options, cycles_run),
            1,
            options.skip_steps,
            records,
            {},
            {},
            None,
            flags,
            schedule="steps",
            steps=tuple(steps),
            capture_rounds=capture_rounds,
        )

        @contextlib.contextmanager
        def activated(arm: str) -> Iterator[Any]:
            trainer.activate(arm)
            yield captured[arm][0]

        return profiled(result, with_arm=activated)


def _bench_blocks(
    options: BenchOptions,
    trainer: BenchTrainer,
    flags: tuple[str, ...],
    clock: Callable[[], float],
    progress: Callable[[str], None],
    profiled: Callable[..., BenchResult],
) -> BenchResult:
    """The block schedule: each block captures, steps and tears down; then each arm captured again
    to be profiled."""
    records: list[BlockRecord] = []

    def run_block(block: Block) -> list[float]:
        helper, capture_seconds, pool_bytes = capture_arm(trainer, block.arm, clock)
        trainer.peak_allocated(reset=True)
        try:
            steps = [timed_step(trainer, clock) for _ in range(options.steps)]
        finally:
            trainer.release(helper)
        records.append(
            BlockRecord(
                block.round,
                block.arm,
                tuple(steps),
                trainer.peak_allocated(),
                capture_seconds,
                pool_bytes,
                *slot_bytes(helper),
            )
        )
        return steps

    run_schedule(interleaved_blocks(options.arms, options.rounds), run_block, progress, skip_steps=options.skip_steps)

    @contextlib.contextmanager
    def recaptured(arm: str) -> Iterator[Any]:
        helper, _, _ = capture_arm(trainer, arm, clock)
        try:
            yield helper
        finally:
            trainer.release(helper)

    return profiled(
        BenchResult(_method(options), options.steps, options.skip_steps, tuple(records), {}, {}, None, flags),
        with_arm=recaptured,
    )


def _method(options: BenchOptions, cycles_run: int | None = None) -> str:
    """The method line: which schedule ran (with steps, over ``cycles_run`` cycles), and what was left
    out of every arm."""
    cycles = options.cycles if cycles_run is None else cycles_run
    method = (
        METHOD
        if options.interleave == "blocks"
        else (f"{STEPS_METHOD}; the first {options.skip_steps} of {cycles} cycles dropped (--bench-skip-steps)")
    )
    if cycles < options.cycles and options.interleave == "steps":
        method += f"; stopped after {cycles} of {options.cycles} cycles at --bench-seconds {options.seconds:g}"
    if options.capture_rounds:
        method += (
            f"; before the cycles, each graphed arm captured and released in {options.capture_rounds} mirrored rounds "
            "(--bench-capture-rounds)"
        )
    if options.cached_batches:
        method += (
            f"; every step cycles through {options.cached_batches} global batch(es) read before the schedule "
            "(--bench-cached-batches: the data loader's time is left out of every arm)"
        )
    return method


def timed_step(trainer: BenchTrainer, clock: Callable[[], float]) -> float:
    """One step's seconds, the device idle at both ends."""
    trainer.synchronize()
    start = clock()
    trainer.step()
    trainer.synchronize()
    return clock() - start


def _capture_rounds(
    options: BenchOptions, trainer: BenchTrainer, clock: Callable[[], float], progress: Callable[[str], None]
) -> tuple[CaptureRecord, ...]:
    """``--bench-capture-rounds``: each graphed arm captured from eager layers and released at once,
    round by round in mirrored order (``BenchResult.capture_summary`` pairs the rounds)."""
    graphed = [arm for arm in options.arms if arm != "eager"]
    records = []
    for block in interleaved_blocks(graphed, options.capture_rounds) if options.capture_rounds else ():
        helper, seconds, _ = capture_arm(trainer, block.arm, clock)  # a failed capture leaves nothing captured
        if seconds is None:  # only the eager arm is not captured, and it has no capture rounds
            raise TypeError(f"arm {block.arm} was not captured")
        try:  # the arm is in place until released, whatever stops the bench here
            records.append(CaptureRecord(block.round, block.arm, seconds))
            progress(f"capture round {block.round + 1}/{options.capture_rounds}: {block.arm} {seconds:.2f} s")
        finally:
            trainer.release(helper)
    return tuple(records)


@contextlib.contextmanager
def captured_arms(
    arms: Sequence[str],
    trainer: BenchTrainer,
    clock: Callable[[], float],
    progress: Callable[[str], None],
    *,
    failed: Callable[[str, Exception], None] | None = None,
) -> Iterator[dict[str, tuple[Any, float | None, int | None]]]:
    """Every arm captured once, in order, each from eager layers (a capture that found another arm's
    graphs on a layer would replay them instead of capturing); all stay alive until the block
    ends, then each is torn down while active, the last captured first (each teardown then finds
    only its own pools new). With ``failed``, an arm whose capture fails (the trainer's capture leaves
    nothing of it behind) is handed to it and left out, and the others go on."""
    captured: dict[str, tuple[Any, float | None, int | None]] = {}

    def tear_down() -> None:
        for arm in reversed(list(captured)):
            trainer.activate(arm)
            trainer.release(captured[arm][0])

    try:
        for arm in arms:
            trainer.deactivate()
            try:
                captured[arm] = capture_arm(trainer, arm, clock)
            except Exception as error:
                if failed is None:
                    raise
                failed(arm, error)
                continue
            _, seconds, pool = captured[arm]
            if seconds is not None:
                progress(f"captured {arm}: {seconds:.2f} s, graph pools {(pool or 0) / 2**20:.0f} MiB")
        yield captured
    except BaseException:
        try:
            tear_down()
        except Exception as error:  # noqa: BLE001 - the failure that stopped the bench is the one raised
            progress(f"tearing the captured arms down after that failure also failed: {error!r}")
        raise
    tear_down()


@dataclasses.dataclass(frozen=True)
class StepCycles:
    """The step schedule's size: ``cycles`` mirrored cycles of ``arms``, the first ``skip_cycles`` dropped,
    ending early past ``seconds`` of cycles (0: no limit)."""

    arms: tuple[str, ...]
    cycles: int
    skip_cycles: int
    seconds: float = 0.0
    seconds_flag: str = "--bench-seconds"  # the flag that set ``seconds``, for the progress line


def run_step_cycles(
    plan: StepCycles,
    trainer: BenchTrainer,
    clock: Callable[[], float],
    progress: Callable[[str], None],
    *,
    stop: Callable[[Sequence[StepRecord]], str | None] | None = None,
) -> tuple[list[StepRecord], dict[str, int]]:
    """The step schedule over the captured arms: each step timed alone, the arm switched before its
    sync; per arm the peak allocated over its steps. With ``plan.seconds``, fewer cycles; with ``stop``,
    fewer too once it gives a reason, asked at the same places (the steps so far)."""
    steps: list[StepRecord] = []
    peaks: dict[str, int] = {}
    per_cycle = 2 * len(plan.arms)
    fewest = fewest_for_interval()
    start = clock()
    for index, step in enumerate(interleaved_steps(plan.arms, plan.cycles)):
        trainer.activate(step.arm)
        trainer.peak_allocated(reset=True)
        steps.append(StepRecord(step.cycle, step.arm, timed_step(trainer, clock)))
        peaks[step.arm] = max(peaks.get(step.arm, 0), trainer.peak_allocated())
        if (index + 1) % per_cycle == 0:
            cycle = steps[-per_cycle:]
            line = ", ".join(
                f"{arm} {sum(r.seconds for r in cycle if r.arm == arm) / 2 * 1e3:.2f} ms" for arm in plan.arms
            )
            progress(f"cycle {step.cycle + 1}/{plan.cycles}: {line}")
            done = step.cycle + 1
            kept = done - plan.skip_cycles
            # stopped with pairs of kept cycles (each arm outer as often), enough of them
            if not (kept % 2 == 0 and kept >= fewest and done < plan.cycles):
                continue
            if plan.seconds and clock() - start >= plan.seconds:
                progress(f"{plan.seconds_flag} {plan.seconds:g} reached: the cycles stop after {done} of {plan.cycles}")
                break
            reason = None if stop is None else stop(steps)
            if reason is not None:
                progress(f"{reason}: the cycles stop after {done} of {plan.cycles}")
                break
    return steps, peaks


def _profiled(
    options: BenchOptions,
    result: BenchResult,
    *,
    trainer: BenchTrainer,
    with_arm: Callable[[str], contextlib.AbstractContextManager[Any]],
    profile: Callable[[Callable[[], None], int, str], DeviceTime | None] | None,
    contract_cost: Callable[[Any], tuple[dict[str, float], int]] | None,
    recording_cost: Callable[[], float] | None,
    progress: Callable[[str], None],
) -> BenchResult:
    """``result`` with, per arm (its graphs in place through ``with_arm``, which gives its helper),
    the profiled device time per step, on the plugin arm the contract check's cost, and on the
    plugin-recording arm the recording hooks' cost."""
    busy: dict[str, float | None] = {}
    copies: dict[str, dict[str, float]] = {}
    costs: dict[str, float] = {}
    replays = recording_us = None
    medians = result.summary().arms
    for arm in options.arms:
        with with_arm(arm) as helper:
            # Device time per step over the arm's unprofiled median step (the profiler slows the host down).
            device = None if profile is None else profile(trainer.step, options.profile_steps, arm)
            busy[arm] = None if device is None else device.busy_seconds / medians[arm].median
            if device is not None:
                copies[arm] = dataclasses.asdict(device)
            if arm == "plugin" and contract_cost is not None:
                costs, replays = contract_cost(helper)
            if arm == RECORDING_ARM and recording_cost is not None:
                recording_us = recording_cost()
        progress(f"profiled {arm}: GPU busy {'-' if busy[arm] is None else f'{busy[arm]:.2f}'}")
    return dataclasses.replace(
        result,
        busy_fraction=busy,
        contract_check_us=costs,
        replays_per_step=replays,
        copies=copies,
        recording_us=recording_us,
    )


def slot_bytes(helper: Any) -> tuple[int | None, int | None, int | None]:
    """A slot arm's memory outside the graph pools: GPU arenas, pinned host arenas, boundary buffers; None
    for other arms."""
    live = getattr(getattr(helper, "capture_stats", None), "slot_layers", None)
    if live is None:
        return None, None, None
    layers = live()
    return tuple(sum(getattr(layer, part) for layer in layers) for part in _SLOT_PARTS)


_SLOT_PARTS = ("arena_bytes", "host_arena_bytes", "boundary_bytes")


def capture_arm(trainer: BenchTrainer, arm: str, clock: Callable[[], float]) -> tuple[Any, float | None, int | None]:
    if arm == "eager":
        return None, None, None
    before = trainer.pool_bytes()
    trainer.synchronize()
    start = clock()
    helper = trainer.capture(arm)
    trainer.synchronize()
    seconds = clock() - start
    return helper, seconds, accounting.new_pool_bytes(before, trainer.pool_bytes())


# -- Megatron's side ------------------------------------------------------------------------------


@dataclasses.dataclass
class _ArmState:
    """Everything that makes a training step run as one captured arm. Megatron 0.19.2's layers
    replay whatever graphs their own attributes hold: ``GraphableMegatronModule.__call__`` replays
    when ``cuda_graphs`` is not empty (``_te_cuda_graph_replay``: graph ``current_microbatch``, after
    the ``cuda_graph_manual_hooks``), and captures when it is empty and a capture is on; the helper
    only hands them out (``create_cudagraphs``) and takes them back (``delete_cuda_graphs``). The
    plugin's graphs sit in those same lists, each wrapped with its helper's contract check and replay
    counter; its capture wrappers are gone once it returns. The plugin-recording arm also steps
    through its own session (``recording``, ``recorded_step``). Parked, the layers' lists are kept
    here, saved through ``foreign_state``, and the layers hold empty ones (eager)."""

    arm: str
    helper: Any
    recording: RunSession | None = None
    recorded_step: Callable[..., Any] | None = None
    parked: foreign_state.Changes = dataclasses.field(default_factory=foreign_state.Changes)  # layers' _ARM_LISTS


_ARM_LISTS = ("cuda_graphs", "cuda_graph_manual_hooks")  # what a layer replays of an arm (_ArmState)


class MegatronTrainer:
    """Megatron's ``train_step`` with the arguments ``train()`` passes it, on the model, optimizer
    and data ``pretrain()`` built; graph helpers as Megatron's ``train()`` makes them. One arm is
    active at a time: the one captured last, or the one ``activate`` switched to."""

    def __init__(
        self, train_step: Callable[..., Any], step_args: tuple, step_kwargs: dict, *, cached_microbatches: int = 0
    ) -> None:
        import torch
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper
        from megatron.training import get_args, training

        session = installation.active_session()
        if session is None:
            raise BenchError("the plugin is not installed in this process; run the bench through megatron-cg bench.")
        self.torch, self.training, self.args = torch, training, get_args()
        self.train_step, self.step_args, self.step_kwargs = train_step, step_args, dict(step_kwargs)
        _, data_iterator, self.model, self.optimizer, _, self.config, schedule = step_args
        if cached_microbatches:
            self.step_args = (step_args[0], cycled_microbatches(data_iterator, cached_microbatches), *step_args[2:])
        self.iteration = self.step_kwargs.pop("iteration", None) or 0
        self.last: Any = None
        plugin = training.TECudaGraphHelper  # the plugin's helper, swapped in by install() (patch helper-swap)
        # The same helper without replay checks, reporting to a session of its own (the bench's figures only).
        unchecked = RunSession(dataclasses.replace(session.config, contract_check=ContractCheck.OFF))
        self._te_helper, self._session = TECudaGraphHelper, session
        if callable(schedule):  # the run's step marks, as the train-step-timer patch enters them: a script's
            # bench holds the bare train_step (the patch wraps the bench's own stand-in)
            self.step_args = (
                *self.step_args[:6],
                patch_builders.marked_schedule(schedule, self._session.step_marks),
                *self.step_args[7:],
            )
        self.helpers = {
            "stock": TECudaGraphHelper,
            "plugin": plugin,
            UNCHECKED_ARM: bind_helper_class(TECudaGraphHelper, unchecked),
        }
        self._active: _ArmState | None = None  # None: eager
        self._parked: dict[str, _ArmState] = {}  # captured arms not active (the step schedule)
        self._layers: list[Any] | None = None

    @property
    def recording(self) -> RunSession | None:
        """The plugin-recording arm's session while that arm is active."""
        return None if self._active is None else self._active.recording

    def graphable_layers(self) -> list[Any]:
        """Every module of the model a TE graph can be handed to (Megatron's graphable layers, MTP
        layers included): the union of what any arm's helper captures."""
        if self._layers is None:
            from megatron.core.transformer.module import GraphableMegatronModule

            self._layers = [
                module
                for chunk in self.model
                for module in chunk.modules()
                if isinstance(module, GraphableMegatronModule) and hasattr(module, "cuda_graphs")
            ]
        return self._layers

    def helper_class(self, arm: str) -> Any:
        """The helper class of ``arm``; slot arms are bound at their first capture."""
        if arm not in self.helpers:
            assert is_slot_arm(arm), arm  # BenchOptions refused the others
            offloaded = OFFLOAD_ARM.fullmatch(arm)
            base, window, _percent = offloaded.groups() if offloaded else (arm, None, None)  # -f<P>: at capture
            copies = OffloadCopies(
                "between-replays" if base.endswith("staged") else "in-graph",
                self._session.config.offload_window if window is None else int(window),
            )
            self.helpers[arm] = bind_helper_class(
                self._te_helper, self._session, SlotBackend(offload=arm != "slot", copies=copies)
            )
        return self.helpers[arm]

    def step(self) -> None:
        foreign_state.put(self.args, "curr_iteration", self.iteration)  # as train() does (_LOOP_ARGS: held)
        state = self._active
        if state is None or state.recording is None or state.recorded_step is None:  # both set, or neither
            self.last = self.train_step(*self.step_args, iteration=self.iteration, **self.step_kwargs)
        else:  # what a run's train-step-timer and training-log-tap patches call, and nothing more
            self.last = state.recorded_step(*self.step_args, iteration=self.iteration, **self.step_kwargs)
            loss_dict, num_zeros_in_grad = logged_values(self.last)
            # train() logs the iteration counted after the step (training.py l.3986, iteration += 1 before it)
            state.recording.on_training_log(
                iteration=self.iteration + 1, loss_dict=loss_dict, num_zeros_in_grad=num_zeros_in_grad
            )
        self.iteration += 1

    def capture(self, arm: str) -> Any:
        # A layer that still held another arm's graphs would replay them under this capture.
        assert self._active is None and not any(layer.cuda_graphs for layer in self.graphable_layers()), (
            "capture from eager layers: release or deactivate the active arm first"
        )
        recording, recorded_step = None, None
        if arm == RECORDING_ARM:
            helper_class, recording, recorded_step = self._recording_block()
        else:
            helper_class = self.helper_class(arm)
        settings = _run_settings(self._session)
        helper = helper_class(
            model=self.model,
            config=self.config,
            seq_length=settings.seq_length,
            micro_batch_size=settings.micro_batch_size,
            optimizers=[self.optimizer],
        )
        # Megatron's own capture is not transactional: a failure leaves its capture flag set, GC frozen and
        # some layers holding graphs, onto which the arms captured before would be restored for teardown.
        layers = self.graphable_layers()
        with CaptureTransaction(
            [
                *megatron_capture_state(),
                *(attribute(layer, name) for layer in layers for name in _ARM_LISTS),  # eager again
            ]
        ):
            try:
                with self._offload_fraction(arm):
                    helper.create_cudagraphs()
                if not helper.graphs_created():
                    raise BenchError(
                        f"the {arm} arm captured no graphs (is --cuda-graph-impl transformer_engine set, "
                        "and did the capture fail? see the log above)."
                    )
            except BaseException:
                self._discard()
                raise
        self._active = _ArmState(arm, helper, recording, recorded_step)
        return helper

    def _discard(self) -> None:
        """A failed capture's graphs reset (Megatron's delete_cuda_graphs asserts a finished capture, so
        it cannot); the capture's transaction then gives the layers back their eager lists."""
        for layer in self.graphable_layers():
            for graph in layer.cuda_graphs:
                try:
                    graph.reset()
                except Exception as error:  # noqa: BLE001 - the capture's own error is the one raised
                    print(
                        f"megatron-cg bench: resetting a graph of the failed capture failed too: {error!r}",
                        file=sys.stderr,
                    )

    @contextlib.contextmanager
    def _offload_fraction(self, arm: str) -> Iterator[None]:
        """A ``-f<P>`` arm captures as ``--activation-offload-fraction P/100`` would: the layers'
        TransformerConfig holds it, where Megatron's flag lands and slot-shared capture reads it
        (``MegatronOffload.from_config``), while the arm captures; the run's value is back after."""
        found = OFFLOAD_ARM.fullmatch(arm)
        percent = None if found is None else found.group(3)
        if percent is None:
            yield
            return
        with foreign_state.Changes() as changes:
            for layer in self.graphable_layers():  # a config shared by layers is saved once (Changes.set)
                changes.set(
                    layer.config, "activation_offload_fraction", int(percent) / 100, change="bench-offload-fraction"
                )
            yield

    def deactivate(self) -> None:
        """The active arm's graphs and hooks set aside, the layers eager (as Megatron's teardown
        leaves them: empty lists); the next step runs as the eager arm."""
        state, self._active = self._active, None
        if state is None:
            return
        for layer in self.graphable_layers():
            for name in _ARM_LISTS:
                state.parked.set(layer, name, [], change="bench-arm-graphs")
        self._parked[state.arm] = state

    def activate(self, arm: str) -> None:
        """The next steps run as ``arm`` (captured before; ``eager``: no graphs): the active arm is
        set aside and ``arm``'s graphs, hooks and recording are put back in place."""
        if self._active is not None and self._active.arm == arm:
            return
        self.deactivate()
        if arm == "eager":
            return
        state = self._parked.pop(arm)
        assert not any(layer.cuda_graphs for layer in self.graphable_layers()), (
            "a parked arm is restored onto eager layers only"
        )
        state.parked.restore()
        self._active = state

    # A run with --cg-metrics-out and --cg-report-out records every value: the recording arm's session
    # is made with both (it is never finished, so nothing is written there).
    RECORDED_OUTPUTS: ClassVar[dict[str, Path]] = {
        "metrics_out": Path("plugin-recording.metrics.json"),
        "report_out": Path("plugin-recording.report.json"),
    }

    def _recording_block(self) -> tuple[type, RunSession, Callable[..., Any]]:
        """The plugin-recording arm: a session of its own with the run's config and both outputs
        asked for (a run has one session and one helper), the plugin's helper reporting to it, and
        Megatron's train_step wrapped by the train-step-timer patch's code for it; ``step`` then
        hands it the values the training_log tap would. Its session is never finished: no file is
        written. (In the launcher's bench every arm's step also passes the installed timer of the
        run's own session, whose mark is a no-op after the bench's first step: no training_log runs
        inside the bench to end that iteration. A script's bench holds the bare train_step.)"""
        outputs = self.RECORDED_OUTPUTS
        recording = RunSession(
            dataclasses.replace(
                self._session.config, metrics_out=outputs["metrics_out"], report_out=outputs["report_out"]
            )
        )
        recorded_step = patch_builders.build_train_step_timer(self.train_step, recording)
        return bind_helper_class(self._te_helper, recording), recording, recorded_step

    def release(self, helper: Any) -> None:
        """Tears the active arm's graphs down (``helper`` is its helper; None: the eager arm)."""
        assert self._active is None or self._active.helper is helper, "release the active arm's helper"
        if helper is not None and helper.graphs_created():
            helper.delete_cuda_graphs()
        self._active = None

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def peak_allocated(self, reset: bool = False) -> int:
        if reset:
            self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.max_memory_allocated()

    def pool_bytes(self) -> dict:
        return accounting.memory_state().pools


def logged_values(step_result: Any) -> tuple[Any, Any]:
    """The loss dict and num-zeros of a ``train_step`` result, which train() hands training_log."""
    try:  # 0.19.2: loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros, logit
        loss_dict, _skipped, _checkpoint, _exit, _code, _grad_norm, num_zeros_in_grad, _logit = step_result
    except (TypeError, ValueError):
        raise BenchError(
            f"Megatron's train_step returned {type(step_result).__name__} of another shape than "
            "0.19.2's eight values: install the supported megatron-core (docs/versions.md)."
        ) from None
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
        raise BenchError(
            "--bench-cached-batches needs one data iterator (no virtual pipeline stages): "
            "drop --bench-cached-batches for this run."
        )
    try:
        cached = [next(data_iterator) for _ in range(count)]
    except StopIteration:
        raise BenchError(
            f"--bench-cached-batches: the dataset ran out before {count} microbatches; ask for fewer."
        ) from None
    return RerunDataIterator(itertools.cycle(cached))


def device_time_per_step(
    step: Callable[[], None], steps: int, arm: str, *, table_dir: Path | None = None
) -> DeviceTime | None:
    """Device time of one step under torch's profiler, over ``steps`` steps: GPU-busy seconds (the
    union of its device activity; over the step's wall time it says how close the step is to the
    sum of its kernels, 1.0 being the physical limit), device-to-host and host-to-device copy
    seconds, and how much of the copying ran while a kernel ran. None if the profiler saw no
    device activity. With
    ``table_dir``, the arm's host operators by self CPU time go to ``<arm>.host_ops.txt`` there,
    to compare where two arms spend their host time, its Python functions (``steps`` more steps,
    ``python_calls_per_step``) to ``<arm>.python_calls.json``, and its device activity, stream by
    stream, to ``<arm>.device_timeline.json.gz`` (where a copy holds the compute stream up)."""
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
            + averages.table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n"
        )
        bench_output.write_host_ops(
            table_dir / f"{arm}.host_ops.json", steps, {op.key: (op.count, op.self_cpu_time_total) for op in averages}
        )
    timeline = [
        (
            event.time_range.start,
            event.time_range.end,
            "d2h" if "DtoH" in event.name else "h2d" if "HtoD" in event.name else "kernel",
            event.device_resource_id,
            event.name,
        )
        for event in trace.events()
        if event.device_type == DeviceType.CUDA
    ]
    if table_dir is not None:
        python_calls_per_step(
            step,
            steps,
            table_dir / f"{arm}.python_calls.json",
            synchronize=torch.cuda.synchronize,
            one_thread=functools.partial(torch.autograd.set_multithreading_enabled, False),
        )
    if not timeline:
        return None
    by_kind = intervals_by_kind(timeline)
    if table_dir is not None:
        bench_output.write_device_timeline(table_dir / f"{arm}.device_timeline.json.gz", steps, timeline)
    return DeviceTime.of(by_kind["kernel"], by_kind["d2h"], by_kind["h2d"], steps=steps, scale=1e-6)


def python_calls_per_step(
    step: Callable[[], None],
    steps: int,
    path: Path,
    *,
    synchronize: Callable[[], None],
    one_thread: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """``steps`` more steps under cProfile, each Python function's calls and own time per step to
    ``path`` (the host operators' format): torch's profiler sees operators, whose calls per step
    matched across arms but for event polls, not the Python that runs between them,
    where a plugin's extra work per step would show first as extra calls. cProfile sees the calling
    thread only, so the steps run inside ``one_thread`` (on the GPU: autograd's backward on this
    thread, not its device threads)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    synchronize()
    with one_thread():
        profiler.enable()
        try:
            for _ in range(steps):
                step()
            synchronize()
        finally:
            profiler.disable()
    functions: dict[str, tuple[int, float]] = {}
    for (file, line, name), (_, calls, own_seconds, _, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        label = f"{'/'.join(Path(file).parts[-2:])}:{line}({name})"
        count, micros = functions.get(label, (0, 0.0))
        functions[label] = (count + calls, micros + own_seconds * 1e6)
    bench_output.write_host_ops(path, steps, functions)


def contract_check_cost(helper: Any, *, microbatches: int, repeats: int = 2000) -> tuple[dict[str, float], int]:
    """Host microseconds of a layer replay's contract check per mode, averaged over a step's replays of
    the layer (the contract of the first graphed layer's first graph, checking fresh tensors of its
    captured inputs and the ``is_first_microbatch`` keyword Megatron adds at replay, ``microbatches``
    times inside one schedule run, about ``repeats`` checks in all), and layer replays per step (every
    graphed layer once per microbatch). Where the contract holds the run's step marks (under Megatron's
    DDP), the layer's first replay in a run reads its parameters and groups and the others check only
    their call; without them every replay reads them."""
    import torch

    graph = helper.flattened_callables[0].cuda_graphs[0]
    contract = graph.contract if isinstance(graph, CheckedGraph) else None
    if contract is None or (call := _fresh_call(contract, torch.empty_strided)) is None:
        raise BenchError(
            "the plugin arm's first graph holds no contract of one-leaf arguments to time: run the "
            "bench with --cg-contract-check full on a Megatron layer."
        )
    args, kwargs = call[0], {**call[1], FIRST_MICROBATCH: False}
    marks = None if contract.held is None else contract.held.step_marks
    runs = max(1, repeats // microbatches)
    costs = {}
    for mode in ContractCheck:
        start = time.perf_counter()
        for _ in range(runs):
            with contextlib.nullcontext() if marks is None else marks:  # one schedule run, as a step enters it
                for _ in range(microbatches):
                    contract.check(args, kwargs, mode)
        costs[mode.value] = (time.perf_counter() - start) / (runs * microbatches) * 1e6
    return costs, len(helper.flattened_callables) * microbatches


def _fresh_call(contract: ReplayContract, empty_strided: Callable[..., Any]) -> tuple[tuple, dict] | None:
    """A call as a step makes it of the arguments ``contract`` was recorded with: a new tensor for each captured
    tensor (``empty_strided``, needing a gradient where the sample did), each other value as captured, placed by
    the contract's own ``flat_call``. None where an argument is not one leaf (``flat_call`` None)."""

    def fresh(expected: Any) -> Any:
        if not isinstance(expected, StaticInput):
            return expected
        spec = expected.spec
        return empty_strided(
            spec.shape, spec.stride, dtype=spec.dtype, device=spec.device, requires_grad=spec.requires_grad
        )

    if contract.flat_call is None:
        return None
    positional, keys = contract.flat_call
    leaves = [fresh(expected) for _, expected in contract.inputs]
    return tuple(leaves[:positional]), dict(zip(keys, leaves[positional:]))


def recording_cost(
    session: RunSession, step_result: Any, training_log: Callable[..., Any], *, repeats: int = 2000
) -> float:
    """Host microseconds a recording run adds to each step: the train-step-timer and
    training-log-tap patches' own wrappers (around calls that do nothing: what they wrap runs in
    every arm), binding ``step_result``'s values as Megatron's ``training_log`` gets them, on a
    session of its own with ``session``'s config and helpers (the arm's records stay as they
    are). ``repeats`` beyond the session's ``read_every`` include its reads of the kept values."""
    loss_dict, num_zeros_in_grad = logged_values(step_result)
    timed = RunSession(session.config, read_every=session.read_every)
    timed.helpers = list(session.helpers)
    signature = inspect.signature(training_log)

    def untimed(*args: Any, **kwargs: Any) -> None:
        return None

    untimed.__signature__ = signature  # type: ignore[attr-defined]  # the tap binds Megatron's arguments
    timer = patch_builders.build_train_step_timer(untimed, timed)
    tap = patch_builders.build_training_log_tap(untimed, timed)
    named = [
        name
        for name, parameter in signature.parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]
    arguments = {**dict.fromkeys(named), "loss_dict": loss_dict, "num_zeros_in_grad": num_zeros_in_grad}
    start = time.perf_counter()
    for iteration in range(1, repeats + 1):
        arguments["iteration"] = iteration  # no dict built per call inside the timed loop
        timer()
        tap(**arguments)
    return (time.perf_counter() - start) / repeats * 1e6


def first_train_step(
    train_step: Callable[..., Any],
    sink: list[Any],
    run: Callable[[tuple, dict], tuple[Any, Any]],
    before: Callable[[], None] | None = None,
) -> Callable[..., Any]:
    """Stands in for Megatron's ``train_step``: its first call runs ``before`` (if any), then ``run`` on
    the step's arguments (it returns its result, kept in ``sink``, and the trainer it stepped), and returns
    the trainer's last step result; ``train()``'s loop then ends."""

    @functools.wraps(train_step)  # install()'s signature check, run after this patch for a script, looks through it
    def step(*args: Any, **kwargs: Any) -> Any:
        if sink:
            raise BenchError(
                "Megatron's loop went on after the bench; this megatron-core reads --train-iters "
                "differently: install the supported version (docs/versions.md)."
            )
        if before is not None:
            before()
        result, trainer = run(args, kwargs)
        sink.append(result)
        last = (kwargs.get("iteration") or 0) + 1  # the loop's last: run_in_first_train_step puts them back after it
        foreign_state.put(trainer.args, "train_iters", last)
        foreign_state.put(trainer.args, "iteration", last)
        return trainer.last

    return step


def bench_train_step(
    options: BenchOptions,
    flags: Sequence[str],
    train_step: Callable[..., Any],
    sink: list[BenchResult],
    before: Callable[[], None] | None = None,
) -> Callable[..., Any]:
    """``first_train_step`` running the bench through the real ``train_step``."""

    def run(args: tuple, kwargs: dict) -> tuple[BenchResult, MegatronTrainer]:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        trainer = MegatronTrainer(
            train_step, args, kwargs, cached_microbatches=options.cached_batches * get_num_microbatches()
        )
        cost = functools.partial(contract_check_cost, microbatches=get_num_microbatches())
        profile = functools.partial(device_time_per_step, table_dir=options.profile_dir)

        def recording_arm_cost() -> float:
            session = trainer.recording
            if session is None:  # run_bench times it only while the plugin-recording arm is in place
                raise TypeError("the recording cost is timed while the plugin-recording arm is in place")
            return recording_cost(session, trainer.last, trainer.training.training_log)

        # timed while that arm is in place (its session, the last step's values)
        recorded = recording_arm_cost if RECORDING_ARM in options.arms else None
        result = run_bench(
            options,
            trainer,
            flags=flags,
            profile=profile,
            contract_cost=cost if "plugin" in options.arms else None,
            recording_cost=recorded,
        )
        return result, trainer

    return first_train_step(train_step, sink, run, before)


def refuse_unbenchable(settings: RunSettings, config: PluginConfig, options: BenchOptions) -> None:
    """Flags the bench cannot measure faithfully, refused (``BenchError``) before any GPU work: ``settings``
    are the run's (``RunSession.settings``, read once Megatron validated the flags), ``config`` the
    plugin's config in force (the plugin arm's)."""
    if options.interleave == "steps":
        _refuse_unswitchable(settings, config, options)
    graphed = [arm for arm in options.arms if arm != "eager"]
    if graphed and not settings.te_graphs:
        raise BenchError(
            f"the {'/'.join(graphed)} arm(s) capture TE graphs: pass --cuda-graph-impl transformer_engine "
            "(or --bench-arms eager)."
        )
    if "stock" in options.arms and settings.packed:
        raise BenchError(
            "the stock arm replays Megatron's own graphs, which refuse packed batches (rule "
            "packed-sequences-te-graphs): bench packed data with --bench-arms eager,plugin."
        )
    if settings.te_graphs and settings.warmup_steps < 1:
        raise BenchError(
            "--cuda-graph-warmup-steps 0 would make Megatron capture its own graphs before the bench's "
            "first step; leave it at its default (3) or set it >= 1."
        )
    if settings.distributed_optimizer and settings.overlap_param_gather:
        raise BenchError(
            "the bench runs inside Megatron's first train_step, while the forward pre-hooks that "
            "--overlap-param-gather needs are still off: drop --overlap-param-gather for the bench."
        )
    if UNCHECKED_ARM in options.arms and config.contract_check is not ContractCheck.FULL:
        raise BenchError(
            f"the {UNCHECKED_ARM} arm measures what --cg-contract-check full costs against the plugin arm: "
            f"leave --cg-contract-check at full (it is {config.contract_check})."
        )
    if options.cached_batches and (settings.pipeline_parallel > 1 or settings.virtual_pipeline):
        raise BenchError(
            "--bench-cached-batches caches the batches of a PP = 1 run (each stage of a pipeline reads "
            "its own part): drop --bench-cached-batches, or run the bench with "
            "--pipeline-model-parallel-size 1."
        )
    if settings.save:
        raise BenchError("--save would checkpoint the weights the bench's blocks trained: drop --save for the bench.")
    if any(is_slot_arm(arm) for arm in options.arms):  # the rules --cg-slot-capture itself would get
        slot_settings = dataclasses.replace(settings, slot_capture=True)
        broken = [message for name, message in rules.violations(slot_settings) if name.startswith("slot-capture")]
        offloading = [arm for arm in options.arms if arm.startswith("slot-offload")]
        if offloading and not (settings.activation_offloading and settings.offload_modules):
            broken.append(
                f"the {'/'.join(offloading)} arm(s) offload what Megatron's flags select, and these offload "
                "nothing: add --fine-grained-activation-offloading --offload-modules ..."
            )
        if broken:
            raise BenchError(
                f"the {'/'.join(a for a in options.arms if is_slot_arm(a))} arm(s) capture with "
                f"--cg-slot-capture, which these flags break: {' '.join(broken)}"
            )


def _refuse_unswitchable(settings: RunSettings, config: PluginConfig, options: BenchOptions) -> None:
    """The step schedule keeps every arm's captures alive at once and switches the layers' graph
    lists between steps (``_ArmState``); state kept elsewhere per capture is not switched, so these
    are refused (fail closed) rather than measured wrong."""
    plugin_arms = [arm for arm in options.arms if arm.startswith("plugin")]
    broken = []
    if plugin_arms and (config.slot_capture or config.graph_banks):
        broken.append(
            f"{'--cg-slot-capture' if config.slot_capture else '--cg-graph-banks'}: the "
            f"{'/'.join(plugin_arms)} arm(s) would capture slot-shared graphs, whose arenas, saved-tensor "
            "hooks and banked layers live outside the layers' graph lists"
        )
    if settings.activation_offloading:
        broken.append(
            "--fine-grained-activation-offloading: Megatron's offload manager keeps one capture's state "
            "(reset after each capture, cuda_graphs.py _finish_capturing)"
        )
    if settings.fp8 or settings.fp4:
        broken.append(
            "--fp8-format/--fp4-format: TE's graphs keep FP8 weight caches and scaling state per capture, not "
            "verified with several captures alive"
        )
    if broken:
        raise BenchError(
            "--bench-interleave steps keeps every arm's graphs alive and switches them between steps, "
            f"which these cannot take: {'; '.join(broken)}. Run this bench with --bench-interleave blocks."
        )


def user_script(flags: Sequence[str]) -> Path | None:
    """The training script when the bench's first flag names one (``megatron-cg bench [--bench-*]
    SCRIPT.py <its flags>``), else None (the launcher's flags)."""
    if flags and flags[0].endswith(".py"):
        problem = input_path_problem("the training script", flags[0], folder=False)
        if problem is not None:
            raise BenchError(
                f"{problem.rstrip('.')} (a training script such as Megatron-LM's pretrain_gpt.py), or "
                "give the launcher's flags alone."
            )
        return Path(flags[0])
    return None


def main(argv: Sequence[str]) -> int:
    from megatron.training import training

    options, flags = parse_bench_argv(argv)
    script = user_script(flags)
    if script is not None:
        flags = flags[1:]
    # Enough iterations for every block, and no validation pass after them (the bench's values win).
    flags = [*flags, "--train-iters", str(options.total_steps), "--eval-iters", "0"]
    results: list[BenchResult] = []

    code = run_in_first_train_step(
        script,
        flags,
        training,
        lambda settings, config: refuse_unbenchable(settings, config, options),  # the config the flags resolved
        lambda before: bench_train_step(options, flags, training.train_step, results, before=before),
        # asked for once the flags and the host passed, before any GPU work
        host_ready=bench_output.plot_available if options.plot else lambda: None,
    )
    if code and not results:
        raise BenchError(f"{script} exited with code {code} before the bench ran; its output is above.")
    if not results:
        raise BenchError(
            "Megatron's pretrain() returned without training (are --train-iters and --do-train set? see the log above)."
        )
    for path in bench_output.write(results[0], options.out, with_plot=options.plot):
        print(f"megatron-cg bench: wrote {path}")
    print(bench_output.markdown(results[0]))
    return 0


def run_in_first_train_step(
    script: Path | None,
    flags: Sequence[str],
    training: Any,
    check: Callable[[RunSettings, PluginConfig], None],
    make_driver: Callable[[Callable[[], None] | None], Callable[..., Any]],
    *,
    command: str = "bench",
    host_ready: Callable[[], None] = lambda: None,
) -> int:
    """Builds the model of ``flags`` with the plugin installed and hands Megatron's first ``train_step`` to
    ``make_driver``'s stand-in (``first_train_step``): the launcher's model and data (``script`` None), its
    flags parsed and ``check``ed (the run's settings, the plugin config they resolved), then the host's needs,
    then ``host_ready`` (an optional extra the command asks for), all before any GPU work; or a user's own
    script, run as ``megatron-cg run`` runs it, which parses its flags and builds its model and data, so
    ``check`` comes at its first train_step (the stand-in is made with it to run first). Megatron's
    ``train_step``, and the args its loop reads of the stand-in (``_LOOP_ARGS``, held from its first call on),
    are back as they were when the run returns, whatever happens. Returns the script's exit code (0 for the
    launcher)."""
    if script is None:
        with single_process_rendezvous():
            session = installation.install(launcher=True)
            try:
                with console.megatron_printout_held():  # Megatron's printout, until the command's checks pass
                    args = pretrain_gpt.parse_megatron_args(flags)
                    check(_run_settings(session, command), session.config)
                    pretrain_gpt.refuse_host_needs(session)
                host_ready()
                with foreign_state.Changes() as changes:
                    driver = make_driver(functools.partial(_hold_loop_args, changes, args))
                    changes.set(training, "train_step", driver, change="bench-train-step")
                    pretrain_gpt.run(args, session)
            finally:
                installation.uninstall()
        return 0
    from megatron.training import get_args

    with foreign_state.Changes() as changes:

        def before() -> None:
            session = installation.active_session()
            if session is None:
                raise BenchError(f"{script} ran without the plugin installed; run it through megatron-cg {command}.")
            check(_run_settings(session, command), session.config)
            _hold_loop_args(changes, get_args())
            host_ready()

        changes.set(training, "train_step", make_driver(before), change="bench-train-step")
        return run_script.run_in_process(script, run_script.expand_preset(flags))


# Megatron's args that train()'s loop reads of the stand-in's first step: curr_iteration, set before each
# step as the loop sets it (MegatronTrainer.step), and iteration and train_iters, set so that the loop ends
# after it (first_train_step).
_LOOP_ARGS = ("curr_iteration", "iteration", "train_iters")


def _hold_loop_args(changes: foreign_state.Changes, args: Any) -> None:
    for name in _LOOP_ARGS:
        changes.hold(args, name, change="bench-train-step")


def _run_settings(session: RunSession, command: str = "bench") -> RunSettings:
    """The run's settings, which the plugin's rules read once Megatron validated the flags (or as training
    starts where its validation did not take them: ``RunSession.ensure_checked``)."""
    session.ensure_checked()
    if session.settings is None:
        raise BenchError(
            f"the run's flags were not validated with the plugin installed (Megatron's validate_args did not "
            f"run under it); run it through megatron-cg {command}."
        )
    return session.settings


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
