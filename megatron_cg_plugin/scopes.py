"""Megatron's ``--cuda-graph-modules`` scopes by name: what the rules check and the capture code
(``capture/``, the helper) reads off a layer's config. Its own module so that capture code needs
nothing of the rules, and the rules nothing of capture; it imports nothing (no torch)."""

from __future__ import annotations

from typing import Any

__all__ = ["MOE_SCOPES", "PARTIAL_MOE_SCOPES", "attention_in_graph", "module_names"]

MOE_SCOPES = frozenset({"moe", "moe_router", "moe_preprocess"})
PARTIAL_MOE_SCOPES = MOE_SCOPES - {"moe"}  # the graph ends inside the MoE block


def module_names(modules: Any) -> tuple[str, ...]:
    """``--cuda-graph-modules`` as names, from Megatron's enum members, strings or a spaced string."""
    if modules is None:
        return ()
    if isinstance(modules, str):
        modules = modules.split()
    return tuple(getattr(m, "name", str(m)) for m in modules)


def attention_in_graph(cuda_graph_modules: Any) -> bool:
    """Whether Megatron's capture callable runs attention for these ``--cuda-graph-modules``
    (none listed: the whole layer)."""
    names = module_names(cuda_graph_modules)
    return not names or "attn" in names
