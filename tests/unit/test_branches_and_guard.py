"""Capture-time branch checks and the slot debug guard (slot-shared capture's building blocks)."""

from __future__ import annotations

import pytest
import torch
from _doubles.schedules import planned
from hypothesis import given, settings

from megatron_cg_plugin.capture.contracts import alias_topology
from megatron_cg_plugin.slot_sharing.branches import BranchMismatchError, BranchSignature, check_branches
from megatron_cg_plugin.slot_sharing.guard import SlotGuard, SlotReuseError
from megatron_cg_plugin.slot_sharing.plan import plan_slots


def signature(outputs, grads=(), **kwargs):
    return BranchSignature.of(outputs, grads, **kwargs)


def test_identical_layouts_pass():
    a = signature([torch.zeros(4, 8)], [torch.zeros(4, 8)], arenas=(0, 1))
    b = signature([torch.ones(4, 8)], [torch.ones(4, 8)], arenas=(0, 1))
    check_branches(3, {"cp1": a, "cp2": b})


@pytest.mark.parametrize(
    "other, field",
    [
        (lambda: [torch.zeros(4, 9)], "outputs[0].shape"),
        (lambda: [torch.zeros(8, 4).t()], "outputs[0].stride"),
        (lambda: [torch.zeros(4, 8, dtype=torch.bfloat16)], "outputs[0].dtype"),
        (lambda: [torch.zeros(4, 8, requires_grad=True)], "outputs[0].requires_grad"),
        (lambda: [torch.zeros(64)[:32].view(4, 8)], "outputs[0] bytes"),
        (lambda: [torch.zeros(4, 8), torch.zeros(1)], "number of outputs"),
    ],
)
def test_each_output_difference_is_refused_naming_the_field(other, field):
    with pytest.raises(
        BranchMismatchError, match=f"slot 2: branches 'a' and 'b'.*{field.replace('[', '.').replace(']', '.')}"
    ):
        check_branches(2, {"a": signature([torch.zeros(4, 8)]), "b": signature(other())})


def test_gradient_differences_are_refused():
    with pytest.raises(BranchMismatchError, match=r"grads\[0\]\.shape"):
        check_branches(
            0, {"a": signature([torch.zeros(2)], [torch.zeros(2)]), "b": signature([torch.zeros(2)], [torch.zeros(3)])}
        )


def test_alias_topology_and_module_state_views():
    base = torch.zeros(8)
    shared = signature([base[:4], base[4:]])  # two outputs viewing one storage
    separate = signature([torch.zeros(8)[:4], torch.zeros(8)[4:]])  # same layouts, two storages
    with pytest.raises(BranchMismatchError, match="alias topology"):
        check_branches(1, {"a": shared, "b": separate})
    weight = torch.zeros(4)
    assert alias_topology([weight, torch.zeros(4)], {"weight": weight}) == (("state", "weight"), 1)


def test_different_arenas_are_refused():
    with pytest.raises(BranchMismatchError, match="arenas"):
        check_branches(
            0, {"a": signature([torch.zeros(2)], arenas=(0,)), "b": signature([torch.zeros(2)], arenas=(1,))}
        )


def replay(plan, guard):
    """Host-side replay of a plan in its own order: acquire at each forward, release at backward."""
    events = sorted(
        [(f.forward_at, "fwd", f) for f in plan.frames] + [(f.backward_at, "bwd", f) for f in plan.frames],
        key=lambda e: e[0],
    )
    for _, kind, frame in events:
        label = f"chunk {frame.chunk} microbatch {frame.microbatch} ({frame.variant})"
        (guard.acquire if kind == "fwd" else guard.release)(frame.slot, label)


@settings(max_examples=200, deadline=None)
@given(planned())
def test_a_plan_replayed_in_its_own_order_never_trips_the_guard(case):
    order, variants, sizes = case
    plan = plan_slots(order, variants, sizes)
    guard = SlotGuard(plan.ring_size)
    replay(plan, guard)
    assert guard.live == {}


def test_a_plan_replayed_in_another_order_names_both_frames():
    plan = plan_slots([1, -1, 1, -1], ["A", "B"])  # one slot: A then B
    guard = SlotGuard(plan.ring_size)
    a, b = plan.frames
    guard.acquire(a.slot, "A microbatch 0")
    with pytest.raises(SlotReuseError, match=r"slot 0 is still owned by A microbatch 0 .* B microbatch 1"):
        guard.acquire(b.slot, "B microbatch 1")  # interleaved: A.fwd, B.fwd before A.bwd


def test_release_by_the_wrong_frame_is_refused():
    guard = SlotGuard(1)
    guard.acquire(0, "A")
    with pytest.raises(SlotReuseError, match="backward of B"):
        guard.release(0, "B")
