"""``megatron-cg tune``'s timing, inside the one process that built the model, through the bench's
trainer (``bench.command``: a step, a capture per arm, the switch between captured arms): eager's
peak first (the default memory budget), then the setups the budget keeps, each an arm named by its
label.

Setups the step schedule can hold together (``candidates.placement``, ``ranking.fit_together``) are
captured once, alive beside each other, and timed in mirrored cycles of single steps until the best
is separated from the next (``ranking.stop_reason``) or their share of ``--tune-seconds`` is spent;
the others are timed as the bench times slot arms: in mirrored rounds of blocks, each block a
capture, its steps and its release, pair of rounds by pair of rounds under the same rule. The blocks
run first and every arm is profiled for its GPU-busy fraction only once all are timed (``time_setups``
says why). A capture that fails marks its setup failed and the others go on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from megatron_cg_plugin.bench.command import (
    BenchTrainer,
    StepCycles,
    capture_arm,
    captured_arms,
    run_step_cycles,
    slot_bytes,
    timed_step,
)
from megatron_cg_plugin.bench.output import BenchResult, BlockRecord, StepRecord
from megatron_cg_plugin.bench.schedule import BenchSummary, DeviceTime, interleaved_blocks, summarize_steps
from megatron_cg_plugin.setups.graph_setups import EAGER
from megatron_cg_plugin.tune.ranking import (
    Measured,
    Row,
    apply_budget,
    default_budget,
    fit_together,
    ratio_interval,
    stop_reason,
)

__all__ = ["TimingOptions", "TimingResult", "length_flags", "steps_needed", "time_setups"]

STEPS_METHOD = (
    "megatron-cg tune: one model and optimizer, every arm a setup's capture of the same layers with its own scope, "
    "all alive together; single steps alternate the arms in mirrored cycles, the layers switched to an arm's graphs "
    "and scope between steps"
)
BLOCKS_METHOD = (
    "megatron-cg tune: one model and optimizer; each block captures one setup, trains its steps and releases it, "
    "in mirrored rounds"
)


@dataclasses.dataclass(frozen=True)
class TimingOptions:
    seconds: float  # --tune-seconds: for the cycles and blocks together (capture and profiling on top)
    max_cycles: int = 200  # the step schedule's cap, whatever the time left
    skip_cycles: int = 2  # the first cycles after the captures warm up
    max_pairs: int = 12  # the block schedule's cap, in pairs of mirrored rounds
    block_steps: int = 10
    skip_steps: int = 2  # per block: the first steps after its capture
    warmup_steps: int = 3  # eager steps before anything is measured
    peak_steps: int = 2  # eager steps whose peak sets the default budget
    profile_steps: int = 3  # per arm, after the schedules: the GPU-busy fraction


def steps_needed(options: TimingOptions, rows: int) -> int:
    """Training steps the timing can take at most with ``rows`` setups (eager among them, and timed in both
    schedules): what ``--train-iters`` must allow."""
    arms = rows + 1
    block = 2 * options.max_pairs * arms * options.block_steps
    cycles = 2 * options.max_cycles * arms
    return options.warmup_steps + options.peak_steps + block + cycles + arms * options.profile_steps


def length_flags(options: TimingOptions, rows: int) -> list[str]:
    """The flags that size the timing process's run, after the user's (the last of a flag wins): the steps
    ``rows`` setups can take (``steps_needed``), no evaluation. With ``rows=1``, the shortest timing run, they
    let the setups' checks build Megatron's schedule for flags that give no length of their own."""
    return ["--train-iters", str(steps_needed(options, rows)), "--eval-iters", "0"]


@dataclasses.dataclass(frozen=True)
class TimingResult:
    rows: list[Row]
    eager_peak_bytes: int
    budget_bytes: int | None
    budget_source: str
    stopped: dict[str, str]  # per schedule timed: separated, out of time, or the cap
    results: dict[str, BenchResult]  # per schedule timed: the bench's result of its arms


Profile = Callable[[Callable[[], None], int, str], DeviceTime | None]


def time_setups(
    rows: Sequence[Row],
    trainer: BenchTrainer,
    *,
    options: TimingOptions,
    budget_bytes: int | None,
    device_bytes: int | None,
    flags: Sequence[str] = (),
    clock: Callable[[], float],
    progress: Callable[[str], None] = print,
    profile: Profile | None = None,
) -> TimingResult:
    """Times the rows left after the budget: ``budget_bytes`` (``--tune-memory-gib``) or, without it,
    ``device_bytes`` less eager's measured peak and the margin (``ranking.default_budget``)."""
    for _ in range(options.warmup_steps):
        timed_step(trainer, clock)
    trainer.peak_allocated(reset=True)
    eager_steps = [timed_step(trainer, clock) for _ in range(options.peak_steps)]
    eager_peak = trainer.peak_allocated()
    source = "--tune-memory-gib"
    if budget_bytes is None and device_bytes is not None:
        budget_bytes = default_budget(device_bytes, eager_peak)
        source = f"the device's {device_bytes / 2**30:.1f} GiB less eager's {eager_peak / 2**30:.2f} GiB peak and 5%"
    progress(
        f"eager: peak {eager_peak / 2**20:.0f} MiB over {len(eager_steps)} steps; graph budget "
        + ("none" if budget_bytes is None else f"{budget_bytes / 2**20:.0f} MiB ({source})")
    )
    placed = fit_together(apply_budget(rows, budget_bytes, source=source), budget_bytes)
    arms = {
        schedule: [row.label for row in placed if row.timable and row.setup.graphed and row.schedule == schedule]
        for schedule in ("steps", "blocks")
    }
    total = sum(len(found) for found in arms.values()) or 1
    stopped: dict[str, str] = {}
    results: dict[str, BenchResult] = {}
    measured: dict[str, Measured] = {}
    failed: dict[str, str] = {}

    def record_failure(arm: str, error: Exception) -> None:
        failed[arm] = f"{type(error).__name__}: {error}"
        progress(f"capture of {arm} failed ({failed[arm]}); the other setups go on")

    # Every step is timed before the first is profiled: torch's profiler leaves CUPTI attached once it
    # is done (pytorch/pytorch#144455), and steps timed after it run slower, eager ones (thousands of
    # kernel launches) far more than graphed ones, which favoured whatever was timed after it. So the blocks are
    # timed first, then the step schedule, which profiles its arms while they are alive, then the block
    # arms are captured again to be profiled.
    if arms["blocks"]:
        seconds = options.seconds * len(arms["blocks"]) / total
        results["blocks"], stopped["blocks"] = _time_blocks(
            arms["blocks"], trainer, options, seconds, flags, clock, progress, record_failure, placed
        )
    if arms["steps"]:
        seconds = options.seconds * len(arms["steps"]) / total
        results["steps"], stopped["steps"] = _time_steps(
            arms["steps"], trainer, options, seconds, flags, clock, progress, profile, record_failure, placed
        )
        measured.update(_measures(results["steps"], "cycles"))
    if arms["blocks"]:
        results["blocks"] = _profile_blocks(results["blocks"], trainer, options, clock, progress, profile)
        for arm, found in _measures(results["blocks"], "pairs").items():
            if arm != EAGER or EAGER not in measured:  # eager's figures from the step schedule, where it ran
                measured[arm] = found
    if EAGER in measured:
        measured[EAGER] = dataclasses.replace(measured[EAGER], peak_bytes=eager_peak)
    done = [
        dataclasses.replace(row, failed=failed.get(row.label, row.failed), measured=measured.get(row.label))
        if row.timable or not row.setup.graphed
        else row
        for row in placed
    ]
    return TimingResult(done, eager_peak, budget_bytes, source, stopped, results)


def _group_rows(rows: Sequence[Row], arms: Sequence[str], summary: BenchSummary, unit: str) -> list[Row]:
    """``arms``' rows (eager's among them) with the ratios ``summary`` gives them so far, for the stopping rule."""
    found = []
    for row in rows:
        if row.label not in arms:
            continue
        spread = summary.ratios.get((row.label, EAGER))
        ratio = None if spread is None else ratio_interval(spread.values, unit=unit)
        found.append(dataclasses.replace(row, measured=Measured("", 0.0, ratio)))
    return found


def _time_steps(
    arms: list[str],
    trainer: BenchTrainer,
    options: TimingOptions,
    seconds: float,
    flags: Sequence[str],
    clock: Callable[[], float],
    progress: Callable[[str], None],
    profile: Profile | None,
    failed: Callable[[str, Exception], None],
    rows: Sequence[Row],
) -> tuple[BenchResult, str]:
    reasons: list[str] = []
    with captured_arms([EAGER, *arms], trainer, clock, progress, failed=failed) as captured:
        alive = tuple(captured)

        def stop(steps: Sequence[StepRecord]) -> str | None:
            summary = summarize_steps([(s.step, s.seconds) for s in steps], skip_cycles=options.skip_cycles)
            reason = stop_reason(_group_rows(rows, alive, summary, "cycles"), elapsed=0.0, seconds=math.inf)
            reasons.extend([reason] if reason else [])
            return reason

        plan = StepCycles(alive, options.max_cycles, options.skip_cycles, seconds, seconds_flag="--tune-seconds")
        steps, peaks = run_step_cycles(plan, trainer, clock, progress, stop=stop)
        records = tuple(
            BlockRecord(0, arm, (), peaks[arm], capture_seconds, pool)
            for arm, (_, capture_seconds, pool) in captured.items()
        )
        result = BenchResult(
            STEPS_METHOD,
            1,
            options.skip_cycles,
            records,
            {},
            {},
            None,
            tuple(flags),
            schedule="steps",
            steps=tuple(steps),
        )
        busy = {}
        for arm in alive:
            trainer.activate(arm)
            busy[arm] = _busy(profile, trainer, options, arm, result)
    cycles = len(steps) // (2 * len(alive))
    stopped = (
        reasons[-1] if reasons else ("out of time" if cycles < options.max_cycles else f"the cap of {cycles} cycles")
    )
    return dataclasses.replace(result, busy_fraction=busy), stopped


def _time_blocks(
    arms: list[str],
    trainer: BenchTrainer,
    options: TimingOptions,
    seconds: float,
    flags: Sequence[str],
    clock: Callable[[], float],
    progress: Callable[[str], None],
    failed: Callable[[str, Exception], None],
    rows: Sequence[Row],
) -> tuple[BenchResult, str]:
    """Pairs of mirrored rounds of blocks (as ``bench.schedule.interleaved_blocks``), until separated, out
    of time or at the cap."""
    alive = [EAGER, *arms]
    records: list[BlockRecord] = []
    start, stopped = clock(), ""
    result = BenchResult(BLOCKS_METHOD, options.block_steps, options.skip_steps, (), {}, {}, None, tuple(flags))
    for pair in range(options.max_pairs):
        for block in interleaved_blocks(alive, 2):
            if block.arm not in alive:  # its capture failed earlier in this pair
                continue
            try:
                helper, capture_seconds, pool = capture_arm(trainer, block.arm, clock)
            except Exception as error:  # noqa: BLE001 - the trainer rolled it back; the other setups go on
                failed(block.arm, error)
                alive.remove(block.arm)
                continue
            trainer.peak_allocated(reset=True)
            try:
                steps = [timed_step(trainer, clock) for _ in range(options.block_steps)]
            finally:
                trainer.release(helper)
            round_ = block.round + 2 * pair
            records.append(
                BlockRecord(
                    round_,
                    block.arm,
                    tuple(steps),
                    trainer.peak_allocated(),
                    capture_seconds,
                    pool,
                    *slot_bytes(helper),
                )
            )
            progress(f"block round {round_} {block.arm}: median {sorted(steps)[len(steps) // 2] * 1e3:.2f} ms")
        result = dataclasses.replace(result, blocks=tuple(records))
        if len(alive) < 2:
            stopped = "every graphed capture failed"
            break
        reason = stop_reason(
            _group_rows(rows, alive, result.summary(), "pairs"), elapsed=clock() - start, seconds=seconds
        )
        if reason is not None and pair >= 1:  # one pair gives no interval: two pairs at least
            stopped = reason
            break
    else:
        stopped = f"the cap of {options.max_pairs} pairs of rounds"
    return result, stopped


def _profile_blocks(
    result: BenchResult,
    trainer: BenchTrainer,
    options: TimingOptions,
    clock: Callable[[], float],
    progress: Callable[[str], None],
    profile: Profile | None,
) -> BenchResult:
    """``result`` with each of its arms' GPU-busy fraction: every arm that was timed captured again, profiled
    and released."""
    busy: dict[str, float | None] = {}
    for arm in dict.fromkeys(record.arm for record in result.blocks) if profile is not None else ():
        try:
            helper, _, _ = capture_arm(trainer, arm, clock)
        except Exception as error:  # noqa: BLE001 - timed already; only its GPU-busy fraction is missing
            progress(f"capture of {arm} to profile it failed ({type(error).__name__}: {error}); no GPU-busy fraction")
            continue
        try:
            busy[arm] = _busy(profile, trainer, options, arm, result)
        finally:
            trainer.release(helper)
    return dataclasses.replace(result, busy_fraction=busy)


def _busy(profile: Profile | None, trainer: Any, options: TimingOptions, arm: str, result: BenchResult) -> float | None:
    """The arm's GPU-busy fraction: its profiled device time per step over its unprofiled median step."""
    if profile is None:
        return None
    device = profile(trainer.step, options.profile_steps, arm)
    median = result.summary().arms.get(arm)
    return None if device is None or median is None else device.busy_seconds / median.median


def _measures(result: BenchResult, unit: str) -> dict[str, Measured]:
    """Per arm of ``result``, what it measured (the arms whose capture failed have none)."""
    summary = result.summary()
    capture, peaks = result.per_arm("capture_seconds"), result.per_arm("peak_with_pools_bytes")
    # What the prediction covers (setups.graph_setups.graph_bytes): the pools and, under slot-shared
    # capture, the arenas and boundary buffers outside them
    pools, *outside = (result.per_arm(name) for name in ("pool_bytes", "arena_bytes", "boundary_bytes"))
    found = {}
    for arm, spread in summary.arms.items():
        ratio = summary.ratios.get((arm, EAGER))
        graph = (
            None
            if arm not in pools
            else int(pools[arm].median + sum(part[arm].median for part in outside if arm in part))
        )
        found[arm] = Measured(
            schedule=result.schedule,
            step_seconds=spread.median,
            ratio=None if ratio is None else ratio_interval(ratio.values, unit=unit),
            graph_bytes=graph,
            peak_bytes=int(peaks[arm].median) if arm in peaks else None,
            busy_fraction=result.busy_fraction.get(arm),
            capture_seconds=capture[arm].median if arm in capture else None,
        )
    return found
