"""Activation offload inside slot-shared graphs: the saved-tensor hook that keeps most of a frame's
saves in its GPU arena and moves those the offload plan selects (``slot_sharing.offload_plan``) to the slot's
pinned host arena, and back for backward.

Forward: a selected storage is first copied, on the compute stream, into a staging buffer (a later
in-place write of the same forward cannot race the device-to-host copy then: ``record_stream``
protects a block's lifetime, not its values), and the staging buffer goes to the host arena on the
D2H stream. When a group starts staging, the compute stream waits for the copies of all but the
last ``window`` groups before it and lets their staging buffers go, so at most ``window + 1``
groups' staging buffers are alive; ``join_forward`` waits for every copy before the forward graph
ends. An offloaded storage takes no GPU arena space.

Backward: at its start (``start_backward``) the backward reloads the first ``window + 1`` groups it
will need into fresh device buffers on the H2D stream. The first unpack of a save of group ``g``
waits for ``g``'s reload (issuing it if it is not under way) and starts the reloads of the
``window`` groups after ``g`` (``OffloadPlan.reload_window``), which overlap ``g``'s backward.
Views of one storage come back as views of one reloaded buffer (the plan offloads a storage only if
every view of it qualifies). ``join_backward`` joins whatever was reloaded but never unpacked.

The copies go through ``Transfers``: ``CudaTransfers`` on the GPU (side streams, captured with the
graphs). Test doubles live with the tests: the unit tests' CPU double (plain copies, a log of what
was asked) under tests/unit/_doubles, and the GPU probe's serial reference (the same copies on the
compute stream) in tests/functional/_probes/slots_probe.py.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPlan
from megatron_cg_plugin.slot_sharing.plan import arena_aligned
from megatron_cg_plugin.slot_sharing.saved_tensors import Arena, ArenaHooks, saved_view, storage_key

__all__ = [
    "CudaTransfers",
    "HostArena",
    "HostArenaError",
    "OffloadPlanError",
    "OffloadingArenaHooks",
    "StagedArenaHooks",
    "Transfers",
    "torch",
]


class HostArenaError(RuntimeError):
    """Pinned host memory for the offload arenas could not be had."""


class OffloadPlanError(RuntimeError):
    """A frame under capture saves differently from its warmup, so the offload plan no longer fits."""


class HostArena:
    """One slot's pinned host arena, allocated before capture and filled front to back per frame."""

    def __init__(self, capacity: int, name: str = "host arena", *, pin: bool = True) -> None:
        self.name = name
        try:
            self.buffer = torch.empty(arena_aligned(capacity), dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as error:  # cudaHostAlloc failed: too much pinned memory asked
            raise HostArenaError(
                f"{name}: could not pin {arena_aligned(capacity)} bytes of host memory for offloaded activations "
                f"({error}); offload fewer modules (--offload-modules), raise --min-offloaded-tensor-size, or "
                "free host memory (other pinned buffers, dataloader workers)."
            ) from None
        self.used = 0

    def reserve(self, nbytes: int) -> int:
        offset = self.used
        if offset + nbytes > self.buffer.numel():
            raise HostArenaError(
                f"{self.name} needs {offset + nbytes} bytes but holds {self.buffer.numel()}: the "
                "frame offloads more than at warmup (shapes changed since the arenas were sized?)."
            )
        self.used = offset + arena_aligned(nbytes)
        return offset


class Transfers(Protocol):
    def reset(self) -> None: ...

    def stage(self, source: torch.Tensor) -> torch.Tensor: ...

    def to_host(self, host: torch.Tensor, staged: torch.Tensor) -> None: ...

    def join_forward(self, keep: int = 0) -> None: ...  # all but the last ``keep`` groups' copies

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def wait(self, buffer: torch.Tensor) -> None: ...

    def join_backward(self) -> None: ...


class CudaTransfers:
    """D2H and H2D copies on their own streams, forked from and joined to the current stream."""

    def __init__(self) -> None:
        self.d2h, self.h2d = torch.cuda.Stream(), torch.cuda.Stream()
        self.reset()

    def reset(self) -> None:
        """A new frame (also after a capture that failed half-way)."""
        self._staged: list[torch.Tensor] = []  # the group being copied
        self._in_flight: collections.deque[tuple[Any, list[torch.Tensor]]] = collections.deque()  # its predecessors
        self._loaded: dict[int, Any] = {}  # id(buffer) -> the H2D event that fills it
        self._d2h_forked = self._h2d_forked = False

    def stage(self, source: torch.Tensor) -> torch.Tensor:
        return source.clone()  # on the compute stream, in order with the forward's later writes

    def to_host(self, host: torch.Tensor, staged: torch.Tensor) -> None:
        self.d2h.wait_stream(torch.cuda.current_stream())
        self._d2h_forked = True
        with torch.cuda.stream(self.d2h):
            host.copy_(staged, non_blocking=True)
        self._staged.append(staged)

    def join_forward(self, keep: int = 0) -> None:
        if self._staged:  # the group being copied ends: an event after its copies (the D2H stream is FIFO)
            with torch.cuda.stream(self.d2h):
                event = torch.cuda.Event()
                event.record()
            self._in_flight.append((event, self._staged))
            self._staged = []
        if not keep:  # the forward's end: everything the D2H stream was given, also a copy that raised
            if self._d2h_forked:  # only a stream the capture forked may be joined into it
                torch.cuda.current_stream().wait_stream(self.d2h)
            self._in_flight.clear()  # the staging buffers go, on the compute stream, which follows the copies
            self._d2h_forked = False
            return
        while len(self._in_flight) > keep:
            event, _ = self._in_flight.popleft()
            torch.cuda.current_stream().wait_event(event)  # its staging buffers are let go here, on the
            # compute stream, which now follows their copies

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        self.h2d.wait_stream(torch.cuda.current_stream())  # the buffer's block is free for the copy
        self._h2d_forked = True
        with torch.cuda.stream(self.h2d):
            buffer.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._loaded[id(buffer)] = event
        return buffer

    def wait(self, buffer: torch.Tensor) -> None:
        event = self._loaded.pop(id(buffer), None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def join_backward(self) -> None:
        if self._h2d_forked:
            torch.cuda.current_stream().wait_stream(self.h2d)
        self._loaded.clear()
        self._h2d_forked = False


@dataclasses.dataclass(frozen=True)
class _Offloaded:
    """A saved tensor whose storage went to the host arena."""

    storage: int  # the storage's ordinal in the frame (as in the plan)
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int | torch.SymInt  # Tensor.storage_offset's type
    version: int


class _PlannedArenaHooks(ArenaHooks):
    """``ArenaHooks`` for one frame that follows an offload ``plan``: storages are numbered as
    ``ArenaSizer`` numbered them at warmup; the kept ones go to the GPU arena, the offloaded ones to
    ``_offload`` (subclasses: in-graph copies to the host, or a staging buffer)."""

    def __init__(self, arena: Arena, plan: OffloadPlan) -> None:
        super().__init__(arena)
        self.plan = plan
        self._group_of = {storage: group for group, storages in plan.groups for storage in storages}
        self._ordinal: dict[tuple[Any, int], int] = {}  # storage key -> ordinal, as ArenaSizer numbered them
        self._storages_seen = 0
        self._unpacks_left: dict[int, int] = {}  # ordinal -> saves of it not unpacked yet
        self.offloaded_bytes = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        if self.kept_as_is(tensor) or hasattr(tensor, "prepare_for_saving"):
            return super().pack(tensor)  # a decomposed tensor's parts come back through here
        key = storage_key(tensor)
        known = self._storages.get(key)
        new = known is None or known[1].expired()
        if new:  # a new storage (maybe at a reused address): the next ordinal
            self._ordinal[key] = self._storages_seen
            self._storages_seen += 1
        ordinal = self._ordinal[key]
        if ordinal not in self._group_of:
            return super().pack(tensor)
        if new:
            self._check_bytes(ordinal, tensor.untyped_storage().nbytes())
            self._storages[key] = (self._offload(ordinal, tensor), StorageWeakRef(tensor.untyped_storage()))
            self.offloaded_bytes += tensor.untyped_storage().nbytes()
        self._unpacks_left[ordinal] = self._unpacks_left.get(ordinal, 0) + 1
        return _Offloaded(
            ordinal, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor._version
        )

    def _offload(self, ordinal: int, tensor: torch.Tensor) -> int:
        raise NotImplementedError

    def _check_bytes(self, ordinal: int, nbytes: int) -> None:
        if nbytes != self.plan.storage_bytes[ordinal]:
            raise OffloadPlanError(
                f"storage {ordinal} of the frame holds {nbytes} bytes under capture "
                f"but {self.plan.storage_bytes[ordinal]} "
                "at warmup: the forward saves differently under capture (a branch on torch.cuda.is_current_stream_"
                "capturing(), shapes that changed?), so its offload plan does not fit; keep the forward the same or "
                "capture without offload."
            )

    def _protected(self, tensor: torch.Tensor) -> torch.Tensor:
        packed = self.pack(tensor)
        if isinstance(packed, _Offloaded):
            raise OffloadPlanError(
                f"a tensor kept on an autograd ctx ({tuple(tensor.shape)} {tensor.dtype}, on a storage of "
                f"{tensor.untyped_storage().nbytes()} bytes) shares storage {packed.storage} with an offloaded save "
                f"({self.plan.storage_bytes[packed.storage]} bytes at warmup, group {self._group_of[packed.storage]}): "
                "ctx tensors stay in the GPU arena, and so must every view of their storage; the warmup recorded it "
                "otherwise (an offload group name that outlives the forward?)."
            )
        return self.unpack(packed)


class StagedArenaHooks(_PlannedArenaHooks):
    """Offload between replays (``slot_sharing.offload_staging``): the offloaded storages go, inside the forward
    graph, to ``staging`` (the frame's staging buffer), on the compute stream like the arena copies;
    backward reads them there once the ring has brought them back."""

    def __init__(self, arena: Arena, staging: Arena, plan: OffloadPlan) -> None:
        super().__init__(arena, plan)
        self.staging = staging
        staging.reset()
        self._staged_at: dict[int, int] = {}  # ordinal -> byte offset in the staging buffer

    def _offload(self, ordinal: int, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        offset = self.staging.reserve(storage.nbytes())
        source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        self.staging.buffer[offset : offset + storage.nbytes()].copy_(source)
        self._staged_at[ordinal] = offset
        return offset

    def unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Offloaded):
            return super().unpack(packed)
        element = torch.empty(0, dtype=packed.dtype).element_size()
        return saved_view(self.staging.buffer, self._staged_at[packed.storage] // element, packed)


class OffloadingArenaHooks(_PlannedArenaHooks):
    """In-graph offload: the frame's offloaded storages go to ``host`` through ``transfers``
    inside the forward graph, and come back inside the backward graph (module docstring)."""

    def __init__(
        self, arena: Arena, host: HostArena, plan: OffloadPlan, transfers: Transfers, *, window: int = 1
    ) -> None:
        super().__init__(arena, plan)
        assert window >= 0, window  # SlotOffload refuses a negative window
        self.window = window  # groups whose copies may run beside the one being staged or unpacked
        host.used = 0  # a new frame: the previous frame's backward has run (the slot plan guarantees it)
        self.host, self.transfers = host, transfers
        self._host_span: dict[Hashable, tuple[int, int]] = {}  # ordinal -> (host offset, bytes)
        self._reloaded: dict[Hashable, torch.Tensor] = {}  # ordinal -> device buffer, in backward
        self._requested: set[str] = set()
        self._staging_group: str | None = None
        transfers.reset()

    def _offload(self, ordinal: int, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        group = self._group_of[ordinal]
        if group != self._staging_group:  # a new group: the copies of all but the last ``window`` groups are done
            self.transfers.join_forward(keep=self.window)
            self._staging_group = group
        offset = self.host.reserve(nbytes)
        span = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        self.transfers.to_host(self.host.buffer[offset : offset + nbytes], self.transfers.stage(span))
        self._host_span[ordinal] = (offset, nbytes)
        return offset

    def join_forward(self) -> None:
        self.transfers.join_forward()
        self._staging_group = None

    def start_backward(self) -> None:
        """The backward graph begins: the first groups it needs start reloading before any of its
        compute, which they overlap."""
        for group in self.plan.reload_window(None, self.window):
            self._request(group)

    def unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Offloaded):
            return super().unpack(packed)
        group = self._group_of[packed.storage]
        window = self.plan.reload_window(group, self.window)
        self._request(group)
        buffer = self._reloaded[packed.storage]
        self.transfers.wait(buffer)
        self._unpacks_left[packed.storage] -= 1
        if not self._unpacks_left[packed.storage]:  # the last save of it: the tensors made below keep it alive
            del self._reloaded[packed.storage]
        for following in window[1:]:
            self._request(following)  # overlaps this group's backward
        return saved_view(buffer, 0, packed)  # the reloaded buffer holds just this storage

    def _request(self, group: str) -> None:
        if group in self._requested:
            return
        self._requested.add(group)
        for storage in dict(self.plan.groups)[group]:
            span = self._host_span.get(storage)
            if span is not None:  # a storage the plan names but this frame never saved is skipped
                offset, nbytes = span
                self._reloaded[storage] = self.transfers.to_device(
                    self.host.buffer[offset : offset + nbytes], self.arena.buffer.device
                )

    def join_backward(self) -> None:
        self.transfers.join_backward()
        self._reloaded.clear()
        self._requested.clear()
