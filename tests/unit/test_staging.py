"""Offload between replays (memory/staging.py, memory/offload.StagedArenaHooks) on CPU: the saves a
plan offloads go to the frame's staging buffer and come back for backward; the ring hands each
frame's data back to its buffer before its backward (kept, prefetched, or reloaded on demand) in
Megatron's orders, and a frame larger than the ring's buffers gets its own."""

from __future__ import annotations

import pytest
import torch

from megatron_cg_plugin.memory.offload import HostArena, StagedArenaHooks
from megatron_cg_plugin.memory.saved_tensors import Arena, ArenaSizer
from megatron_cg_plugin.memory.staging import InlineCopies, StagingRing
from megatron_cg_plugin.plan.offload import OffloadPolicy, plan_offload
from megatron_cg_plugin.plan.slots import arena_aligned

GROUP = [None]


def layer(x, w):
    GROUP[0] = "core_attn"
    a = torch.sigmoid(x * w)  # sigmoid saves a (offloaded); mul saves x and w
    t = a.t()
    b = (t @ a).tanh()  # matmul saves t and a (one storage, two views), tanh saves b
    GROUP[0] = None
    return (b.exp() * 2).sum()  # exp saves its output: kept


def run(hooks=None):
    x = torch.arange(16.0).reshape(4, 4).div(10).requires_grad_()
    w = torch.full((4, 4), 0.5, requires_grad=True)
    with hooks.hooks() if hooks else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = layer(x, w)
    return loss, x, w


def test_offloaded_saves_go_to_the_staging_buffer_and_backward_equals_eager():
    loss, x, w = run()
    loss.backward()
    eager = (x.grad, w.grad)
    sizer = ArenaSizer(device="cpu", group=lambda: GROUP[0])
    run(sizer)
    plan = plan_offload(sizer.saves, OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=0))
    assert plan.offloaded and plan.kept
    arena, staging = Arena(sizer.nbytes - plan.host_bytes, "cpu"), Arena(plan.host_bytes, "cpu")
    for clobber in (False, True):
        hooks = StagedArenaHooks(arena, staging, plan)
        loss, x, w = run(hooks)
        assert staging.used == plan.host_bytes and arena.used == plan.device_bytes  # each storage where the plan says
        assert hooks.offloaded_bytes > 0
        if clobber:  # the backward reads the staging buffer: overwritten, the gradients change
            staging.buffer.fill_(7)
        loss.backward()
        same = torch.equal(x.grad, eager[0]) and torch.equal(w.grad, eager[1])
        assert same is not clobber


def staged_frames(ring, sizes):
    return [ring.frame(n, HostArena(n, pin=False), f"layer {i}") for i, n in enumerate(sizes) if ring.advance() or True]


def forward(frame, value):
    frame.before_forward()
    frame.buffer.arena.buffer[:frame.nbytes].fill_(value)  # what the forward graph writes
    frame.after_forward()


def backward(frame, value):
    frame.before_backward()
    assert torch.all(frame.buffer.arena.buffer[:frame.nbytes] == value), f"{frame.name} reads another frame's saves"
    frame.after_backward()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_megatron_pp1_order_brings_every_frame_back_and_prefetches_all_but_what_is_still_there(depth):
    copies = InlineCopies()
    ring = StagingRing("cpu", depth=depth, copies=copies)
    frames = staged_frames(ring, [64] * 6)
    assert len(ring.buffers) == depth and ring.nbytes == depth * arena_aligned(64)
    for microbatch in range(2):
        for i, frame in enumerate(frames):
            forward(frame, 10 * microbatch + i)
        for i, frame in reversed(list(enumerate(frames))):
            backward(frame, 10 * microbatch + i)
    # The last `depth` forwards are still in their buffers; every other frame was prefetched.
    assert ring.reloads == 2 * (6 - depth) and ring.reloads_on_demand == 0 and not ring.waiting
    assert [kind for kind, _ in copies.log].count("offload") == 12


def test_a_frame_whose_buffer_was_taken_is_reloaded_at_its_backward():
    ring = StagingRing("cpu", depth=1, copies=InlineCopies())
    first, second = staged_frames(ring, [64, 64])
    forward(first, 1)
    forward(second, 2)  # one buffer: the first frame's saves are only on the host now
    backward(first, 1)  # not the LIFO order: brought back on demand
    backward(second, 2)
    assert ring.reloads_on_demand >= 1


def test_a_frame_larger_than_its_ring_buffer_gets_a_buffer_of_its_own():
    ring = StagingRing("cpu", depth=2, copies=InlineCopies())
    small, other, large = staged_frames(ring, [64, 64, 4096])
    assert large.buffer is not small.buffer and large.staging.capacity >= 4096 and len(ring.buffers) == 2
    assert ring.nbytes == 2 * arena_aligned(64) + arena_aligned(4096)


def test_frames_of_one_capture_call_share_its_position_in_the_ring():
    ring = StagingRing("cpu", depth=2, copies=InlineCopies())
    ring.advance()
    cp1, cp2 = (ring.frame(n, HostArena(n, pin=False), name) for n, name in ((128, "cp1"), (64, "cp2")))
    ring.advance()
    next_layer = ring.frame(128, HostArena(128, pin=False), "next layer")
    assert cp1.buffer is cp2.buffer and next_layer.buffer is not cp1.buffer


def test_a_ring_without_buffers_is_refused():
    with pytest.raises(ValueError, match="use 1 or more"):
        StagingRing("cpu", depth=0, copies=InlineCopies())
