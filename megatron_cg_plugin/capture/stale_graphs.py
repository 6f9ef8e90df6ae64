"""Stream hygiene around capture: find eager autograd graphs that are still alive.

torch >= 2.9 binds each parameter's AccumulateGrad node to the stream it was created on. A graph
left alive from an eager step (a ``loss`` variable, a list of outputs) keeps those nodes, bound to
the eager stream; capture then dies with "operation would make the legacy stream depend on a
capturing blocking stream". The safe fix is to collect unreachable garbage (reference cycles
holding graphs); anything still alive after that is refused, naming what holds it.

Listing the heap costs ~0.2 s in a Megatron process, so by default it runs only after a capture
failed and was rolled back with CUDA's symptoms of such a graph (``diagnose_failed_capture``);
``ensure_no_stale_graphs`` runs it before.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from megatron_cg_plugin.capture.autograd_graph import reachable_nodes

__all__ = [
    "StaleAutogradGraphError",
    "StaleGraph",
    "chain",
    "describe_holders",
    "diagnose_failed_capture",
    "ensure_no_stale_graphs",
    "find_stale_graphs",
    "shows_stale_graph_symptoms",
    "tensors_in",
]


@dataclasses.dataclass(frozen=True)
class StaleGraph:
    root: str  # e.g. "MeanBackward0 output, shape (), float32"
    parameters: int  # graphed parameters whose AccumulateGrad node it keeps alive
    holders: tuple[str, ...]
    tolerated: bool = False  # held only where capture is known to work (see TOLERATED_HOLDERS)


# Holders Megatron itself keeps between steps, with which TE capture was seen to succeed (the
# farm's MoE cases on H200: the alltoall dispatcher keeps the last microbatch's routing `probs`).
# Graphs held only by these are reported, not refused, for TE's capture; slot-shared capture takes
# the gradient of every parameter directly and failed on such a graph (H200, a graphed MoE block:
# "operation would make the legacy stream depend on a capturing blocking stream"), so it refuses them.
_TOLERATED_HOLDERS = (("TokenDispatcher", "probs"),)


class StaleAutogradGraphError(RuntimeError):
    def __init__(self, stale: list[StaleGraph], *, after_failure: bool = False) -> None:
        self.stale = stale
        self.after_failure = after_failure
        lines = []
        for graph in stale:
            held = "; ".join(graph.holders) or "no Python referrer found (held from C++ or a closure)"
            lines.append(f"  - {graph.root}, reaching {graph.parameters} graphed parameter(s), held by: {held}")
        opening = (
            "CUDA graph capture failed and was rolled back, and the likely cause is still there"
            if after_failure
            else "CUDA graph capture refused"
        )
        super().__init__(
            f"{opening}: {len(stale)} autograd graph(s) from an eager step are still "
            "alive and keep AccumulateGrad nodes of graphed parameters bound to the eager stream; with "
            "torch >= 2.9 capture fails with 'operation would make the legacy stream depend on a "
            "capturing blocking stream'.\n"
            + "\n".join(lines)
            + "\nDrop these references before capture (e.g. `del loss`, or keep `loss.item()` instead of the "
            "tensor)."
        )


def _accumulated_variables(root: Any) -> Iterable[torch.Tensor]:
    """Leaf tensors (``AccumulateGrad.variable``) reachable from an autograd node."""
    for node in reachable_nodes([root]):
        variable = getattr(node, "variable", None)
        if variable is not None:
            yield variable


def _frame_holders(target: Any) -> list[str]:
    """Local variables of running functions (every thread's stack) that hold ``target``; running
    frames are not reliably visible to ``gc.get_referrers``."""
    found = []
    # One variable walks each stack down to None: a name left holding this function's own frame
    # would make a cycle that keeps ``target`` alive after the return.
    frame: types.FrameType | None
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_filename == __file__:  # this scan's own variables
                frame = frame.f_back
                continue
            names = [name for name, value in frame.f_locals.items() if value is target]
            if names:
                code = frame.f_code
                found.append(
                    f"local variable {', '.join(map(repr, names))} in {code.co_name}() "
                    f"({code.co_filename}:{frame.f_lineno})"
                )
            frame = frame.f_back
    return found


def _owners(referrer: Any) -> list[Any]:
    """The objects whose attribute a referrer is: the owner of an instance or module ``__dict__``,
    or the referrer itself; ``None`` stands for a holder that is not an attribute (list, frame,
    a bare dict such as a frame's locals snapshot)."""
    if isinstance(referrer, dict):
        owners = [o for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer]
        return owners or [None]
    if isinstance(referrer, (list, tuple, types.FrameType)):
        return [None]
    return [referrer]


def _attributes_holding(owner: Any, target: Any) -> list[str]:
    """The attributes of ``owner`` that are ``target``: in its ``__dict__`` and in its slots
    (dataclasses with ``slots=True``, such as TE's ``FusedAttnBwdArgs``, have no ``__dict__``)."""
    names = [key for key, value in getattr(owner, "__dict__", {}).items() if value is target]
    for cls in type(owner).__mro__:
        slots = getattr(cls, "__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and getattr(owner, slot, None) is target:
                names.append(slot)
    return names


def _describe_holder(referrer: Any, target: Any) -> str | None:
    """One referrer of ``target`` in words, or None for referrers that explain nothing (frames and
    their locals snapshots, reported by ``_frame_holders``)."""
    if isinstance(referrer, (list, tuple)):
        return f"an element of a {type(referrer).__name__} of length {len(referrer)}"
    for owner in _owners(referrer):
        attributes = _attributes_holding(owner, target) if owner is not None else []
        if attributes:
            what = f"module {owner.__name__}" if isinstance(owner, types.ModuleType) else type(owner).__name__
            return f"attribute {', '.join(map(repr, attributes))} of {what}"
    return None


def _referrer_holders(target: Any, ignore: Iterable[Any] = ()) -> tuple[str, ...]:
    ignored = {id(obj) for obj in ignore}
    referrers = [r for r in gc.get_referrers(target) if id(r) not in ignored]
    # List comprehensions only: a generator expression would capture `target` in a closure cell,
    # which gc then reports as one more holder.
    return tuple([text for r in referrers if (text := _describe_holder(r, target))])


def describe_holders(target: Any) -> tuple[str, ...]:
    """What keeps ``target`` alive, in words: running functions' locals and attributes of objects,
    and, one level up, the attributes that hold an object whose attribute it is (a scale on a
    quantizer names the ctx or module field the quantizer sits in)."""
    described = list(_frame_holders(target))
    for referrer in gc.get_referrers(target):
        text = _describe_holder(referrer, target)
        if text is None:
            continue
        owners = [
            o
            for o in _owners(referrer)
            if o is not None and not isinstance(o, types.ModuleType) and _attributes_holding(o, target)
        ]
        # Only attributes above: locals and bare lists there name the scan itself more than the holder.
        above = [h for o in owners for h in _referrer_holders(o) if h.startswith("attribute ")]
        described.append(f"{text}, which is {'; '.join(above)}" if above else text)
    return tuple(described)


def _storage_address(tensor: torch.Tensor) -> int | None:
    """Where the tensor's storage starts; None for tensors without real storage (fake, functional
    and other wrapper subclasses that torch.compile or a library leaves alive)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def tensors_in(blocks: dict[int, int], objects: Iterable[Any] | None = None) -> list[torch.Tensor]:
    """Live tensors whose storage starts inside one of ``blocks`` (address -> bytes)."""
    found = []
    for obj in gc.get_objects() if objects is None else objects:
        if issubclass(type(obj), torch.Tensor):  # type(): gc lists dead weakref proxies too
            ptr = _storage_address(obj)
            if ptr is not None and any(address <= ptr < address + size for address, size in blocks.items()):
                found.append(obj)
    return found


def find_stale_graphs(params: Iterable[torch.Tensor], objects: Iterable[Any] | None = None) -> list[StaleGraph]:
    """Live tensors whose autograd graph reaches any of ``params``' AccumulateGrad nodes."""
    param_ids = {id(p) for p in params}
    stale = []
    scanned = gc.get_objects() if objects is None else list(objects)
    for obj in scanned:
        # type(), not isinstance(): gc also lists dead weakref proxies, which raise on __class__.
        if not issubclass(type(obj), torch.Tensor) or obj.grad_fn is None:
            continue
        # A fresh walk per root, so every holder is named even when graphs share nodes.
        reached = {id(v) for v in _accumulated_variables(obj.grad_fn) if id(v) in param_ids}
        if not reached:
            continue
        frames = _frame_holders(obj)
        holders = tuple(frames) + _referrer_holders(obj, ignore=[scanned])
        owners = [owner for r in gc.get_referrers(obj) if r is not scanned for owner in _owners(r)]
        tolerated = [_tolerated(owner, obj) for owner in owners]
        stale.append(
            StaleGraph(
                root=f"{type(obj.grad_fn).__name__} output, shape {tuple(obj.shape)}, {obj.dtype}",
                parameters=len(reached),
                holders=holders,
                tolerated=not frames and bool(owners) and all(tolerated),
            )
        )
    return stale


def _tolerated(owner: Any, target: Any) -> bool:
    if owner is None:
        return False
    attributes = _attributes_holding(owner, target)
    return bool(attributes) and all(
        type(owner).__name__.endswith(suffix) and name == attribute
        for attribute in attributes
        for suffix, name in _TOLERATED_HOLDERS
    )


def _untolerated(graphs: list[StaleGraph], tolerate: bool) -> list[StaleGraph]:
    return [graph for graph in graphs if not (tolerate and graph.tolerated)]


def _release_frames(error: BaseException) -> None:
    """Drops the locals of the finished frames in ``error``'s tracebacks (its causes' too): the
    failed capture's own outputs, whose graphs reach the parameters, would otherwise be found as
    stale. The tracebacks stay printable."""
    for link in chain(error):
        traceback.clear_frames(link.__traceback__)


# What CUDA reports when a capture meets an eager graph's AccumulateGrad nodes (torch >= 2.9): the
# error itself, or the invalidated capture it leaves behind where torch catches the first one. The
# second follows any error inside a capture, so on it alone only graphs with a Python holder count.
_STALE_GRAPH_ERROR = "legacy stream depend on a capturing blocking stream"
_INVALIDATED_CAPTURE = "operation failed due to a previous error during capture"


def chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, its cause or context, and theirs."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _cuda_says(error: BaseException, symptom: str) -> bool:
    # The plugin's own refusal quotes CUDA's error; it is no CUDA report.
    return any(symptom in str(e) for e in chain(error) if not isinstance(e, StaleAutogradGraphError))


def shows_stale_graph_symptoms(error: BaseException) -> bool:
    return _cuda_says(error, _STALE_GRAPH_ERROR) or _cuda_says(error, _INVALIDATED_CAPTURE)


def diagnose_failed_capture(
    params: Iterable[torch.Tensor],
    error: BaseException,
    *,
    tolerate: bool = True,
    collect: Callable[[], Any] = gc.collect,
) -> None:
    """After a capture failed and was rolled back with CUDA's symptoms of a live eager graph:
    raises ``StaleAutogradGraphError`` (from ``error``) naming what holds the eager graphs that
    reach ``params`` and survive a garbage collection. Returns if there are none, or if the
    failure shows other symptoms: then it has another cause, and a failed capture's own leftovers
    (held from C++, reaching the parameters) must not be taken for eager graphs (H200: an FP8
    error in warmup left four). On the invalidated-capture error alone, which any error inside a
    capture leaves, only graphs with a Python holder are named."""
    if not shows_stale_graph_symptoms(error):
        return
    named_only = not _cuda_says(error, _STALE_GRAPH_ERROR)
    _release_frames(error)
    params = list(params)
    if not _untolerated(find_stale_graphs(params), tolerate):
        return
    collect()
    remaining = [
        graph for graph in _untolerated(find_stale_graphs(params), tolerate) if graph.holders or not named_only
    ]
    if remaining:
        raise StaleAutogradGraphError(remaining, after_failure=True) from error


def ensure_no_stale_graphs(
    params: Iterable[torch.Tensor], *, tolerate: bool = True, collect: Callable[[], Any] = gc.collect
) -> list[StaleGraph]:
    """Collects garbage if stale graphs are found (the safe fix), then refuses if any remain that
    are not tolerated (``tolerate=False``: any). Returns the tolerated ones, for the log."""
    params = list(params)
    if not find_stale_graphs(params):
        return []
    collect()
    stale = find_stale_graphs(params)
    refused = _untolerated(stale, tolerate)
    if refused:
        raise StaleAutogradGraphError(refused)
    return stale
