"""Per-forward scratch attributes: tensors a forward leaves on objects that nothing reads after it.

A captured forward that stores a tensor on an object (``self.probs = probs``) keeps that tensor's
pool block alive past the graph, where the slot-shared capture cannot tell it from backward state
and refuses it (``SlotCoverageError``). Attributes declared scratch are set to None as the forward
returns, inside the capture, so their tensors are ordinary temporaries of the graph; and before
capture, so that an eager step's tensors there do not keep that step's autograd graph alive (its
AccumulateGrad nodes stay bound to the eager stream and break the backward capture: hygiene).
Only attributes their owner itself declares per-forward are declared here; anything else a capture
leaves alive is still refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from megatron_cg_plugin.scopes import PARTIAL_MOE_SCOPES, module_names

__all__ = ["ScratchAttribute", "clear", "clearing", "ends_inside_moe_block", "moe_dispatcher_scratch", "resolve"]


@dataclasses.dataclass(frozen=True)
class ScratchAttribute:
    owner: Any
    name: str

    def __str__(self) -> str:
        return f"{type(self.owner).__name__}.{self.name}"


def clear(attributes: Iterable[ScratchAttribute]) -> None:
    """Drops what the attributes hold (None, as Megatron resets them itself)."""
    for attribute in attributes:
        setattr(attribute.owner, attribute.name, None)


def clearing(fn: Callable[..., Any], attributes: tuple[ScratchAttribute, ...]) -> Callable[..., Any]:
    """``fn`` with ``attributes`` cleared after every call, also when it raises (``fn`` itself
    without attributes)."""
    if not attributes:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            clear(attributes)

    return call


def resolve(root: Any, dotted: str) -> ScratchAttribute:
    """``a.b.c`` on ``root``: attribute ``c`` of ``root.a.b`` (Megatron's dotted attribute names)."""
    *parents, name = dotted.split(".")
    owner = root
    for parent in parents:
        owner = getattr(owner, parent)
    return ScratchAttribute(owner, name)


def ends_inside_moe_block(layer: Any) -> bool:
    """The layer's graph ends inside its MoE block (``--cuda-graph-modules moe_router``,
    ``moe_preprocess``) and hands the dispatcher's state to the block's eager rest."""
    return getattr(layer, "is_moe_layer", False) and bool(
        PARTIAL_MOE_SCOPES & set(module_names(getattr(layer.config, "cuda_graph_modules", None)))
    )


def moe_dispatcher_scratch(layer: Any) -> tuple[ScratchAttribute, ...]:
    """The per-forward state of an MoE layer's token dispatcher (none for a dense layer).

    Megatron's dispatchers list that state in ``cudagraph_attrs``: it is what their
    ``moe_preprocess`` graph returns and what Megatron sets back on the dispatcher after a replay,
    because a graph replay does not run the Python that sets it. A graph of the whole MoE block
    uses it inside the graph only (permutation maps, routing probabilities)."""
    if not getattr(layer, "is_moe_layer", False):
        return ()
    dispatcher = layer.mlp.token_dispatcher
    names = getattr(dispatcher, "cudagraph_attrs", None)
    if names is None:
        raise RuntimeError(
            f"{type(dispatcher).__name__} has no cudagraph_attrs (its per-forward state), which graph banks need "
            "to graph the MoE block; this megatron-core is outside the tested range (docs/versions.md): graph "
            "only attention with --cuda-graph-modules attn."
        )
    return tuple(resolve(dispatcher, name) for name in names)
