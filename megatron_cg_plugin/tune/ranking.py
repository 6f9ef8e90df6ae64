"""The tune's judgement, pure: each setup's row (refused, over the memory budget, timed or not), the
budget, the stopping rule (the best setup separated from the next, or out of time), the ranking, the
verdicts, the winning flags and the table (no torch, no Megatron; ``tune.command`` and
``tune.timing`` fill the rows).

A timed setup's figure is its step time over eager's in the same process, with an interval for its
median: the step schedule's per-cycle ratios (or the block schedule's per-pair ratios) give the
distribution-free 95% interval of ``bench.schedule.median_interval`` from 6 values on; with 2 to 5
(pairs of blocks, mostly), the median's standard error (``bench.schedule.median_precision``) with Student's t
quantile in place of the normal one, which over so few values reads far too narrow. Eager is 1.0 exactly.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_cg_plugin.bench.schedule import Z95, median_interval, median_precision
from megatron_cg_plugin.setups.graph_setups import GraphSetup

__all__ = [
    "Measured",
    "RatioInterval",
    "Row",
    "apply_budget",
    "default_budget",
    "few_values_interval",
    "fit_together",
    "graphs_do_not_pay",
    "rank",
    "ratio_interval",
    "stop_reason",
    "table",
    "to_json",
    "verdicts",
    "winner",
    "winner_lines",
]

# The default budget leaves this share of the device's memory free beside eager's peak and the graphs:
# the allocator's fragmentation, NCCL's and cuBLAS's workspaces, what the planner does not model.
_DEFAULT_MARGIN_FRACTION = 0.05
_MIB = 2**20
# Student's t two-sided 95% quantiles by degrees of freedom: the interval over 2 to 5 values (sign test from 6).
_T95_FEW = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764}


@dataclasses.dataclass(frozen=True)
class RatioInterval:
    """A setup's step time over eager's: the median of its per-cycle (or per-pair) ratios and an
    interval for it (``method`` says which), over ``n`` values."""

    median: float
    low: float
    high: float
    n: int
    method: str

    def overlaps(self, other: RatioInterval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def format(self) -> str:
        if self.n == 0:
            return "1 (reference)"
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


EAGER_RATIO = RatioInterval(1.0, 1.0, 1.0, 0, "the reference")


def ratio_interval(values: Sequence[float], *, unit: str) -> RatioInterval | None:
    """The interval of a ratio's median from its per-``unit`` values (``cycles`` or ``pairs``): the
    sign test's 95% interval where there are enough values, else (2 or more) the median's standard error
    times Student's t quantile for ``n - 1`` degrees of freedom; None for fewer."""
    found = median_interval(values)
    if found is not None:
        return RatioInterval(found.median, found.low, found.high, found.n, f"95% over {found.n} {unit}")
    precision = median_precision(values)
    if precision is None:
        return None
    return few_values_interval(statistics.median(values), precision.half_width, len(values), unit=unit)


def few_values_interval(median: float, normal_half_width: float, n: int, *, unit: str) -> RatioInterval:
    """The ~95% interval of a median over ``n`` (2 to 5) values from the normal half-width of its standard
    error (``bench.schedule.median_precision``, in log ratio), widened to Student's t quantile."""
    spread = math.exp(normal_half_width * _T95_FEW[n - 1] / Z95)
    return RatioInterval(median, median / spread, median * spread, n, f"~95% over {n} {unit} (Student's t)")


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the timing process measured of one setup."""

    schedule: str  # steps or blocks
    step_seconds: float  # the median of its kept steps (blocks: of its block medians)
    ratio: RatioInterval | None  # over eager; None: too few values for an interval
    graph_bytes: int | None = None  # the graph pools its capture created, and slot arenas
    peak_bytes: int | None = None  # peak allocated over its steps, plus its own graph pools
    busy_fraction: float | None = None
    capture_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One setup through the tune: its flags, what refused it or kept it from timing, its prediction and,
    once timed, what was measured."""

    setup: GraphSetup
    flags: tuple[str, ...]
    yours: bool = False  # the user's own flags describe this setup
    environment: tuple[str, ...] = ()  # NAME=value it needs beyond the user's environment
    refused: tuple[tuple[str, str], ...] = ()  # (rule, message): the rules' check refused the flags
    predicted_bytes: int | None = None  # graph pool and arenas (planner); None: nothing predicted
    prediction_leaves_out: tuple[str, ...] = ()
    schedule: str | None = None  # how the process times it (candidates.placement); None: not in it
    why: str = ""  # why this schedule, or why not timed
    over_budget: str = ""
    failed: str = ""  # its capture or steps failed in the timing process
    notes: tuple[str, ...] = ()  # caveats of the timing (candidates.build_time_notes)
    measured: Measured | None = None

    @property
    def label(self) -> str:
        return self.setup.label

    @property
    def timable(self) -> bool:
        """Left for the timing process: allowed, in budget and placed."""
        return not (self.refused or self.over_budget or self.failed) and self.schedule is not None

    @property
    def ratio(self) -> RatioInterval | None:
        if not self.setup.graphed:
            return EAGER_RATIO
        return None if self.measured is None else self.measured.ratio


def default_budget(device_bytes: int, eager_peak_bytes: int, margin_fraction: float = _DEFAULT_MARGIN_FRACTION) -> int:
    """What the graphs may take: the device's memory less eager's measured peak and a margin (never below 0)."""
    return max(0, device_bytes - eager_peak_bytes - int(device_bytes * margin_fraction))


def apply_budget(rows: Sequence[Row], budget_bytes: int | None, *, source: str) -> list[Row]:
    """Every allowed graphed row whose predicted graph memory exceeds ``budget_bytes`` marked over budget,
    with the figures (``source`` says where the budget came from); rows the planner did not predict pass."""
    if budget_bytes is None:
        return list(rows)
    return [
        dataclasses.replace(
            row,
            over_budget=f"over budget: predicted {row.predicted_bytes / _MIB:.0f} MiB > {budget_bytes / _MIB:.0f} MiB "
            f"({source})",
        )
        if row.setup.graphed
        and not row.refused
        and row.predicted_bytes is not None
        and row.predicted_bytes > budget_bytes
        else row
        for row in rows
    ]


def fit_together(rows: Sequence[Row], budget_bytes: int | None) -> list[Row]:
    """The step schedule keeps every arm's graphs alive at once: in order, each step-placed row joins them
    while the predicted sum stays within ``budget_bytes``; the others (and those without a prediction,
    when there is a budget) move to the block schedule, captured alone."""
    if budget_bytes is None:
        return list(rows)
    together, placed = 0, []
    for row in rows:
        if row.timable and row.schedule == "steps" and row.setup.graphed:
            size = row.predicted_bytes
            if size is not None and together + size <= budget_bytes:
                together += size
            else:
                why = (
                    "not predicted, so captured alone"
                    if size is None
                    else f"with the other step-schedule arms alive its {size / _MIB:.0f} MiB would pass the budget"
                )
                row = dataclasses.replace(row, schedule="blocks", why=why)
        placed.append(row)
    return placed


def _compared(rows: Sequence[Row]) -> list[Row]:
    """The rows timing compares: eager and each setup measured without failing (a setup that failed after
    some timed rounds keeps their figures, but is no candidate)."""
    return [row for row in rows if not row.setup.graphed or (row.measured is not None and not row.failed)]


def rank(rows: Sequence[Row]) -> list[Row]:
    """The compared rows with a ratio (eager included), fastest first."""
    return sorted((row for row in _compared(rows) if row.ratio is not None), key=lambda row: row.ratio.median)  # type: ignore[union-attr]


def _separated(ranked: Sequence[Row]) -> bool:
    """The best row's interval lies wholly below every other one's (a slower median may have a wider interval)."""
    if len(ranked) < 2:
        return True
    best = ranked[0].ratio
    assert best is not None and all(row.ratio is not None for row in ranked)  # rank keeps rows with a ratio
    return all(best.high < row.ratio.low for row in ranked[1:])  # type: ignore[union-attr]


def stop_reason(rows: Sequence[Row], *, elapsed: float, seconds: float) -> str | None:
    """Why timing may stop now: ``separated`` once every compared row has an interval and the best one's
    lies below every other one's, ``out of time`` once ``elapsed`` reaches ``seconds``; None: go on."""
    timed = _compared(rows)
    if all(row.ratio is not None for row in timed) and _separated(rank(timed)):
        return "separated"
    if elapsed >= seconds:
        return "out of time"
    return None


def verdicts(rows: Sequence[Row]) -> dict[str, str]:
    """Each row's verdict: refused (with the rules), over budget, not timed (why), failed, or against the
    best row: best, within its interval, slower. The best is the ``winner``, or eager where graphs do not
    pay: a setup whose median is lower but whose interval reaches eager's step time is not the best."""
    ranked = rank(rows)
    timed = any(row.measured is not None for row in rows)
    best = (winner(rows) or next((row for row in ranked if not row.setup.graphed), None)) if timed else None
    found: dict[str, str] = {}
    for row in rows:
        if row.refused:
            found[row.label] = "refused [" + ", ".join(dict.fromkeys(name for name, _ in row.refused)) + "]"
        elif row.over_budget:
            found[row.label] = row.over_budget
        elif row.failed:
            found[row.label] = f"failed: {row.failed}"
        elif row.schedule is None:
            found[row.label] = f"not timed: {row.why}"
        elif best is None or row.ratio is None:
            found[row.label] = (
                f"to time ({'step' if row.schedule == 'steps' else 'block'} schedule)"
                if best is None
                else "timed, no interval (too few values)"
            )
        elif row is best:
            assert best.ratio is not None  # rank keeps rows with a ratio
            close = [other.label for other in ranked if other is not best and other.ratio.overlaps(best.ratio)]  # type: ignore[union-attr]
            found[row.label] = "best" + (f" (not separated from {close[0]})" if close else "")
        else:
            assert best.ratio is not None and row.ratio is not None  # rank keeps rows with a ratio
            found[row.label] = (
                "within the best's interval" if row.ratio.overlaps(best.ratio) else "slower than the best"
            )
        if not row.setup.graphed:
            found[row.label] = f"baseline; {found[row.label]}"
    return found


def winner(rows: Sequence[Row]) -> Row | None:
    """The graphed setup to train with: the fastest that beats eager beyond its interval; None when none does."""
    paying = [row for row in rank(rows) if row.setup.graphed and row.ratio is not None and row.ratio.high < 1.0]
    return paying[0] if paying else None


def graphs_do_not_pay(rows: Sequence[Row]) -> str | None:
    """The plain sentence for a timed model that no graphed setup speeds up beyond its interval; None when
    one does, or nothing graphed was timed."""
    timed = [row for row in rank(rows) if row.setup.graphed]
    if not timed or winner(rows) is not None:
        return None
    fastest = timed[0]
    assert fastest.ratio is not None  # rank keeps rows with a ratio
    # A lower median whose interval reaches eager's is not shown to pay, nor shown not to: more time may tell.
    undecided = (
        f" A longer --tune-seconds may yet separate {fastest.label} from eager." if fastest.ratio.median < 1 else ""
    )
    return (
        f"Graphs do not pay for this model: no setup beat eager beyond its interval (the fastest, {fastest.label}, "
        f"took {fastest.ratio.format()} of eager's step time); train it eagerly.{undecided}"
    )


def winner_lines(rows: Sequence[Row], base_has_offload: bool) -> list[str]:
    """The winning setup, its flags to paste and what of the user's flags to drop; the sentence when
    graphs do not pay; nothing before timing."""
    best = winner(rows)
    if best is None:
        sentence = graphs_do_not_pay(rows)
        return [] if sentence is None else [sentence]
    assert best.ratio is not None  # winner has a ratio
    lines = [
        f"best setup: {best.label} ({best.ratio.format()} of eager's step time, {best.ratio.method})",
        f"  its graph flags: {shlex.join(best.setup.graph_flags)}",
        "  in place of your --cuda-graph-impl, --cuda-graph-modules and --cg-slot-capture",
    ]
    if base_has_offload and not best.setup.offload:
        lines.append("  and without your activation offload flags (--fine-grained-activation-offloading ...)")
    others = [
        row.label
        for row in rank(rows)
        if row is not best and row.ratio is not None and row.ratio.overlaps(best.ratio) and row.setup.graphed
    ]
    if others:
        lines.append(
            f"  not told apart from {', '.join(others)} in the time given (their intervals overlap): "
            "a longer --tune-seconds may separate them"
        )
    return lines


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / _MIB:.0f}"


def table(rows: Sequence[Row]) -> str:
    """The markdown table: one row per setup, timed ones first, fastest first."""
    found = verdicts(rows)
    ranked = rank(rows)
    ordered = ranked + [row for row in rows if row not in ranked]
    lines = [
        "| setup | predicted graph MiB | measured graph MiB | peak MiB | step ms | vs eager [interval] | GPU busy "
        "| capture s | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in ordered:
        measured = row.measured
        cells = [
            row.label + (" (yours)" if row.yours else ""),
            _mib(row.predicted_bytes) if row.setup.graphed else "-",
            _mib(None if measured is None else measured.graph_bytes),
            _mib(None if measured is None else measured.peak_bytes),
            "-" if measured is None else f"{measured.step_seconds * 1e3:.2f}",
            "-" if row.ratio is None or (measured is None and row.setup.graphed) else row.ratio.format(),
            "-" if measured is None or measured.busy_fraction is None else f"{measured.busy_fraction:.2f}",
            "-" if measured is None or measured.capture_seconds is None else f"{measured.capture_seconds:.2f}",
            found[row.label],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_json(rows: Sequence[Row], **extra: Any) -> dict[str, Any]:
    """Everything of the rows, their verdicts and the winner, with ``extra`` (the budget, how timing stopped)."""
    found = verdicts(rows)
    best = winner(rows)
    return {
        **extra,
        "setups": [
            {
                "setup": row.label,
                "yours": row.yours,
                "graph_flags": list(row.setup.graph_flags),
                "flags": list(row.flags),
                "environment": list(row.environment),
                "refused": [{"rule": name, "message": message} for name, message in row.refused],
                "predicted_graph_bytes": row.predicted_bytes,
                "prediction_leaves_out": list(row.prediction_leaves_out),
                "schedule": row.schedule,
                "why": row.why,
                "notes": list(row.notes),
                "measured": None if row.measured is None else _measured_json(row.measured),
                "verdict": found[row.label],
            }
            for row in rows
        ],
        "winner": None if best is None else {"setup": best.label, "graph_flags": list(best.setup.graph_flags)},
        "graphs_do_not_pay": graphs_do_not_pay(rows),
    }


def _measured_json(measured: Measured) -> Mapping[str, Any]:
    return {
        **dataclasses.asdict(measured),
        "ratio": None if measured.ratio is None else dataclasses.asdict(measured.ratio),
    }
