"""Saved-tensor arenas: what a frame saves for backward, copied into memory no other variant owns.

Graph variants that share one pool hand each other's freed blocks around; a backward that runs after
another variant's forward would read overwritten saved tensors. Inside a forward (eager, warmup or
capture) ``ArenaHooks`` packs every saved non-parameter tensor into the frame's arena: storages are
copied once each (aliases stay aliases: two views of one storage come back as two views of one
arena region, with their sizes, strides and offsets), version counters are carried over, and
tensors that decompose for saving (TE's quantized wrappers: ``prepare_for_saving`` /
``restore_from_saved``) are saved component by component and rebuilt. ``ArenaSizer`` measures, at
warmup, how many bytes a frame needs, which sizes the arenas of the slot plan.

Saved-tensor hooks only see ``save_for_backward``. Custom autograd Functions may also keep tensors as
``ctx`` attributes (directly, in lists/tuples/dicts, or in per-call dataclasses such as TE's
``FusedAttnBwdArgs``); ``protect_ctx_tensors`` packs those too, after the forward, and rebinds the
attributes to the arena copies. Objects shared beyond one call (modules, the quantizers they own)
are not entered: rebinding their tensors would change the model, not one frame. Per-call objects
that are no container (TE's quantizer copies) are entered where ``entering`` names them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_cg_plugin.capture.autograd_graph import reachable_nodes
from megatron_cg_plugin.slot_sharing.offload_plan import Save

# One alignment (slot_sharing.plan.ARENA_ALIGNMENT) for the planner's sizes and the arenas themselves.
from megatron_cg_plugin.slot_sharing.plan import arena_aligned as _aligned

__all__ = [
    "storage_key",
    "Arena",
    "ArenaHooks",
    "ArenaOverflowError",
    "ArenaSizer",
    "custom_function_nodes",
    "no_call_objects",
    "saved_view",
    "storage_keys",
]


class ArenaOverflowError(RuntimeError):
    def __init__(self, arena: str, needed: int, capacity: int) -> None:
        super().__init__(
            f"saved-tensor arena {arena} needs {needed} bytes but holds {capacity}: the frame saves more "
            "than at warmup (shapes changed since the arena was sized?). Re-measure with ArenaSizer at the "
            "shapes you replay, or keep shapes fixed as at capture."
        )


def storage_key(tensor: torch.Tensor) -> tuple[Any, int]:
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr()


def storage_keys(tensors: Iterable[torch.Tensor]) -> frozenset:
    """The storages of ``tensors``, as ``_Packer.sharing`` takes them."""
    return frozenset(storage_key(t) for t in tensors if t.untyped_storage().nbytes())


@dataclasses.dataclass(frozen=True)
class _Saved:
    """A saved tensor, as a view of an arena region."""

    offset: int  # where its storage's copy starts in the arena, bytes
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int | torch.SymInt  # elements (Tensor.storage_offset's type)
    version: int


@dataclasses.dataclass(frozen=True)
class _Decomposed:
    """A tensor saved through ``prepare_for_saving``: its components, and how to rebuild it."""

    parts: tuple[Any, ...]
    rebuild: Any


class Arena:
    """A flat byte buffer, allocated outside capture, filled front to back within a frame."""

    def __init__(self, capacity: int, device: torch.device | str, name: str = "arena") -> None:
        self.name = name
        self.buffer = torch.empty(_aligned(capacity), dtype=torch.uint8, device=device)
        self.used = 0

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def reset(self) -> None:
        """A new frame starts: the previous frame's backward has run (the slot plan guarantees it)."""
        self.used = 0

    def reserve(self, nbytes: int) -> int:
        offset = self.used
        if offset + nbytes > self.capacity:
            raise ArenaOverflowError(self.name, offset + nbytes, self.capacity)
        self.used = offset + _aligned(nbytes)
        return offset


class _Packer:
    """Shared pack/unpack logic: subclasses decide what happens to a storage the first time."""

    def __init__(self, device: torch.device | None) -> None:
        # storage address -> (arena offset, weak reference): a storage freed during the forward and
        # a new one allocated at the same address are different storages, told apart by expiry.
        self._storages: dict[tuple[Any, int], tuple[int, StorageWeakRef]] = {}
        self.device = device  # tensors elsewhere (host scalars) are kept as they are
        self._shared: frozenset = frozenset()
        self._call_objects: Callable[[Any], tuple[str, ...]] = no_call_objects

    def sharing(self, storages: frozenset) -> _Packer:
        """Saves on these storages (``storage_keys``) are kept as they are: every frame shares them
        and nothing a frame does rewrites them before its backward (FP8 weight workspaces)."""
        self._shared = storages
        return self

    def entering(self, call_objects: Callable[[Any], tuple[str, ...]]) -> _Packer:
        """Objects on ``ctx`` that belong to one call although they are no container: for each,
        ``call_objects(obj)`` names the tensor attributes to protect (TE's per-call quantizer copies,
        whose scale snapshot the backward reads), or ``()`` for objects shared beyond the call."""
        self._call_objects = call_objects
        return self

    def _place(self, tensor: torch.Tensor) -> int:
        raise NotImplementedError

    def _protected(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a ctx attribute holding ``tensor`` should hold instead."""
        raise NotImplementedError

    def protect_ctx_tensors(self, outputs: Sequence[torch.Tensor]) -> int:
        """Packs (and, for arenas, rebinds) the tensors custom Functions reachable from ``outputs``
        keep on ``ctx``; returns how many were found."""
        found = 0
        produced: set[int] = set()  # an object reached twice on ctx keeps what the first visit bound

        def replace(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal found
            found += 1
            if id(tensor) in produced:
                return tensor
            protected = self._protected(tensor)
            produced.add(id(protected))
            return protected

        for node in _custom_function_nodes(outputs):
            for name, value in list(vars(node).items()):
                new = _map_tensors(value, replace, self._call_objects)
                if new is not value:
                    setattr(node, name, new)
        return found

    def kept_as_is(self, tensor: torch.Tensor) -> bool:
        """Parameters and host tensors live outside any graph pool, an empty storage holds nothing
        (its address, 0, is every empty storage's), and shared storages belong to no one frame:
        nothing to protect or number."""
        if isinstance(tensor, torch.nn.Parameter) or (self.device is not None and tensor.device != self.device):
            return True
        if hasattr(tensor, "prepare_for_saving"):
            return False
        return tensor.untyped_storage().nbytes() == 0 or storage_key(tensor) in self._shared

    def pack(self, tensor: torch.Tensor) -> Any:
        if self.kept_as_is(tensor):
            return tensor
        if hasattr(tensor, "prepare_for_saving"):
            # TE's prepare_for_saving empties the object it is called on; the caller may go on using
            # the tensor (a module's cached FP8 weight workspace), so an alias sharing its parts is
            # emptied instead, and rebuilt from the packed parts at unpack.
            alias: Any = tensor.detach()  # a TE QuantizedTensor (torch's stubs know nothing of prepare_for_saving)
            parts, rebuild = alias.prepare_for_saving()
            return _Decomposed(tuple(None if p is None else self.pack(p) for p in parts), rebuild)
        key = storage_key(tensor)
        known = self._storages.get(key)
        if known is None or known[1].expired():
            known = self._storages[key] = (self._place(tensor), StorageWeakRef(tensor.untyped_storage()))
        return _Saved(
            known[0],
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            tensor._version,
        )


class ArenaSizer(_Packer):
    """Measures a frame: the aligned bytes of every distinct storage it saves. Saved tensors are
    kept as they are (warmup runs its backward normally); nothing is copied.

    With ``group`` (a callable naming the offload group running now, Megatron's ``attn_norm``,
    ``core_attn`` ...), every save is also recorded as a ``slot_sharing.offload_plan.Save``: its storage by the
    order the frame first saved it in (the same at capture, where addresses differ), its size and
    group, and whether it is marked not to be offloaded. ``slot_sharing.offload_plan.plan_offload`` makes the
    frame's offload plan from ``saves``."""

    def __init__(self, device: torch.device | str | None = None, group: Callable[[], str | None] | None = None) -> None:
        super().__init__(None if device is None else torch.device(device))
        self.nbytes = 0
        self._group = group
        self._ordinal: dict[tuple[Any, int], int] = {}
        self.storages = 0  # distinct storages saved so far
        self.saves: list[Save] = []
        self._in_ctx = False

    def _place(self, tensor: torch.Tensor) -> int:
        # Numbered in the order of first saves; a new storage at a reused address gets a new number.
        self._ordinal[storage_key(tensor)] = self.storages
        self.storages += 1
        offset = self.nbytes
        self.nbytes += _aligned(tensor.untyped_storage().nbytes())
        return offset

    def pack(self, tensor: torch.Tensor) -> Any:
        # Recorded here, not in the hook: the parts of a decomposed tensor come through here too.
        packed = super().pack(tensor)
        if self._group is not None and isinstance(packed, _Saved):
            marked = bool(getattr(tensor, "_do_not_offload", False) or getattr(tensor, "_TE_do_not_offload", False))
            self.saves.append(
                Save(
                    self._ordinal[storage_key(tensor)],
                    tensor.untyped_storage().nbytes(),
                    tensor.numel(),
                    None if self._in_ctx else self._group(),
                    marked,
                )
            )
        return packed

    def _measure(self, tensor: torch.Tensor) -> torch.Tensor:
        self.pack(tensor)
        return tensor

    def _protected(self, tensor: torch.Tensor) -> torch.Tensor:
        """Measuring only: ctx keeps its tensors. A ctx tensor is outside every offload group: it
        stays in the GPU arena, and so does every view of its storage (the alias rule)."""
        self._in_ctx = True
        try:
            return self._measure(tensor)
        finally:
            self._in_ctx = False

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._measure, lambda tensor: tensor)


class ArenaHooks(_Packer):
    """Saved-tensor hooks that copy a frame's saved tensors into ``arena``.

    Use one instance per frame: ``with ArenaHooks(arena).hooks(): forward``; the backward of that
    frame then reads the arena copies, whatever happened to the originals since.
    """

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena.buffer.device)
        self.arena = arena
        arena.reset()

    def _place(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        offset = self.arena.reserve(storage.nbytes())
        source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        # Copy on the current (compute) stream, in order with the forward's later in-place writes.
        self.arena.buffer[offset : offset + storage.nbytes()].copy_(source)
        return offset

    def _protected(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.unpack(self.pack(tensor))

    def unpack(self, packed: Any) -> Any:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Decomposed):
            parts = [None if p is None else self.unpack(p) for p in packed.parts]
            if not hasattr(packed.rebuild, "restore_from_saved"):
                return packed.rebuild(parts)
            rebuilt = packed.rebuild.restore_from_saved(parts)
            # TE's storages fill themselves and return the parts left over: the tensor is the object.
            return packed.rebuild if isinstance(packed.rebuild, torch.Tensor) else rebuilt
        element = torch.empty(0, dtype=packed.dtype).element_size()
        return saved_view(self.arena.buffer, packed.offset // element, packed)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def saved_view(buffer: torch.Tensor, element_offset: int, packed: Any) -> torch.Tensor:
    """The saved tensor ``packed`` (dtype, size, stride, storage offset, version) rebuilt on
    ``buffer``'s storage, its storage starting ``element_offset`` elements in: a fresh tensor (not a
    view of the buffer), so it gets a version counter of its own, set to the original's."""
    tensor = torch.empty(0, dtype=packed.dtype, device=buffer.device)
    tensor.set_(buffer.untyped_storage(), element_offset + packed.storage_offset, packed.size, packed.stride)
    torch._C._autograd._unsafe_set_version_counter((tensor,), (packed.version,))
    return tensor


def _custom_function_nodes(outputs: Sequence[torch.Tensor]) -> Iterator[Any]:
    """The custom autograd Function nodes (their ``ctx``) reachable backwards from ``outputs``."""
    return custom_function_nodes([t.grad_fn for t in outputs if isinstance(t, torch.Tensor)])


def custom_function_nodes(roots: Sequence[Any]) -> Iterator[Any]:
    """The custom autograd Function nodes reachable backwards from the autograd nodes ``roots``."""
    return (node for node in reachable_nodes(roots) if isinstance(node, torch.autograd.function.BackwardCFunction))


def _is_frame_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def no_call_objects(_: Any) -> tuple[str, ...]:
    """``entering``'s default: no per-call object is entered."""
    return ()


def _map_tensors(
    value: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    call_objects: Callable[[Any], tuple[str, ...]] = no_call_objects,
    depth: int = 0,
) -> Any:
    """``value`` with every frame tensor in it replaced by ``fn(tensor)``; containers are rebuilt
    (tuples) or updated in place (lists, dicts, per-call dataclasses, and the per-call objects
    ``call_objects`` names attributes of). Returns ``value`` itself when it holds no tensor."""
    if _is_frame_tensor(value):
        return fn(value)
    if depth > 4:
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        items = tuple(_map_tensors(item, fn, call_objects, depth + 1) for item in value)
        return items if any(a is not b for a, b in zip(items, value)) else value
    if isinstance(value, list):
        for index, item in enumerate(value):
            value[index] = _map_tensors(item, fn, call_objects, depth + 1)
        return value
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _map_tensors(item, fn, call_objects, depth + 1)
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names: Sequence[str] = [field.name for field in dataclasses.fields(value)]
    else:
        names = call_objects(value)
    for name in names:
        item = getattr(value, name)
        new = _map_tensors(item, fn, call_objects, depth + 1)
        if new is not item:
            setattr(value, name, new)
    return value
