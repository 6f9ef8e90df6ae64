"""Offload between replays (slot_sharing/offload_staging.py, slot_sharing/offload_arenas.StagedArenaHooks)
on CPU: the saves a plan offloads go to the frame's staging buffer and come back for backward; the ring
hands each frame's data back to its buffer before its backward (kept, prefetched, or reloaded on demand)
in Megatron's orders, and a frame larger than the ring's buffers gets its own."""

from __future__ import annotations

import pytest
import torch
from _doubles.copies import InlineCopies

from megatron_cg_plugin.slot_sharing.offload_arenas import HostArena, StagedArenaHooks
from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy, plan_offload
from megatron_cg_plugin.slot_sharing.offload_staging import StagingRing
from megatron_cg_plugin.slot_sharing.plan import arena_aligned
from megatron_cg_plugin.slot_sharing.saved_tensors import Arena, ArenaSizer

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
    frame.buffer.arena.buffer[: frame.nbytes].fill_(value)  # what the forward graph writes
    frame.after_forward()


def backward(frame, value):
    frame.before_backward()
    assert torch.all(frame.buffer.arena.buffer[: frame.nbytes] == value), f"{frame.name} reads another frame's saves"
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
    assert ring.reloads_on_demand == 1


def test_a_frame_larger_than_its_ring_buffer_gets_a_buffer_of_its_own():
    ring = StagingRing("cpu", depth=2, copies=InlineCopies())
    small, other, large = staged_frames(ring, [64, 64, 4096])
    assert large.buffer is not small.buffer and large.staging.capacity >= 4096 and len(ring.buffers) == 2
    assert other.buffer is ring.buffers[1]
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


class RecordingCopies:
    """Numbered tokens: every compute point, copy and wait, in order, to check the happens-before
    edges the ring must set (what InlineCopies cannot show: its copies are done at once)."""

    def __init__(self):
        self.events = []
        self.count = 0

    def _token(self, kind):
        self.count += 1
        self.events.append((kind, self.count))
        return self.count

    def compute_point(self):
        return self._token("point")

    def copy(self, destination, source, after, kind):
        destination.copy_(source)
        token = self._token(kind.split()[0])
        self.events.append(("after", after))
        return token

    def compute_waits(self, token):
        if token is not None:
            self.events.append(("wait", token))

    def drain(self):
        self.events.append(("drain", 0))


def test_the_compute_stream_waits_where_the_ring_needs_it_and_copies_follow_the_compute_they_read():
    copies = RecordingCopies()
    ring = StagingRing("cpu", depth=2, copies=copies)
    a, b, c = staged_frames(ring, [64] * 3)  # a and c share a buffer
    forward(a, 1)
    offload_a = copies.count
    assert copies.events[-3:] == [("point", offload_a - 1), ("offload", offload_a), ("after", offload_a - 1)]
    forward(b, 2)
    copies.events.clear()
    forward(c, 3)  # writes a's buffer: waits for a's offload first
    assert copies.events[0] == ("wait", offload_a)
    backward(c, 3)  # still resident: no wait, no reload; then a is prefetched into the freed buffer
    reload = [e for e in copies.events if e[0] == "reload"]
    assert len(reload) == 1 and ring.reloads_on_demand == 0
    copies.events.clear()
    backward(b, 2)
    backward(a, 1)  # waits for its prefetch
    assert ("wait", reload[0][1]) in copies.events
    ring.release()
    assert copies.events[-1] == ("drain", 0) and not ring.waiting
    assert all(buffer.resident is None and buffer.last_copy is None for buffer in ring.buffers.values())


def test_a_ring_position_whose_layer_offloads_nothing_leaves_the_others_their_buffers():
    ring = StagingRing("cpu", depth=2, copies=InlineCopies())
    ring.advance()  # a layer that offloads nothing claims no frame
    ring.advance()
    frame = ring.frame(64, HostArena(64, pin=False), "second layer")
    assert list(ring.buffers) == [1] and frame.buffer is ring.buffers[1]
