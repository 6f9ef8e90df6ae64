"""The quick accept of one learned call, compiled into one Python function (``QuickAccept.learn``).

``accept_function(layout, ...)`` returns ``accept(args, kwargs, full) -> bool``, which makes the
quick accept's comparisons (``contracts.QuickAccept``) with each value unpacked into a local and
each read written out: ``type(v0) is t0``, ``(v0.shape, v0.dtype, ...) != metas``, and so on.

Why: inside a training step each distinct call the check makes costs microseconds, whatever it
reads (the code and objects it touches are out of cache). The quick accept before it read a call
through tuples, ``map``s and ``itemgetter``s, a dozen calls a replay; on the CPU stand-in
(``docs/results/session-2026-12-04b/drivers/insitu.py``) the compiled one, called from the replay
check's closure, takes ~0.56x its time (session-2026-12-04c). The source depends on the call's
layout only (how many values, which are tensors, which controls), so it is compiled once a layout;
the learned values are bound into each function's closure."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

Accept = Callable[[Sequence[Any], dict, bool], bool]


@dataclasses.dataclass(frozen=True)
class AcceptLayout:
    """Where a learned call's values are: its positional and keyword counts, and the positions
    (in ``(*args, *kwargs.values())``) of the values whose types are compared, of the tensors (in the
    contract's static-input order) and of the control values (in the contract's input order)."""

    positional: int
    keywords: int  # their names are a learned value, not part of the source
    typed: tuple[int, ...]
    tensors: tuple[int, ...]
    controls: tuple[int, ...]
    full: bool  # learned in full mode: controls, memory and held state are compared too
    reads_storages: bool  # static buffers were alive at learning: copied-in inputs' storages are read
    step_marked: bool  # the held state may be skipped within a marked step (``QuickAccept``)
    # Per tensor: its storage's address computed from its own address and offset (a plain tensor or
    # parameter), not read through ``untyped_storage()`` (any other type: it may keep its storage apart).
    storage_by_offset: tuple[bool, ...]


def refuse_all(args: Sequence[Any], kwargs: dict, full: bool) -> bool:
    """The accept before any call was learned."""
    return False


def accept_function(layout: AcceptLayout, state: Any, *, first_keyword: str, keys: tuple[str, ...],
                    types: tuple[type, ...], metas: tuple[Any, ...], controls: tuple[Any, ...],
                    static_ptrs: frozenset[int], live_storages: frozenset[int],
                    data_ptr: Callable[[Any], int], storage_offset: Callable[[Any], int],
                    storage_ptr: Callable[[Any], int], itemsizes: tuple[int, ...]) -> Accept:
    """``layout``'s accept over these learned values. ``state`` (``contracts.QuickState``) keeps
    ``held_at_step`` and ``step_marks`` and gives ``memory_in_place`` and ``held_accepts``; it must
    not hold the function (a cycle). ``keys``: the keywords in order, each a plain ``str``.
    ``metas``: each tensor's shape, dtype, device and ``requires_grad``, flattened. ``data_ptr`` and
    ``storage_offset``: ``torch.Tensor``'s own, called unbound (an attribute set on one instance counts
    in neither check). ``storage_ptr``: the full check's own storage read, for the types whose storage
    is not computed. ``itemsizes``: each tensor's element size in bytes (read where
    ``layout.storage_by_offset`` says so)."""
    return _maker(layout)(state, first_keyword, keys, types, metas, controls, static_ptrs, live_storages, data_ptr,
                          storage_offset, storage_ptr, itemsizes)


@functools.cache
def _maker(layout: AcceptLayout) -> Callable[..., Accept]:
    namespace: dict[str, Any] = {}
    exec(compile(accept_source(layout), f"<quick accept {layout}>", "exec"), namespace)
    return namespace["make"]


def _tuple(items: Sequence[str]) -> str:
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _targets(names: Sequence[str]) -> str:
    """Assignment targets that unpack exactly ``len(names)`` values."""
    return f"{names[0]}," if len(names) == 1 else ", ".join(names)


def _key_names(count: int) -> tuple[list[str], list[str]]:
    """The locals of the call's keyword names and of the learned ones."""
    return [f"key{i}" for i in range(count)], [f"learned_key{i}" for i in range(count)]


def accept_source(layout: AcceptLayout) -> str:
    """The source of ``make(...)``, which returns ``accept`` with the learned values as its closure:
    the source holds counts and positions only, never a name or value from the call.
    Each test returns False at the first difference; types come before metadata (a non-tensor has
    no shape to read)."""
    count = layout.positional + layout.keywords
    value = [f"v{position}" for position in range(count)]
    tensors = [value[position] for position in layout.tensors]
    body = [
        "first = kwargs.get(first_keyword)",
        "if first is not False:  # a step's first microbatch (or no such mark): nothing read for it yet",
        "    state.held_at_step = None",
    ]
    if not layout.full:
        body.append("if full:  # learned in shapes mode: vouches for no more")
        body.append("    return False")
    body.append(f"if len(args) != {layout.positional} or len(kwargs) != {layout.keywords}:")
    body.append("    return False")
    if layout.keywords:  # by identity (names in code are interned), else as plain str (a subclass's == may lie)
        names, learned = _key_names(layout.keywords)
        body.append(f"{_targets(names)} = kwargs")
        body.append("if " + " or ".join(f"({name} is not {key} and (type({name}) is not str or {name} != {key}))"
                                        for name, key in zip(names, learned)) + ":")
        body.append("    return False")
    if layout.positional:
        body.append(f"{_targets(value[:layout.positional])} = args")
    if layout.keywords:
        body.append(f"{_targets(value[layout.positional:])} = kwargs.values()")
    if layout.typed:
        body.append("if " + " or ".join(f"type({value[p]}) is not t{i}" for i, p in enumerate(layout.typed)) + ":")
        body.append("    return False")
    if tensors:
        reads = [f"{tensor}.{field}" for tensor in tensors for field in ("shape", "dtype", "device", "requires_grad")]
        body.append(f"if {_tuple(reads)} != metas:")
        body.append("    return False")
    if layout.full:
        body.extend(_full_mode_source(layout, value, tensors))
    else:
        body.append("return True")
    types = [f"t{i}" for i in range(len(layout.typed))]
    unpack = [f"    {_targets(types)} = types"] if types else []
    if layout.keywords:
        unpack.append(f"    {_targets(_key_names(layout.keywords)[1])} = keys")
    if layout.full and layout.reads_storages and any(layout.storage_by_offset):
        unpack.append(f"    {_targets(_itemsize_names(len(tensors)))} = itemsizes")
    bound = []  # the methods full mode calls, looked up once
    if layout.full:
        bound.append("    memory_in_place, held_accepts = state.memory_in_place, state.held_accepts")
    if layout.full and layout.step_marked:
        bound.append("    marks = state.step_marks  # its step_now() read inline: a call costs inside a step")
    return "\n".join([
        "def make(state, first_keyword, keys, types, metas, controls, static_ptrs, live_storages, data_ptr,"
        " storage_offset, storage_ptr, itemsizes):",
        *unpack,
        *bound,
        "    def accept(args, kwargs, full):",
        *(f"        {line}" for line in body),
        "    return accept",
        "",
    ])


def _itemsize_names(count: int) -> list[str]:
    return [f"s{i}" for i in range(count)]


def _storage_read(tensor: str, pointer: str, itemsize: str, by_offset: bool) -> str:
    """The expression of ``tensor``'s storage address. A plain tensor's address is its storage's plus
    its offset in elements (``TensorImpl::data``), so the storage's is one method call away, where
    ``untyped_storage()`` makes a storage object on each replay (~3 of ~14 us a check inside a step,
    on the CPU stand-in). Any other type: the full check's own read (``storage_ptr``)."""
    if by_offset:
        return f"{pointer} - storage_offset({tensor}) * {itemsize}"
    return f"storage_ptr({tensor})"


def _full_mode_source(layout: AcceptLayout, value: list[str], tensors: list[str]) -> list[str]:
    """What full mode compares past the metadata: controls, memory, then the held state."""
    lines = ["if not full:", "    return True"]
    if layout.controls:
        lines += [
            "try:  # captured on the left, as the full check compares them (an __eq__ need not be symmetric)",
            f"    if not controls == {_tuple([value[p] for p in layout.controls])}:",
            "        return False",
            "except (RuntimeError, TypeError, ValueError):  # e.g. objects holding tensors",
            "    return False",
        ]
    if tensors:
        pointers = [f"p{i}" for i in range(len(tensors))]
        lines.append(f"{_targets(pointers)} = {_tuple([f'data_ptr({t})' for t in tensors])}")
        lines.append("if " + " or ".join(f"{p} in static_ptrs" for p in pointers) + ":  # one read in place")
        lines.append(f"    if not memory_in_place({_tuple(tensors)}, {_tuple(pointers)}):")
        lines.append("        return False")
        if layout.reads_storages:  # all copied in (the usual case): not into a live static buffer's storage
            storages = [_storage_read(t, p, size, by_offset) for t, p, size, by_offset
                        in zip(tensors, pointers, _itemsize_names(len(tensors)), layout.storage_by_offset, strict=True)]
            lines.append("elif " + " or ".join(f"{storage} in live_storages" for storage in storages) + ":")
            lines.append("    return False")
    if layout.step_marked:
        lines += [
            "held_at = state.held_at_step  # None unless first is False (reset above)",
            # marks.count names one stretch between marks, and held_at is set only inside a marked run: the same
            # count is the same run (step_now() need not read depth here)
            "if held_at is not None and held_at == marks.count:",
            "    return True  # read at this step's first microbatch (QuickAccept)",
        ]
    lines += ["if not held_accepts():", "    return False"]
    if layout.step_marked:
        lines.append("state.held_at_step = marks.count if first is True and marks.depth else None  # step_now()")
    lines.append("return True")
    return lines
