"""In-process A/B measurement, the pure part (no torch): the interleaved block schedule and its
statistics.

On these machines the same command in two processes gave a 14 ms and then a 35 ms median step, so
arms are only compared inside one process, in blocks interleaved round by round: every round runs
each arm once, in an order that rotates from round to round (so no arm always follows the same
one), and drift that lasts longer than a round hits every arm alike. An arm's figure is the median
of its block medians, quoted with their spread; a ratio of two arms is taken per round (the two
blocks nearest in time) and quoted the same way.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Block:
    round: int
    arm: str


def interleaved_blocks(arms: Sequence[str], rounds: int) -> list[Block]:
    """``rounds`` rounds of every arm once; round ``r`` starts ``r`` places further in ``arms``."""
    if len(set(arms)) != len(arms) or not arms:
        raise ValueError(f"arms must be distinct and not empty, got {list(arms)}.")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    count = len(arms)
    return [Block(r, arms[(r + i) % count]) for r in range(rounds) for i in range(count)]


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
    """Per arm the median of its block medians; per pair of arms the per-round ratio of block
    medians. ``skip_steps`` drops each block's first steps (a block that captured graphs warms up)."""
    medians: dict[Block, float] = {}
    for block, steps in block_steps.items():
        kept = list(steps)[skip_steps:]
        if not kept:
            raise ValueError(f"block {block} has no step left after skipping {skip_steps}.")
        medians[block] = statistics.median(kept)
    arms = sorted({block.arm for block in medians})
    per_arm = {arm: Spread.of([medians[b] for b in sorted(medians, key=lambda b: b.round) if b.arm == arm])
               for arm in arms}
    rounds = sorted({block.round for block in medians})
    ratios = {}
    for a in arms:
        for b in arms:
            if a == b:
                continue
            paired = [medians[Block(r, a)] / medians[Block(r, b)] for r in rounds
                      if Block(r, a) in medians and Block(r, b) in medians]
            if paired:
                ratios[(a, b)] = Spread.of(paired)
    return BenchSummary(per_arm, ratios)


def run_schedule(schedule: Sequence[Block], run_block: Callable[[Block], Sequence[float]],
                 progress: Callable[[str], None] = lambda line: None) -> dict[Block, list[float]]:
    """Runs every block in order (``run_block`` returns its step times) and reports each."""
    results: dict[Block, list[float]] = {}
    for index, block in enumerate(schedule):
        steps = list(run_block(block))
        results[block] = steps
        median = statistics.median(steps) if steps else float("nan")
        progress(f"block {index + 1}/{len(schedule)}: round {block.round} {block.arm}: "
                 f"{len(steps)} steps, median {median * 1e3:.2f} ms")
    return results
