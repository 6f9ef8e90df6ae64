"""Data for Megatron runs with the plugin: mock or indexed datasets (``sources``), small real indexed
datasets written on the spot (``synthetic``), and the public hybrid-CP batch functions (re-exported from
``megatron_cg_plugin.banks.hybrid_cp_batch``). Importing this package imports no torch."""

from __future__ import annotations

from typing import Any

__all__ = ["get_hybrid_cp_batch", "pack_hybrid_cp_sample"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megatron_cg_plugin.banks import hybrid_cp_batch  # deferred: imports torch, when first used

        return getattr(hybrid_cp_batch, name)
    raise AttributeError(name)
