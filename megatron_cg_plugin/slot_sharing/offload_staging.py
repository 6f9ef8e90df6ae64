"""Activation offload between graph replays: a ring of GPU staging buffers shared by the layers.

In-graph copies (``slot_sharing.offload_arenas.OffloadingArenaHooks``) must be joined before the forward graph
ends, so a layer's D2H copies overlap only that layer's compute. Here the graphs copy nothing to the
host: a frame's offloaded saves go, inside its forward graph, into a staging buffer (as the kept
saves go into its arena), and the copies run between replays on a copy stream, one contiguous copy
per frame and direction, overlapping the next layers' compute:

- after a forward replay, the frame's staging region goes to its pinned host region;
- before a forward replay writes a staging buffer, the compute stream waits for the buffer's last
  copy (the previous frame's data is on the host by then);
- before a backward replay, the frame's data must be in its buffer: still there from its forward
  (no other frame wrote the buffer since), prefetched, or copied back now;
- after a backward replay the buffer is free: the frame waiting for backward that uses it and comes
  next (the latest forwarded, the order backward runs in) is copied back at once, overlapping the
  backward of the layers between.

The layers take buffers round-robin (``depth`` buffers, 2 by default: one being copied while the
next is written): each ``advance`` moves to the next buffer, and the frames claimed until the next
``advance`` (the mutually exclusive variants of one layer, such as its graph banks) share it. A
frame larger than its buffer gets a buffer of its own. Copies go through a
``_CopyEngine``: ``_CudaCopies`` (a copy stream and events) on the GPU; the unit tests' CPU double
(plain copies and a log) lives under tests/unit/_doubles.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from megatron_cg_plugin.slot_sharing.offload_arenas import HostArena
from megatron_cg_plugin.slot_sharing.saved_tensors import Arena

__all__ = ["StagedFrame", "StagingRing"]

logger = logging.getLogger(__name__)


class _CopyEngine(Protocol):
    def compute_point(self) -> Any: ...  # a token for everything the compute stream has queued

    def copy(self, destination: torch.Tensor, source: torch.Tensor, after: Any, kind: str) -> Any: ...  # -> its token

    def compute_waits(self, token: Any) -> None: ...

    def drain(self) -> None: ...  # the compute stream waits for every copy issued


class _CudaCopies:
    """Copies on one copy stream (FIFO: a reload never overtakes the offload of the same data)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def compute_point(self) -> Any:
        event = torch.cuda.Event()
        event.record()
        return event

    def copy(self, destination: torch.Tensor, source: torch.Tensor, after: Any, kind: str) -> Any:
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            destination.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return event

    def compute_waits(self, token: Any) -> None:
        if token is not None:
            torch.cuda.current_stream().wait_event(token)

    def drain(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


class _StagingBuffer:
    """One GPU staging buffer: the frame whose data it holds (``resident``), the token after which
    it holds it (a reload in flight), and its last copy (what a writer must wait for)."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.resident: StagedFrame | None = None
        self.ready: Any = None
        self.last_copy: Any = None


class StagingRing:
    """The staging buffers and copy engine shared by every frame of a capture (all layers)."""

    def __init__(self, device: torch.device | str | int, *, depth: int = 2, copies: _CopyEngine | None = None) -> None:
        if depth < 1:
            raise ValueError(f"staging ring depth {depth}: use 1 or more buffers.")
        self.device, self.depth = torch.device(device), depth
        self.copies = copies if copies is not None else _CudaCopies()
        self.buffers: dict[int, _StagingBuffer] = {}  # ring position -> its buffer, made at its first claim
        self._position = -1
        self._own: list[_StagingBuffer] = []  # buffers of frames larger than their ring buffer
        self.waiting: list[StagedFrame] = []  # forwarded frames whose backward has not run, in forward order
        self.reloads = 0  # copies back to the GPU issued before a backward needed them, or at it
        self.reloads_on_demand = 0  # of them, issued at the backward (no prefetch possible)

    @property
    def nbytes(self) -> int:
        return sum(buffer.arena.capacity for buffer in [*self.buffers.values(), *self._own])

    def advance(self) -> None:
        """The next layer: its frames take the next buffer of the ring."""
        self._position = (self._position + 1) % self.depth

    def frame(self, nbytes: int, host: HostArena, name: str) -> StagedFrame:
        """A frame of ``nbytes`` offloaded bytes in the current layer's buffer (allocated at the
        first claim, sized by it; a larger frame gets a buffer of its own)."""
        index = max(self._position, 0)
        if index not in self.buffers:  # a position whose layers offloaded nothing so far has none yet
            self.buffers[index] = _StagingBuffer(Arena(nbytes, self.device, name=f"staging buffer {index}"))
        buffer = self.buffers[index]
        if buffer.arena.capacity < nbytes:  # a larger layer than the ring was sized by: no sharing
            logger.warning(
                "staging: %s offloads %d bytes, more than the %d of its ring buffer; it gets a buffer of "
                "its own (GPU memory the ring does not share)",
                name,
                nbytes,
                buffer.arena.capacity,
            )
            buffer = _StagingBuffer(Arena(nbytes, self.device, name=f"staging buffer of {name}"))
            self._own.append(buffer)
        return StagedFrame(self, buffer, host, nbytes, name)

    def release(self) -> None:
        """The graphs go (reset, or a failed capture): copies in flight finish before the buffers
        may be reused, and no frame stays waiting or resident (they refer back to the ring)."""
        self.copies.drain()
        self.waiting.clear()
        for buffer in [*self.buffers.values(), *self._own]:
            buffer.resident = buffer.ready = buffer.last_copy = None


class StagedFrame:
    """One graphed frame's offloaded bytes: a region of its staging buffer and of its pinned host
    arena. The graphs' replays call the four hooks around themselves."""

    def __init__(self, ring: StagingRing, buffer: _StagingBuffer, host: HostArena, nbytes: int, name: str) -> None:
        self.ring, self.buffer, self.host, self.nbytes, self.name = ring, buffer, host, nbytes, name

    @property
    def staging(self) -> Arena:
        return self.buffer.arena

    def _device_region(self) -> torch.Tensor:
        return self.buffer.arena.buffer[: self.nbytes]

    def _host_region(self) -> torch.Tensor:
        return self.host.buffer[: self.nbytes]

    def before_forward(self) -> None:
        copies = self.ring.copies
        copies.compute_waits(self.buffer.last_copy)  # the buffer's previous data is on the host
        if self in self.ring.waiting:  # a forward again before its backward (a failed step): start over
            self.ring.waiting.remove(self)

    def after_forward(self) -> None:
        copies, buffer = self.ring.copies, self.buffer
        if not self.nbytes:
            return
        buffer.last_copy = copies.copy(self._host_region(), self._device_region(), copies.compute_point(), "offload")
        buffer.resident, buffer.ready = self, None  # the compute stream wrote it: ready in stream order
        self.ring.waiting.append(self)

    def before_backward(self) -> None:
        copies, buffer = self.ring.copies, self.buffer
        if buffer.resident is not self:  # another frame's forward or reload took the buffer since
            self._reload()
            self.ring.reloads_on_demand += 1
        copies.compute_waits(buffer.ready)

    def after_backward(self) -> None:
        ring, buffer = self.ring, self.buffer
        if self in ring.waiting:
            ring.waiting.remove(self)
        buffer.resident = buffer.ready = None
        following = next((frame for frame in reversed(ring.waiting) if frame.buffer is buffer), None)
        if following is not None:  # its backward comes before any other user of the buffer's
            following._reload()

    def _reload(self) -> None:
        copies, buffer = self.ring.copies, self.buffer
        buffer.ready = buffer.last_copy = copies.copy(
            self._device_region(), self._host_region(), copies.compute_point(), f"reload {self.name}"
        )
        buffer.resident = self
        self.ring.reloads += 1
