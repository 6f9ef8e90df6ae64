"""In-process A/B measurement, the pure part (no torch): the interleaved block schedule and its
statistics.

On these machines the same command in two processes gave a 14 ms and then a 35 ms median step, so
arms are only compared inside one process, in blocks interleaved round by round: every round runs
each arm once, in the arms' order in even rounds and reversed in odd ones. Over each pair of rounds
every two arms then sit at mirrored places, so a drift that is linear over the pair cancels from
their ratio. An arm's figure is the median of its block medians, quoted with their spread; a ratio
of two arms is the geometric mean of its two per-round ratios in each pair of rounds, and its
median and spread over the pairs. ``median_precision`` says how closely that median is known, and
how many pairs would pin it to a given width.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Mapping, Sequence


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
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            raise ValueError("no values to summarize.")
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def format(self, unit: str = "", scale: float = 1.0) -> str:
        return (f"{self.median * scale:.3g}{unit} [{self.low * scale:.3g}, {self.high * scale:.3g}] "
                f"(n={len(self.values)})")


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
    per_arm = {arm: Spread.of([medians[b] for b in sorted(medians, key=lambda b: b.round) if b.arm == arm])
               for arm in arms}
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
MEDIAN_SE = math.sqrt(math.pi / 2)  # the median's standard error over the mean's, for normal values
MAD_TO_SIGMA = 1.4826  # a normal sample's deviation over its median absolute deviation


@dataclasses.dataclass(frozen=True)
class MedianPrecision:
    """How closely the median of a ratio's per-pair values is known: the half-width of its ~95%
    interval (relative: in log ratio), and the pairs of rounds after which it would be at most half
    of ``width``, at the dispersion seen so far."""

    pairs: int
    half_width: float
    width: float
    pairs_needed: int

    @property
    def more_pairs(self) -> int:
        return max(0, self.pairs_needed - self.pairs)

    @property
    def rounds_needed(self) -> int:
        """``--bench-rounds`` for ``width``: two rounds a pair."""
        return 2 * max(self.pairs, self.pairs_needed)


def median_precision(ratios: Sequence[float], width: float = 0.02) -> MedianPrecision | None:
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
    sigma = MAD_TO_SIGMA * statistics.median([abs(value - center) for value in logs]) or statistics.stdev(logs)
    scale = Z95 * MEDIAN_SE * sigma  # the interval's half-width times sqrt(pairs)
    half_target = width / 2
    needed = max(2, math.ceil((scale / half_target) ** 2))
    # The closed form can be one off in floating point: settle it on the half-width as reported.
    while needed > 2 and scale / math.sqrt(needed - 1) <= half_target:
        needed -= 1
    while scale / math.sqrt(needed) > half_target:
        needed += 1
    return MedianPrecision(len(ratios), scale / math.sqrt(len(ratios)), width, needed)


def run_schedule(schedule: Sequence[Block], run_block: Callable[[Block], Sequence[float]],
                 progress: Callable[[str], None] = lambda line: None, *, skip_steps: int = 0) -> dict[Block, list[float]]:
    """Runs every block in order (``run_block`` returns its step times) and reports each, its median
    without the first ``skip_steps`` as ``summarize`` will take it."""
    results: dict[Block, list[float]] = {}
    for index, block in enumerate(schedule):
        steps = list(run_block(block))
        results[block] = steps
        kept = steps[skip_steps:]
        median = statistics.median(kept) if kept else float("nan")
        progress(f"block {index + 1}/{len(schedule)}: round {block.round} {block.arm}: "
                 f"{len(steps)} steps, median {median * 1e3:.2f} ms")
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
    def of(cls, kernels: Sequence[tuple[float, float]], d2h: Sequence[tuple[float, float]],
           h2d: Sequence[tuple[float, float]], *, steps: int, scale: float = 1.0) -> "DeviceTime":
        """From device intervals (start, end) over ``steps`` steps, ``scale`` seconds per unit."""
        copies = [*d2h, *h2d]
        overlap = busy_seconds(kernels) + busy_seconds(copies) - busy_seconds([*kernels, *copies])
        per_step = scale / steps
        return cls(busy_seconds([*kernels, *copies]) * per_step, busy_seconds(d2h) * per_step,
                   busy_seconds(h2d) * per_step, overlap * per_step)


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
    def of(cls, events: Sequence[tuple[float, float, str, int, str]], *, steps: int,
           scale: float = 1e-6) -> "CopyStalls":
        """``events``: (start, end, kind, stream, name), kind kernel, d2h or h2d; ``scale`` seconds per unit."""
        by_kind = intervals_by_kind(events)
        kernels = busy_seconds(by_kind["kernel"])
        span = max(end for _, end, *_ in events) - min(start for start, *_ in events) if events else 0.0
        per_step = scale / steps
        return cls(span * per_step, kernels * per_step, busy_seconds(by_kind["d2h"]) * per_step,
                   busy_seconds(by_kind["h2d"]) * per_step,
                   (busy_seconds(by_kind["kernel"] + by_kind["d2h"]) - kernels) * per_step,
                   (busy_seconds(by_kind["kernel"] + by_kind["h2d"]) - kernels) * per_step)
