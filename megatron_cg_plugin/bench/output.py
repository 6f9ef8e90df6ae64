"""What ``megatron-cg bench`` writes: the result as JSON, a markdown table and a PNG plot of step
time per block and arm (pure Python; the plot needs the optional ``bench`` extra, matplotlib)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_cg_plugin.bench.schedule import (
    BenchSummary,
    Block,
    CopyStalls,
    MedianInterval,
    Spread,
    Step,
    median_interval,
    median_precision,
    summarize,
    summarize_steps,
)

__all__ = [
    "ALL_ARMS",
    "ARMS",
    "BenchOutputError",
    "BenchResult",
    "BlockRecord",
    "CaptureRecord",
    "OFFLOAD_ARM",
    "RATIO_WIDTH",
    "RECORDING_ARM",
    "SCHEDULES",
    "StepRecord",
    "UNCHECKED_ARM",
    "from_json",
    "host_ops_diff",
    "is_known_arm",
    "is_slot_arm",
    "main",
    "markdown",
    "median_interval",
    "plot_available",
    "read_device_timeline",
    "to_json",
    "write",
    "write_device_timeline",
    "write_host_ops",
]

ARMS = ("eager", "stock", "plugin")  # no graphs; Megatron's own TECudaGraphHelper; the plugin's
# Arms run only when asked for (--bench-arms): the plugin's helper with slot-shared capture
# (--cg-slot-capture), without and with offload of the modules Megatron's offload flags name, the
# copies inside the graphs (slot-offload) or between replays (slot-offload-staged): --cg-offload-copies.
# slot-offload-w<N>, slot-offload-staged-w<N>: the same with --cg-offload-window N (without: the run's
# window), so windows can be compared in one process; -f<P> after either: the first P% of the
# groups Megatron's flags name offloaded (--activation-offload-fraction P/100; without: the run's).
_SLOT_ARMS = ("slot", "slot-offload", "slot-offload-staged")
OFFLOAD_ARM = re.compile(r"(slot-offload(?:-staged)?)(?:-w([0-9]+))?(?:-f([0-9]+))?")
# The plugin's helper with --cg-contract-check off: beside plugin, what the replay checks cost.
UNCHECKED_ARM = "plugin-no-check"
# The plugin's helper with the session's per-step recording as a run does it (train_step timer,
# training_log values): beside plugin, what recording the metrics and report costs.
RECORDING_ARM = "plugin-recording"
ALL_ARMS = (*ARMS, UNCHECKED_ARM, RECORDING_ARM, *_SLOT_ARMS)
# The width each ratio's median is to be known to: +-1% tells 1.02 from 1.00.
RATIO_WIDTH = 0.02
# The step schedule's ratio table: the pairs (cycles) its interval would need for these half-widths.
_HALF_WIDTHS = (0.01, 0.02)
SCHEDULES = ("blocks", "steps")  # --bench-interleave


def is_slot_arm(arm: str) -> bool:
    found = OFFLOAD_ARM.fullmatch(arm)
    return arm in _SLOT_ARMS or (found is not None and (found.group(3) is None or int(found.group(3)) <= 100))


def is_known_arm(arm: str) -> bool:
    return arm in ALL_ARMS or is_slot_arm(arm)


class BenchOutputError(RuntimeError):
    """An output the bench was asked for cannot be written; the message says what to install or change."""


@dataclasses.dataclass(frozen=True)
class BlockRecord:
    """One block: its step times, and for a graphed arm what its capture took."""

    round: int
    arm: str
    step_seconds: tuple[float, ...]
    peak_allocated_bytes: int
    capture_seconds: float | None = None
    pool_bytes: int | None = None  # graph private pools the block's capture created
    arena_bytes: int | None = None  # slot arms: the layers' GPU saved-tensor arenas (outside the pools)
    host_arena_bytes: int | None = None  # slot arms: their pinned host arenas
    boundary_bytes: int | None = None  # slot arms: graph outputs, gradients, copied inputs (outside the pools)

    @property
    def block(self) -> Block:
        return Block(self.round, self.arm)

    @property
    def peak_with_pools_bytes(self) -> int:
        """Peak allocated plus the graph pools: a captured graph's pool blocks are free to the
        allocator (not in ``allocated``) yet reserved for the graph, while slot arenas and
        boundaries are allocated tensors, so only this sum compares TE's and slot-shared graphs."""
        return self.peak_allocated_bytes + (self.pool_bytes or 0)


@dataclasses.dataclass(frozen=True)
class CaptureRecord:
    """One capture of the step schedule's capture rounds (``--bench-capture-rounds``), released at once."""

    round: int
    arm: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One timed step of the step schedule (``--bench-interleave steps``)."""

    cycle: int
    arm: str
    seconds: float

    @property
    def step(self) -> Step:
        return Step(self.cycle, self.arm)


@dataclasses.dataclass(frozen=True)
class BenchResult:
    method: str  # how the arms share the process (one model, a fresh helper per graphed block)
    steps_per_block: int
    skip_steps: int  # blocks: steps dropped per block; steps: cycles dropped
    # blocks: one record per block. steps: one per arm, its capture and peak, with no step_seconds (see steps)
    blocks: tuple[BlockRecord, ...]
    busy_fraction: dict[str, float | None]  # per arm: kernel time / wall time of profiled steps
    contract_check_us: dict[str, float]  # per --cg-contract-check mode: host cost of one layer replay's check
    replays_per_step: int | None  # graphed layer replays per training step (plugin arm)
    flags: tuple[str, ...]
    copies: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # per arm: DeviceTime fields
    schedule: str = "blocks"  # --bench-interleave: blocks, or single steps in mirrored cycles
    steps: tuple[StepRecord, ...] = ()  # the step schedule's timed steps, in schedule order
    recording_us: float | None = None  # host cost per step of the plugin-recording arm's hooks
    capture_rounds: tuple[CaptureRecord, ...] = ()  # the step schedule's timed captures, in schedule order

    def summary(self) -> BenchSummary:
        if self.schedule == "steps":
            return summarize_steps(
                [(record.step, record.seconds) for record in self.steps], skip_cycles=self.skip_steps
            )
        return summarize({record.block: record.step_seconds for record in self.blocks}, skip_steps=self.skip_steps)

    def ratio_intervals(self) -> dict[tuple[str, str], MedianInterval]:
        """Per ratio, its median's 95% interval over the pairs of rounds or the cycles (where there
        are enough of them: ``bench.schedule.fewest_for_interval``)."""
        return {
            pair: found
            for pair, spread in self.summary().ratios.items()
            if (found := median_interval(spread.values)) is not None
        }

    def capture_summary(self) -> BenchSummary:
        """The capture rounds summarized as blocks of one capture each: per arm its capture seconds,
        per pair of arms the geometric mean of its two per-round ratios in each pair of mirrored
        rounds (a drift linear over the pair cancels)."""
        return summarize({Block(record.round, record.arm): (record.seconds,) for record in self.capture_rounds})

    def per_arm(self, field: str) -> dict[str, Spread]:
        """Per graphed arm, the spread of a block field (``capture_seconds``, ``pool_bytes``, ...)."""
        values: dict[str, list[float]] = {}
        for record in self.blocks:
            value = getattr(record, field)
            if value is not None:
                values.setdefault(record.arm, []).append(float(value))
        return {arm: Spread.of(found) for arm, found in values.items()}


def to_json(result: BenchResult) -> dict[str, Any]:
    summary = result.summary()

    def spread(value: Spread) -> dict[str, Any]:
        return {"median": value.median, "low": value.low, "high": value.high, "n": len(value.values)}

    return {
        "method": result.method,
        "flags": list(result.flags),
        "steps_per_block": result.steps_per_block,
        "skip_steps": result.skip_steps,
        "step_seconds": {arm: spread(value) for arm, value in summary.arms.items()},
        "ratios": {f"{a}/{b}": spread(value) for (a, b), value in summary.ratios.items()},
        # the block schedule's rounds for +-1% (the step schedule gives ratio_intervals and its cycles instead)
        "ratio_precision": {
            f"{a}/{b}": dataclasses.asdict(precision)
            for (a, b), value in summary.ratios.items()
            if result.schedule == "blocks" and (precision := median_precision(value.values, RATIO_WIDTH)) is not None
        },
        "capture_seconds": {arm: spread(v) for arm, v in result.per_arm("capture_seconds").items()},
        "pool_bytes": {arm: spread(v) for arm, v in result.per_arm("pool_bytes").items()},
        "peak_allocated_bytes": {arm: spread(v) for arm, v in result.per_arm("peak_allocated_bytes").items()},
        "peak_with_pools_bytes": {arm: spread(v) for arm, v in result.per_arm("peak_with_pools_bytes").items()},
        "busy_fraction": result.busy_fraction,
        "contract_check_us": result.contract_check_us,
        "replays_per_step": result.replays_per_step,
        "copies": result.copies,
        "recording_us": result.recording_us,
        "capture_rounds": [dataclasses.asdict(record) for record in result.capture_rounds],
        "capture_ratios": {}
        if not result.capture_rounds
        else {
            f"{a}/{b}": {
                **spread(value),
                "interval": None
                if (found := median_interval(value.values)) is None
                else {**dataclasses.asdict(found), "half_width": found.half_width},
            }
            for (a, b), value in result.capture_summary().ratios.items()
        },
        "arena_bytes": {arm: spread(v) for arm, v in result.per_arm("arena_bytes").items()},
        "host_arena_bytes": {arm: spread(v) for arm, v in result.per_arm("host_arena_bytes").items()},
        "boundary_bytes": {arm: spread(v) for arm, v in result.per_arm("boundary_bytes").items()},
        "ratio_intervals": {
            f"{a}/{b}": {
                **dataclasses.asdict(found),
                "half_width": found.half_width,
                "pairs_for_half_width": {f"{h:g}": found.pairs_for(h) for h in _HALF_WIDTHS},
            }
            for (a, b), found in result.ratio_intervals().items()
        },
        "schedule": result.schedule,
        "blocks": [dataclasses.asdict(record) for record in result.blocks],
        "steps": [dataclasses.asdict(record) for record in result.steps],
    }


def markdown(result: BenchResult) -> str:
    summary = result.summary()
    arms = [arm for arm in ALL_ARMS if arm in summary.arms] + sorted(set(summary.arms) - set(ALL_ARMS))
    capture, pools, arenas, hosts, peaks, totals = (
        result.per_arm(f)
        for f in (
            "capture_seconds",
            "pool_bytes",
            "arena_bytes",
            "host_arena_bytes",
            "peak_allocated_bytes",
            "peak_with_pools_bytes",
        )
    )

    def mib(spreads: dict[str, Spread], arm: str) -> str:
        return spreads[arm].format(scale=2**-20) if arm in spreads else "-"

    figure = "median of its steps [spread]" if result.schedule == "steps" else "median of block medians [spread]"
    lines = [
        f"Method: {result.method}.",
        "",
        f"| arm | step ms: {figure} | capture s | graph pool MiB | GPU arenas MiB "
        "| pinned host arenas MiB | peak allocated MiB | peak allocated + graph pool MiB | GPU busy |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in arms:
        busy = result.busy_fraction.get(arm)
        lines.append(
            f"| {arm} | {summary.arms[arm].format(scale=1e3)} | "
            f"{capture[arm].format() if arm in capture else '-'} | {mib(pools, arm)} | {mib(arenas, arm)} | "
            f"{mib(hosts, arm)} | {mib(peaks, arm)} | {mib(totals, arm)} | "
            f"{'-' if busy is None else f'{busy:.2f}'} |"
        )
    copying = {arm: c for arm, c in result.copies.items() if c.get("d2h_seconds") or c.get("h2d_seconds")}
    if copying:
        lines += [
            "",
            "| arm | D2H ms per step | H2D ms per step | copy time overlapped by kernels |",
            "| --- | --- | --- | --- |",
        ]
        for arm, c in copying.items():
            total = c["d2h_seconds"] + c["h2d_seconds"]
            lines.append(
                f"| {arm} | {c['d2h_seconds'] * 1e3:.2f} | {c['h2d_seconds'] * 1e3:.2f} | "
                f"{c['copy_overlap_seconds'] / total:.0%} |"
            )
    if result.schedule == "steps":
        lines += _interval_table(summary, result.ratio_intervals(), _ordered_pairs(arms))
    else:
        lines += [
            "",
            f"| ratio | median [spread] over pairs of mirrored rounds | median known to (95%) "
            f"| rounds for +-{RATIO_WIDTH * 50:g}% |",
            "| --- | --- | --- | --- |",
        ]
        for a, b in _ordered_pairs(arms):
            if (a, b) in summary.ratios:
                lines.append(
                    f"| {a} / {b} | {summary.ratios[a, b].format()} | "
                    f"{_precision_cells(median_precision(summary.ratios[a, b].values, RATIO_WIDTH))} |"
                )
    if result.contract_check_us:
        per_step = result.replays_per_step
        lines += ["", "| --cg-contract-check | host us per layer replay | per step |", "| --- | --- | --- |"]
        for mode, micros in result.contract_check_us.items():
            lines.append(
                f"| {mode} | {micros:.1f} | "
                f"{'-' if per_step is None else f'{micros * per_step / 1e3:.2f} ms ({per_step} replays)'} |"
            )
    if result.capture_rounds:
        lines += _capture_table(result)
    if result.recording_us is not None:
        share = result.recording_us / 1e6 / summary.arms[RECORDING_ARM].median
        lines += [
            "",
            "| recording (--cg-metrics-out, --cg-report-out) | host us per step | of its arm's median step |",
            "| --- | --- | --- |",
            f"| train-step timer and training_log tap | {result.recording_us:.1f} | {share:.2%} |",
        ]
    return "\n".join(lines)


def _interval_table(
    summary: BenchSummary, intervals: dict[tuple[str, str], MedianInterval], pairs: Sequence[tuple[str, str]]
) -> list[str]:
    """The step schedule's ratios: per-cycle ratios' median and spread, the median's distribution-free
    95% interval, its half-width, and the cycles that would bring the half-width under each of
    ``_HALF_WIDTHS`` at the dispersion seen (``-`` below 6 cycles)."""
    lines = [
        "",
        "| ratio | median [spread] over mirrored cycles | median [95% interval] | +- | "
        + " | ".join(f"cycles for +-{h:.0%}" for h in _HALF_WIDTHS)
        + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in _HALF_WIDTHS) + " |",
    ]
    for pair in pairs:
        if pair not in summary.ratios:
            continue
        found = intervals.get(pair)
        cells = (
            ["- (under 6 cycles)", "-"] + ["-" for _ in _HALF_WIDTHS]
            if found is None
            else [f"{found.median:.4f} [{found.low:.4f}, {found.high:.4f}]", f"{found.half_width:.2%}"]
            + [f"{found.pairs_for(h)}" for h in _HALF_WIDTHS]
        )
        lines.append(f"| {pair[0]} / {pair[1]} | {summary.ratios[pair].format()} | " + " | ".join(cells) + " |")
    return lines


def _capture_table(result: BenchResult) -> list[str]:
    """The capture rounds: each arm's capture seconds, and each pair's ratio over pairs of mirrored
    rounds with its median's distribution-free 95% interval (``-`` below 6 pairs)."""
    summary = result.capture_summary()
    rounds = len({record.round for record in result.capture_rounds})
    arms = list(dict.fromkeys(record.arm for record in result.capture_rounds))
    lines = [
        "",
        f"| capture rounds ({rounds}, mirrored) | median [spread] | median [95% interval] |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {arm} capture s | {summary.arms[arm].format()} | - |" for arm in arms]
    for a, b in _ordered_pairs(arms):
        found = median_interval(summary.ratios[a, b].values)
        interval = "- (under 6 pairs)" if found is None else f"{found.median:.3f} [{found.low:.3f}, {found.high:.3f}]"
        lines.append(f"| {a} / {b} capture | {summary.ratios[a, b].format()} | {interval} |")
    return lines


def _precision_cells(found: Any) -> str:
    """``+-x%`` and ``~N`` (``--bench-rounds`` for ``RATIO_WIDTH``); ``-`` from one pair."""
    if found is None:
        return "- (one pair) | -"
    return f"+-{found.half_width:.1%} | ~{found.rounds_needed}"


def _ordered_pairs(arms: Sequence[str]) -> list[tuple[str, str]]:
    """Each arm against every arm before it: plugin / stock, plugin / eager, stock / eager."""
    return [(a, b) for i, a in enumerate(arms) for b in reversed(arms[:i])][::-1]


def plot_available() -> None:
    """Raises ``BenchOutputError`` before any GPU work when the plot cannot be drawn."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise BenchOutputError(
            "the bench's PNG plot needs matplotlib: pip install 'megatron-cg-plugin[bench]', or pass --bench-no-plot."
        )


def _plot(result: BenchResult, path: Path) -> None:
    """Step time of every block, per arm, in schedule order (drift shows as a slope all arms share)."""
    plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    for arm, points in _plotted(result).items():
        axis.scatter([p[0] for p in points], [p[1] for p in points], s=6, label=arm)
    axis.set_xlabel("step (schedule order)" if result.schedule == "steps" else "block (schedule order)")
    axis.set_ylabel("step time (ms)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plotted(result: BenchResult) -> dict[str, list[tuple[int, float]]]:
    """Per arm, (x, step ms) of every kept step: x the block's place in the block schedule, the
    step's own in the step schedule."""
    points: dict[str, list[tuple[int, float]]] = {}
    if result.schedule == "steps":
        for index, record in enumerate(result.steps):
            if record.cycle >= result.skip_steps:
                points.setdefault(record.arm, []).append((index, record.seconds * 1e3))
        return points
    for index, block in enumerate(result.blocks):
        points.setdefault(block.arm, []).extend((index, step * 1e3) for step in block.step_seconds[result.skip_steps :])
    return points


def write(result: BenchResult, out: Path, *, with_plot: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json", out / "bench.md"]
    written[0].write_text(json.dumps(to_json(result), indent=2))
    written[1].write_text(markdown(result) + "\n")
    if with_plot:
        written.append(out / "bench.png")
        _plot(result, written[-1])
    return written


def from_json(data: dict[str, Any]) -> BenchResult:
    """The result back from ``bench.json`` (to plot it on another machine)."""
    blocks = tuple(BlockRecord(**{**block, "step_seconds": tuple(block["step_seconds"])}) for block in data["blocks"])
    return BenchResult(
        data["method"],
        data["steps_per_block"],
        data["skip_steps"],
        blocks,
        data["busy_fraction"],
        data["contract_check_us"],
        data["replays_per_step"],
        tuple(data["flags"]),
        data.get("copies", {}),
        data.get("schedule", "blocks"),
        tuple(StepRecord(**step) for step in data.get("steps", ())),
        data.get("recording_us"),
        tuple(CaptureRecord(**record) for record in data.get("capture_rounds", ())),
    )


def write_host_ops(path: Path, steps: int, ops: dict[str, tuple[int, float]]) -> None:
    """One arm's profiled host operators (``--bench-profile-dir``): per operator, calls and self
    CPU microseconds per step."""
    path.write_text(
        json.dumps(
            {
                "steps": steps,
                "per_step": {
                    name: {"calls": count / steps, "self_cpu_us": micros / steps}
                    for name, (count, micros) in ops.items()
                },
            },
            indent=1,
        )
    )


def write_device_timeline(path: Path, steps: int, events: Sequence[tuple[float, float, str, int, str]]) -> None:
    """One arm's profiled device activity (``--bench-profile-dir``): per device event, its start
    and end in microseconds, its kind (d2h, h2d; kernel for everything else the device ran, memsets
    and device-to-device copies included), its stream and its name, in start order."""
    rows = [[start, end, kind, stream, name[:80]] for start, end, kind, stream, name in sorted(events)]
    with gzip.open(path, "wt") as file:
        json.dump({"steps": steps, "columns": ["start_us", "end_us", "kind", "stream", "name"], "events": rows}, file)


def read_device_timeline(path: Path) -> tuple[int, list[tuple[float, float, str, int, str]]]:
    with gzip.open(path, "rt") as file:
        data = json.load(file)
    return data["steps"], [tuple(row) for row in data["events"]]


def host_ops_diff(first: Path, second: Path, *, rows: int = 25, calls_first: bool = False) -> str:
    """Where two arms' host time per step differs: operators (or, from ``python_calls.json``,
    Python functions) by self CPU time of ``first`` minus ``second``, largest differences first (the
    first file's arm is the one asked about). ``calls_first``: rows whose calls per step differ
    come first, by how much (calls are exact where the times carry the host's noise)."""
    a, b = (json.loads(path.read_text())["per_step"] for path in (first, second))
    empty = {"calls": 0.0, "self_cpu_us": 0.0}

    def order(item: tuple[str, dict, dict]) -> tuple[float, float]:
        _, x, y = item
        calls = abs(x["calls"] - y["calls"]) if calls_first else 0.0
        return -calls, -abs(x["self_cpu_us"] - y["self_cpu_us"])

    deltas = sorted(((name, a.get(name, empty), b.get(name, empty)) for name in set(a) | set(b)), key=order)
    total = sum(x["self_cpu_us"] for x in a.values()) - sum(x["self_cpu_us"] for x in b.values())
    kind = "python calls (the calls are exact; the times carry cProfile's overhead)" if calls_first else "host ops"
    lines = [
        f"{kind}: host time per step, {first.stem.split('.')[0]} - {second.stem.split('.')[0]}: {total:+.0f} us",
        "",
        f"| {'function' if calls_first else 'operator'} | us per step, difference | first | second | "
        "calls per step, first / second |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| `{name}` | {x['self_cpu_us'] - y['self_cpu_us']:+.1f} | {x['self_cpu_us']:.1f} | "
        f"{y['self_cpu_us']:.1f} | {x['calls']:g} / {y['calls']:g} |"
        for name, x, y in deltas[:rows]
    ]
    return "\n".join(lines)


_USAGE = (
    "usage: python -m megatron_cg_plugin.bench.output BENCH_JSON  (draws bench.png beside it)\n"
    "       python -m megatron_cg_plugin.bench.output --host-diff DIR ARM OTHER_ARM  "
    "(the --bench-profile-dir operators where two arms differ)\n"
    "       python -m megatron_cg_plugin.bench.output --timeline DIR/ARM.device_timeline.json.gz ...  "
    "(per step: kernel time, host copies and how much of them no kernel ran beside)"
)


def _timeline_table(paths: Sequence[Path]) -> str:
    """One row per device timeline: where its host copies left the compute waiting."""
    lines = [
        "| timeline | span ms | kernels ms | D2H ms (exposed) | H2D ms (exposed) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for path in paths:
        steps, events = read_device_timeline(path)
        s = CopyStalls.of(events, steps=steps)
        lines.append(
            f"| {path.name.replace('.device_timeline.json.gz', '')} | {s.span * 1e3:.1f} | {s.kernels * 1e3:.1f} | "
            f"{s.d2h * 1e3:.1f} ({s.exposed_d2h * 1e3:.1f}) | {s.h2d * 1e3:.1f} ({s.exposed_h2d * 1e3:.1f}) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """``python -m megatron_cg_plugin.bench.output bench.json`` draws bench.png beside it (for a
    bench run with --bench-no-plot on a host without matplotlib); ``--host-diff DIR ARM OTHER``
    prints where two arms' profiled host time differs; ``--timeline FILE...`` where each device
    timeline's host copies ran with no kernel beside them."""
    if len(argv) >= 2 and argv[0] == "--timeline":
        missing = [path for path in argv[1:] if not Path(path).exists()]
        if missing:
            print(
                f"no {', '.join(missing)}: run megatron-cg bench with --bench-profile-dir DIR, then pass "
                "DIR/<arm>.device_timeline.json.gz."
            )
            return 2
        print(_timeline_table([Path(path) for path in argv[1:]]))
        return 0
    if len(argv) == 4 and argv[0] == "--host-diff":
        paths = [Path(argv[1]) / f"{arm}.host_ops.json" for arm in argv[2:]]
        missing = [str(path) for path in paths if not path.exists()]
        if missing:
            print(
                f"no {', '.join(missing)}: run megatron-cg bench with --bench-profile-dir {argv[1]} and both arms "
                "in --bench-arms."
            )
            return 2
        print(host_ops_diff(*paths))
        python = [Path(argv[1]) / f"{arm}.python_calls.json" for arm in argv[2:]]
        if all(path.exists() for path in python):  # older benches wrote none
            print("\n" + host_ops_diff(*python, rows=40, calls_first=True))
        return 0
    if len(argv) != 1:
        print(_USAGE)
        return 2
    source = Path(argv[0])
    _plot(from_json(json.loads(source.read_text())), source.with_suffix(".png"))
    print(f"wrote {source.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
