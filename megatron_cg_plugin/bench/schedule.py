"""In-process A/B measurement, the pure part (no torch): the two interleaved schedules and their
statistics.

On these machines the same command in two processes gave a 14 ms and then a 35 ms median step, so
arms are only compared inside one process. The block schedule runs blocks of steps interleaved
round by round: every round runs each arm once, in the arms' order in even rounds and reversed in
odd ones. Over each pair of rounds every two arms then sit at mirrored places, so a drift that is
linear over the pair cancels from their ratio. An arm's figure is the median of its block medians,
quoted with their spread; a ratio of two arms is the geometric mean of its two per-round ratios in
each pair of rounds, and its median and spread over the pairs. ``median_precision`` says how
closely that median is known, and how many pairs would pin it to a given width.

The step schedule (``interleaved_steps``) alternates single steps in mirrored cycles (A B B A, then
B A A B; A B C C B A, then C B A A B C): every arm's steps in a cycle sit at places with the same
mean, so a drift that is exponential over the cycle cancels exactly from the per-cycle ratio, a cost
of the places next to a cycle's ends falls on each arm in turn, and a shift of the host's
speed lasting a few steps, which moves whole blocks, touches few cycles. ``median_interval`` gives
the per-cycle ratios' median a distribution-free confidence interval and the cycles it would take
to narrow it to a given half-width.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction

__all__ = [
    "BenchSummary",
    "Block",
    "CopyStalls",
    "DeviceTime",
    "MedianInterval",
    "Spread",
    "Step",
    "Z95",
    "busy_seconds",
    "fewest_for_interval",
    "interleaved_blocks",
    "interleaved_steps",
    "intervals_by_kind",
    "median_interval",
    "median_precision",
    "run_schedule",
    "summarize",
    "summarize_steps",
]


@dataclasses.dataclass(frozen=True)
class Block:
    round: int
    arm: str


def interleaved_blocks(arms: Sequence[str], rounds: int) -> list[Block]:
    """``rounds`` rounds (an even number) of every arm once: in ``arms``' order, then reversed."""
    if len(set(arms)) != len(arms) or not arms:
        raise ValueError(f"arms must be distinct and not empty, got {list(arms)}.")
    if rounds < 2 or rounds % 2:
        raise ValueError(f"rounds must be an even number >= 2 (pairs of mirrored rounds), got {rounds}.")
    return [Block(r, arm) for r in range(rounds) for arm in (arms if r % 2 == 0 else list(reversed(arms)))]


@dataclasses.dataclass(frozen=True)
class Spread:
    median: float
    low: float  # the smallest and the largest of the values the median is taken over
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values to summarize.")
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def format(self, unit: str = "", scale: float = 1.0) -> str:
        return (
            f"{self.median * scale:.3g}{unit} [{self.low * scale:.3g}, {self.high * scale:.3g}] (n={len(self.values)})"
        )


@dataclasses.dataclass(frozen=True)
class BenchSummary:
    arms: dict[str, Spread]  # arm -> its block medians
    ratios: dict[tuple[str, str], Spread]  # (a, b) -> per-round a / b of block medians


def summarize(block_steps: Mapping[Block, Sequence[float]], *, skip_steps: int = 0) -> BenchSummary:
    """Per arm the median of its block medians; per pair of arms the ratio of block medians over
    each pair of mirrored rounds (module docstring). ``skip_steps`` drops each block's first steps
    (a block that captured graphs warms up)."""
    medians: dict[Block, float] = {}
    for block, steps in block_steps.items():
        kept = list(steps)[skip_steps:]
        if not kept:
            raise ValueError(f"block {block} has no step left after skipping {skip_steps}.")
        medians[block] = statistics.median(kept)
    arms = sorted({block.arm for block in medians})
    per_arm = {
        arm: Spread.of([medians[b] for b in sorted(medians, key=lambda b: b.round) if b.arm == arm]) for arm in arms
    }
    pairs = sorted({block.round // 2 for block in medians})
    ratios = {}
    for a in arms:
        for b in arms:
            if a == b:
                continue
            paired = []
            for pair in pairs:
                rounds = (2 * pair, 2 * pair + 1)
                if all(Block(r, arm) in medians for r in rounds for arm in (a, b)):
                    first, second = (medians[Block(r, a)] / medians[Block(r, b)] for r in rounds)
                    paired.append(math.sqrt(first * second))
            if paired:
                ratios[(a, b)] = Spread.of(paired)
    return BenchSummary(per_arm, ratios)


Z95 = 1.959964  # the normal distribution's two-sided 95% quantile
_MEDIAN_SE = math.sqrt(math.pi / 2)  # the median's standard error over the mean's, for normal values
_MAD_TO_SIGMA = 1.4826  # a normal sample's deviation over its median absolute deviation


@dataclasses.dataclass(frozen=True)
class _MedianPrecision:
    """How closely the median of a ratio's per-pair values is known: the half-width of its ~95%
    interval (relative: in log ratio), and the pairs of rounds after which it would be at most half
    of ``width``, at the dispersion seen so far."""

    pairs: int
    half_width: float
    width: float
    pairs_needed: int

    @property
    def rounds_needed(self) -> int:
        """``--bench-rounds`` for ``width``: two rounds a pair."""
        return 2 * max(self.pairs, self.pairs_needed)


_TIE_TOLERANCE = 1e-12  # in log ratio: far below any dispersion a bench can see (1e-12 is 1e-10 %)


def median_precision(ratios: Sequence[float], width: float = 0.02) -> _MedianPrecision | None:
    """From a ratio's per-pair values: the standard error of their median as a normal sample's,
    sqrt(pi/2) * s / sqrt(n), with s the log ratios' median absolute deviation scaled to a normal
    deviation (robust, as the median is: one disturbed pair moves neither much; where ties make it
    0, their sample deviation), and the interval +-1.96 of it. The pairs needed are the fewest (2
    at least) whose interval, at this s, is at most ``width`` wide. None below 2 values: one pair
    shows no dispersion. With few pairs s itself is rough, so the count is a first estimate: run
    that many and ask again."""
    if not width > 0:
        raise ValueError(f"width={width}: ask for a positive interval width (0.02 for +-1%).")
    if any(not value > 0 for value in ratios):
        raise ValueError(f"ratios must be positive, got {list(ratios)}.")
    if len(ratios) < 2:
        return None
    logs = [math.log(value) for value in ratios]
    center = statistics.median(logs)
    mad = statistics.median([abs(value - center) for value in logs])
    # Ties at the median: a deviation of rounding size (1e-16 or so) is a tie too, or a constant factor
    # on every ratio, which moves no dispersion, would switch between the two estimates.
    sigma = _MAD_TO_SIGMA * mad if mad > _TIE_TOLERANCE else statistics.stdev(logs)
    scale = Z95 * _MEDIAN_SE * sigma  # the interval's half-width times sqrt(pairs)
    half_target = width / 2
    needed = max(2, math.ceil((scale / half_target) ** 2))
    # The closed form can be one off in floating point: settle it on the half-width as reported.
    while needed > 2 and scale / math.sqrt(needed - 1) <= half_target:
        needed -= 1
    while scale / math.sqrt(needed) > half_target:
        needed += 1
    return _MedianPrecision(len(ratios), scale / math.sqrt(len(ratios)), width, needed)


@dataclasses.dataclass(frozen=True)
class Step:
    cycle: int
    arm: str


def interleaved_steps(arms: Sequence[str], cycles: int) -> list[Step]:
    """``cycles`` mirrored cycles of single steps: each runs every arm once in one order and once
    reversed, so within a cycle each arm's two places have the same mean; the order alternates
    cycle by cycle (A B B A, B A A B; A B C C B A, C B A A B C), so no arm always holds the outer
    places, next to the cycle's ends (on the Llama-like model the plugin, outer in every cycle, stepped
    2-5% slower than stock; with one order a place's cost and an arm's look the same)."""
    if len(set(arms)) != len(arms) or not arms:
        raise ValueError(f"arms must be distinct and not empty, got {list(arms)}.")
    if cycles < 1:
        raise ValueError(f"cycles must be >= 1, got {cycles}.")
    orders = (list(arms), list(reversed(arms)))
    return [Step(c, arm) for c in range(cycles) for arm in (*orders[c % 2], *reversed(orders[c % 2]))]


def _geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(value) for value in values) / len(values))


def summarize_steps(steps: Sequence[tuple[Step, float]], *, skip_cycles: int = 0) -> BenchSummary:
    """The step schedule's summary: per arm its kept steps (median and extremes); per pair of arms
    the per-cycle ratio of the geometric means of their steps in that cycle (mirrored places: a
    drift exponential over the cycle cancels exactly). The first ``skip_cycles`` cycles are dropped
    (the first steps after the captures warm up)."""
    if any(not seconds > 0 for _, seconds in steps):
        raise ValueError("step times must be positive.")
    kept: dict[int, dict[str, list[float]]] = {}
    for step, seconds in steps:
        if step.cycle >= skip_cycles:
            kept.setdefault(step.cycle, {}).setdefault(step.arm, []).append(seconds)
    if not kept:
        raise ValueError(f"no cycle left after skipping {skip_cycles}.")
    arms = sorted({arm for cycle in kept.values() for arm in cycle})
    per_arm = {arm: Spread.of([s for c in sorted(kept) for s in kept[c].get(arm, ())]) for arm in arms}
    means = {c: {arm: _geometric_mean(values) for arm, values in kept[c].items()} for c in sorted(kept)}
    ratios = {}
    for a in arms:
        for b in arms:
            paired = [m[a] / m[b] for m in means.values() if a != b and a in m and b in m]
            if paired:
                ratios[(a, b)] = Spread.of(paired)
    return BenchSummary(per_arm, ratios)


@dataclasses.dataclass(frozen=True)
class MedianInterval:
    """A distribution-free confidence interval of the median of ``n`` positive values (the sign
    test's: the k-th smallest and k-th largest value, k the largest rank whose interval still
    covers the median with probability >= ``confidence``; ``coverage`` is that probability for
    independent values from any continuous distribution). ``half_width`` is relative: half the
    interval's width in log, 0.01 for about +-1%."""

    median: float
    low: float
    high: float
    n: int
    confidence: float
    coverage: float

    @property
    def half_width(self) -> float:
        return (math.log(self.high) - math.log(self.low)) / 2

    def pairs_for(self, half_width: float) -> int:
        """The values (pairs, cycles) after which, at the dispersion seen so far, the interval's
        half-width would be at most ``half_width``: its width shrinks as 1 / sqrt(n). A first
        estimate from few values: run that many and read it again."""
        if not half_width > 0:
            raise ValueError(f"half_width={half_width}: ask for a positive half-width (0.01 for +-1%).")
        fewest = fewest_for_interval(self.confidence)
        if self.half_width <= 0:
            return fewest
        return max(fewest, math.ceil(self.n * (self.half_width / half_width) ** 2 * (1 - 1e-12)))


def _order_rank(n: int, confidence: float) -> tuple[int, float] | None:
    """The largest rank k (1-based) whose interval [x_(k), x_(n+1-k)] covers the median with
    probability >= ``confidence``, and that probability: 1 - 2 P(Binomial(n, 1/2) <= k - 1).
    Exact in integers; None where even [min, max] covers too little."""
    tail = Fraction(1) - Fraction(confidence)  # both tails together
    total, cumulative, term, k = 2**n, 0, 1, 0
    while k < (n + 1) // 2:
        if 2 * (cumulative + term) * tail.denominator > tail.numerator * total:  # 2 P(B <= k) > tail
            break
        cumulative += term  # P(B <= k) in units of 2^-n
        k += 1
        term = term * (n - k + 1) // k  # C(n, k)
    if k == 0:
        return None
    return k, float(1 - Fraction(2 * cumulative, total))


def fewest_for_interval(confidence: float = 0.95) -> int:
    """The fewest values with a ``median_interval`` at ``confidence`` (6 at 95%)."""
    n = 1
    while _order_rank(n, confidence) is None:
        n += 1
    return n


def median_interval(values: Sequence[float], confidence: float = 0.95) -> MedianInterval | None:
    """The median of positive ``values`` (per-pair or per-cycle ratios) with its distribution-free
    ``confidence`` interval from order statistics (``MedianInterval``); None below
    ``fewest_for_interval`` values. It assumes the values independent, as the cycles' ratios are
    where the host's shifts last shorter than a cycle; it assumes no distribution."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: give a probability between 0 and 1 (0.95).")
    if any(not value > 0 for value in values):
        raise ValueError(f"values must be positive, got {list(values)}.")
    found = _order_rank(len(values), confidence)
    if found is None:
        return None
    k, coverage = found
    ordered = sorted(values)
    return MedianInterval(statistics.median(ordered), ordered[k - 1], ordered[-k], len(ordered), confidence, coverage)


def run_schedule(
    schedule: Sequence[Block],
    run_block: Callable[[Block], Sequence[float]],
    progress: Callable[[str], None] = lambda line: None,
    *,
    skip_steps: int = 0,
) -> dict[Block, list[float]]:
    """Runs every block in order (``run_block`` returns its step times) and reports each, its median
    without the first ``skip_steps`` as ``summarize`` will take it."""
    results: dict[Block, list[float]] = {}
    for index, block in enumerate(schedule):
        steps = list(run_block(block))
        results[block] = steps
        kept = steps[skip_steps:]
        median = statistics.median(kept) if kept else float("nan")
        progress(
            f"block {index + 1}/{len(schedule)}: round {block.round} {block.arm}: "
            f"{len(steps)} steps, median {median * 1e3:.2f} ms"
        )
    return results


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """How long at least one of ``intervals`` (start, end) runs: kernels on several streams overlap,
    and CUDA graph replays are listed beside their kernels, so summing durations counts time twice."""
    total, covered_until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= covered_until:
            continue
        total += end - max(start, covered_until)
        covered_until = end
    return total


@dataclasses.dataclass(frozen=True)
class DeviceTime:
    """Per profiled step: how long the GPU was busy, how long it copied to and from the host
    (activation offload), and how much of the copying ran while a kernel ran (hidden by compute)."""

    busy_seconds: float
    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0
    copy_overlap_seconds: float = 0.0

    @classmethod
    def of(
        cls,
        kernels: Sequence[tuple[float, float]],
        d2h: Sequence[tuple[float, float]],
        h2d: Sequence[tuple[float, float]],
        *,
        steps: int,
        scale: float = 1.0,
    ) -> DeviceTime:
        """From device intervals (start, end) over ``steps`` steps, ``scale`` seconds per unit."""
        copies = [*d2h, *h2d]
        overlap = busy_seconds(kernels) + busy_seconds(copies) - busy_seconds([*kernels, *copies])
        per_step = scale / steps
        return cls(
            busy_seconds([*kernels, *copies]) * per_step,
            busy_seconds(d2h) * per_step,
            busy_seconds(h2d) * per_step,
            overlap * per_step,
        )


def intervals_by_kind(events: Sequence[tuple[float, float, str, int, str]]) -> dict[str, list[tuple[float, float]]]:
    """A device timeline's (start, end) intervals of each kind: kernel, d2h, h2d."""
    by_kind: dict[str, list[tuple[float, float]]] = {"kernel": [], "d2h": [], "h2d": []}
    for start, end, kind, _stream, _name in events:
        by_kind[kind].append((start, end))
    return by_kind


@dataclasses.dataclass(frozen=True)
class CopyStalls:
    """From a device timeline (``--bench-profile-dir``), per step, in seconds: the span from the
    first device activity to the last, the time a kernel ran, and each copy direction's time and
    the part of it no kernel ran beside (exposed: the compute had stopped, waiting or idle)."""

    span: float
    kernels: float
    d2h: float
    h2d: float
    exposed_d2h: float
    exposed_h2d: float

    @classmethod
    def of(cls, events: Sequence[tuple[float, float, str, int, str]], *, steps: int, scale: float = 1e-6) -> CopyStalls:
        """``events``: (start, end, kind, stream, name), kind kernel, d2h or h2d; ``scale`` seconds per unit."""
        by_kind = intervals_by_kind(events)
        kernels = busy_seconds(by_kind["kernel"])
        span = max(end for _, end, *_ in events) - min(start for start, *_ in events) if events else 0.0
        per_step = scale / steps
        return cls(
            span * per_step,
            kernels * per_step,
            busy_seconds(by_kind["d2h"]) * per_step,
            busy_seconds(by_kind["h2d"]) * per_step,
            (busy_seconds(by_kind["kernel"] + by_kind["d2h"]) - kernels) * per_step,
            (busy_seconds(by_kind["kernel"] + by_kind["h2d"]) - kernels) * per_step,
        )
