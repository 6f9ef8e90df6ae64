"""Schedules for planner tests: Megatron's own PP/VPP orders and random interleavings.

Used by the unit tests (imports hypothesis, a test extra); nothing in the package imports it.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st
from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order


def megatron_order(microbatches: int, chunks: int, group: int, warmup: int) -> list[int]:
    table = get_schedule_table(microbatches, chunks, group)
    return convert_schedule_table_to_order(warmup, chunks, table)


def warmup_of(microbatches: int, chunks: int, group: int, pp: int, rank: int) -> int:
    """Megatron's warmup count for a pipeline rank (get_pp_rank_microbatches, training)."""
    total = microbatches * chunks
    if chunks == 1:
        return min(pp - rank - 1, total)
    return min((pp - rank - 1) * 2 + (chunks - 1) * group, total)


def schedules(max_microbatches: int = 6):
    """Every (microbatches, chunks, group, pp, rank) Megatron can run, small sizes."""
    for chunks in range(1, 4):
        for pp in range(1 if chunks == 1 else 2, 5):
            for rank in range(pp):
                for microbatches in range(1, max_microbatches + 1):
                    for group in range(1, microbatches + 1):
                        yield microbatches, chunks, group, pp, rank


@st.composite
def megatron_orders(draw):
    chunks = draw(st.integers(1, 3))
    pp = draw(st.integers(1 if chunks == 1 else 2, 8))
    rank = draw(st.integers(0, pp - 1))
    microbatches = draw(st.integers(1, 12))
    group = draw(st.integers(1, microbatches))
    return megatron_order(microbatches, chunks, group, warmup_of(microbatches, chunks, group, pp, rank))


@st.composite
def random_orders(draw):
    """Any valid order: forwards and backwards of up to 3 chunks, FIFO per chunk, interleaved at random."""
    chunks = draw(st.integers(1, 3))
    per_chunk = draw(st.lists(st.integers(1, 6), min_size=chunks, max_size=chunks))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    started = [0] * chunks
    finished = [0] * chunks
    order = []
    while any(f < n for f, n in zip(finished, per_chunk)):
        choices = [c + 1 for c in range(chunks) if started[c] < per_chunk[c]]
        choices += [-(c + 1) for c in range(chunks) if finished[c] < started[c]]
        entry = rng.choice(choices)
        if entry > 0:
            started[entry - 1] += 1
        else:
            finished[-entry - 1] += 1
        order.append(entry)
    return order


@st.composite
def planned(draw, orders=None):
    order = draw(orders or st.one_of(megatron_orders(), random_orders()))
    forwards = sum(1 for e in order if e > 0)
    variants = draw(st.lists(st.sampled_from("ABCD"), min_size=forwards, max_size=forwards))
    chunks = {abs(e) for e in order}
    sizes = {(c, v): draw(st.integers(0, 10_000)) for c in chunks for v in "ABCD"}
    return order, variants, sizes
