"""Data for Megatron runs with the plugin: mock or indexed datasets (``sources``) and the public
hybrid-CP batch function (``hybrid_cp``). Importing this package imports no torch."""

from __future__ import annotations

from typing import Any

__all__ = ["get_hybrid_cp_batch", "pack_hybrid_cp_sample"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megatron_cg_plugin.data import hybrid_cp  # deferred: imports torch, when the batch functions are first used

        return getattr(hybrid_cp, name)
    raise AttributeError(name)
