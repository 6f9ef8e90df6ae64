"""Stream hygiene before capture: find eager autograd graphs that are still alive.

torch >= 2.9 binds each parameter's AccumulateGrad node to the stream it was created on. A graph
left alive from an eager step (a ``loss`` variable, a list of outputs) keeps those nodes, bound to
the eager stream; capture then dies with "operation would make the legacy stream depend on a
capturing blocking stream". The safe fix is to collect unreachable garbage (reference cycles
holding graphs); anything still alive after that is refused, naming what holds it.
"""

from __future__ import annotations

import dataclasses
import gc
import types
from typing import Any, Callable, Iterable

import torch


@dataclasses.dataclass(frozen=True)
class StaleGraph:
    root: str  # e.g. "MeanBackward0 output, shape (), float32"
    parameters: int  # graphed parameters whose AccumulateGrad node it keeps alive
    holders: tuple[str, ...]


class StaleAutogradGraphError(RuntimeError):
    def __init__(self, stale: list[StaleGraph]) -> None:
        self.stale = stale
        lines = []
        for graph in stale:
            held = "; ".join(graph.holders) or "no Python referrer found (held from C++ or a closure)"
            lines.append(f"  - {graph.root}, reaching {graph.parameters} graphed parameter(s), held by: {held}")
        super().__init__(
            f"CUDA graph capture refused: {len(stale)} autograd graph(s) from an eager step are still "
            "alive and keep AccumulateGrad nodes of graphed parameters bound to the eager stream; with "
            "torch >= 2.9 capture would fail with 'operation would make the legacy stream depend on a "
            "capturing blocking stream'.\n" + "\n".join(lines) +
            "\nDrop these references before capture (e.g. `del loss`, or keep `loss.item()` instead of the "
            "tensor).")


def _accumulated_variables(root: Any, seen: set[int]) -> Iterable[torch.Tensor]:
    """Leaf tensors (``AccumulateGrad.variable``) reachable from an autograd node."""
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            yield variable
        stack.extend(next_node for next_node, _ in node.next_functions)


def _describe_holder(referrer: Any, target: Any) -> str | None:
    if isinstance(referrer, types.FrameType):
        names = [name for name, value in referrer.f_locals.items() if value is target]
        code = referrer.f_code
        return f"local variable {', '.join(map(repr, names)) or '?'} in {code.co_name}() " \
               f"({code.co_filename}:{referrer.f_lineno})"
    if isinstance(referrer, dict):
        keys = [key for key, value in referrer.items() if value is target]
        owners = [o for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer]
        owner = f" of {type(owners[0]).__name__}" if owners else " of a dict"
        if owners and isinstance(owners[0], types.ModuleType):
            owner = f" of module {owners[0].__name__}"
        return f"attribute {', '.join(map(repr, keys))}{owner}"
    if isinstance(referrer, (list, tuple)):
        return f"an element of a {type(referrer).__name__} of length {len(referrer)}"
    return None


def find_stale_graphs(params: Iterable[torch.Tensor], objects: Iterable[Any] | None = None) -> list[StaleGraph]:
    """Live tensors whose autograd graph reaches any of ``params``' AccumulateGrad nodes."""
    param_ids = {id(p) for p in params}
    stale = []
    for obj in gc.get_objects() if objects is None else objects:
        if not isinstance(obj, torch.Tensor) or obj.grad_fn is None:
            continue
        # A fresh walk per root, so every holder is named even when graphs share nodes.
        reached = {id(v) for v in _accumulated_variables(obj.grad_fn, set()) if id(v) in param_ids}
        if not reached:
            continue
        holders = tuple(filter(None, (_describe_holder(r, obj) for r in gc.get_referrers(obj))))
        stale.append(StaleGraph(
            root=f"{type(obj.grad_fn).__name__} output, shape {tuple(obj.shape)}, {obj.dtype}",
            parameters=len(reached), holders=holders))
    return stale


def ensure_no_stale_graphs(params: Iterable[torch.Tensor], *, collect: Callable[[], Any] = gc.collect) -> None:
    """Collects garbage if stale graphs are found (the safe fix), then refuses if any remain."""
    params = list(params)
    if not find_stale_graphs(params):
        return
    collect()
    stale = find_stale_graphs(params)
    if stale:
        raise StaleAutogradGraphError(stale)
