"""The slot planner: exhaustive examples and properties over Megatron's own PP/VPP orders and over
random interleavings of variants."""

from __future__ import annotations

import pytest
from _doubles.schedules import megatron_order, megatron_orders, planned, schedules, warmup_of
from hypothesis import given, settings

from megatron_cg_plugin.slot_sharing.plan import OrderError, SlotPlan, plan_slots


def most_frames_live(plan: SlotPlan) -> int:
    """The most frames alive at one position of the order."""
    events = sorted([(f.forward_at, 1) for f in plan.frames] + [(f.backward_at + 1, -1) for f in plan.frames])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def check_invariants(plan: SlotPlan, sizes) -> None:
    frames = plan.frames
    for i, a in enumerate(frames):
        assert a.forward_at < a.backward_at
        for b in frames[i + 1 :]:
            if a.overlaps(b):
                assert a.slot != b.slot, f"live together but share slot {a.slot}: {a} {b}"
    assert plan.ring_size == most_frames_live(plan)  # optimal: never more slots than frames alive at once
    assert {f.slot for f in frames} == set(range(plan.ring_size))
    for slot in range(plan.ring_size):
        assert plan.slot_sizes[slot] == max(sizes.get((f.chunk, f.variant), 0) for f in frames if f.slot == slot)
    largest = max(plan.slot_sizes, default=0)
    assert sum(plan.slot_sizes) <= plan.ring_size * largest


@settings(max_examples=300, deadline=None)
@given(planned())
def test_properties_over_random_schedules(case):
    order, variants, sizes = case
    plan = plan_slots(order, variants, sizes)
    check_invariants(plan, sizes)
    assert plan_slots(order, variants, sizes) == plan  # deterministic


@settings(max_examples=200, deadline=None)
@given(megatron_orders())
def test_backwards_are_fifo_per_chunk(order):
    plan = plan_slots(order)
    for chunk in {f.chunk for f in plan.frames}:
        own = [f for f in plan.frames if f.chunk == chunk]
        assert [f.microbatch for f in sorted(own, key=lambda f: f.backward_at)] == list(range(len(own)))


def test_every_small_megatron_schedule():
    """Exhaustive over small PP/VPP shapes: every rank, microbatch count and group size."""
    count = 0
    for microbatches, chunks, group, pp, rank in schedules():
        warmup = warmup_of(microbatches, chunks, group, pp, rank)
        plan = plan_slots(megatron_order(microbatches, chunks, group, warmup))
        check_invariants(plan, {})
        # Without VPP, 1F1B keeps warmup + 1 microbatches in flight (all of them if fewer).
        if chunks == 1:
            assert plan.ring_size == min(warmup + 1, microbatches)
        count += 1
    assert count > 500


def test_an_impossible_megatron_order_is_rejected():
    # VPP with no warmup would run chunk 2's backward before its forward.
    with pytest.raises(OrderError, match="backward of chunk 2 at position 1"):
        plan_slots(megatron_order(2, 2, 1, 0))


def test_one_size_everywhere_costs_ring_times_size():
    order = megatron_order(4, 2, 2, warmup_of(4, 2, 2, 2, 0))
    forwards = sum(1 for e in order if e > 0)
    plan = plan_slots(order, ["A"] * forwards, {(1, "A"): 7, (2, "A"): 7})
    assert plan.slot_sizes == (7,) * plan.ring_size


def test_mutually_exclusive_variants_share_a_slot_sized_by_the_largest():
    # One microbatch at a time (PP=1): A, then B, then C reuse the single slot.
    plan = plan_slots([1, -1, 1, -1, 1, -1], ["A", "B", "C"], {(1, "A"): 10, (1, "B"): 30, (1, "C"): 20})
    assert plan.ring_size == 1 and plan.slot_sizes == (30,)
    assert plan.branches(0) == frozenset("ABC")


def test_best_fit_keeps_big_slots_for_big_frames():
    # A (big) and B (small) overlap, then again, in the opposite start order: a size-blind choice
    # would put the second A in B's slot and grow it, paying for two big slots.
    order = [1, 2, -1, -2, 2, 1, -2, -1]
    plan = plan_slots(order, ["A", "B", "B", "A"], {(1, "A"): 100, (2, "B"): 10})
    assert plan.ring_size == 2
    assert sorted(plan.slot_sizes) == [10, 100]


def test_interleaved_replays_never_share():
    # A.fwd, B.fwd, A.bwd, B.bwd: both alive together -> two slots.
    plan = plan_slots([1, 1, -1, -1], ["A", "B"])
    assert plan.ring_size == 2 and plan.frames[0].slot != plan.frames[1].slot


@pytest.mark.parametrize(
    "order, message",
    [
        ([1, -1.5, -1], "delay-wgrad"),
        ([1, 0, -1], "entries are \\+chunk"),
        ([-1, 1], "no pending forward"),
        ([1, 1, -1], "forwards without a backward: chunk 1 microbatch 1"),
    ],
)
def test_bad_orders_are_rejected_with_the_reason(order, message):
    with pytest.raises(OrderError, match=message):
        plan_slots(order)


def test_variants_must_match_the_forwards():
    with pytest.raises(OrderError, match="2 variants given for 1 forwards"):
        plan_slots([1, -1], ["A", "B"])
