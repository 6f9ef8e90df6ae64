"""Stand-ins for the GPU host on a machine without one: Megatron's validation and the plugin's rules
run there as they would on the GPU host (``megatron-cg check``, and a run's own validation on a host
without a GPU, ``host_validation``). Every stand-in is set and restored through ``foreign_state``
(its changes are listed in ``patching.ledger.SCOPED``).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator
from typing import Any

from megatron_cg_plugin import compat, foreign_state

__all__ = ["TE_KERNELS", "gpu_host_stand_ins", "gpu_missing", "host_validation"]


def gpu_missing() -> bool:
    return compat.device_capability() is None


@contextlib.contextmanager
def host_validation() -> Iterator[bool]:
    """Megatron's validation and the rules as they run on the GPU host: on a host without a GPU, under
    ``gpu_host_stand_ins``, so the flags' own problems are named before the host's (``refuse_host``, asked
    after the block: inside it a stand-in GPU answers). Yields whether this host has a GPU."""
    if not gpu_missing():
        yield True
        return
    with gpu_host_stand_ins():
        yield False


def _te_kernel_stand_in(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("a stand-in for a TE kernel, for megatron-cg check on a machine without TE")


# TE kernels Megatron imports as None where TE is missing, and whose absence TransformerConfig refuses.
TE_KERNELS = (
    (
        "megatron.core.models.common.embeddings.rope_utils",
        ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"),
    ),  # --apply-rope-fusion
    (
        "megatron.core.transformer.moe.moe_utils",
        (
            "fused_permute",
            "fused_permute_with_probs",
            "fused_sort_chunks_by_index",
            "fused_sort_chunks_by_index_with_probs",
            "fused_unpermute",
        ),
    ),  # --moe-permute-fusion
)


@contextlib.contextmanager
def gpu_host_stand_ins(*, capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """Lets Megatron's validation run on a CPU machine as it would on the GPU host. Only these
    differ, all restored on exit (``ledger.SCOPED``): when there is no GPU here,
    ``torch.cuda.get_device_capability`` and ``get_device_properties`` describe a device of
    ``capability`` (Megatron asks for grouped GEMM and for the TP/CP connection rules); when TE is
    not installed here, the TE kernels of ``TE_KERNELS`` (which ``TransformerConfig`` requires for
    RoPE and permutation fusion) are stand-ins that are never called, and Megatron's cached TE
    version is the lowest release the plugin supports (its config checks gate features on it;
    unset, they would read 0.0.0)."""
    import torch
    from megatron.core import utils as megatron_utils

    with foreign_state.Changes() as changes:
        if not torch.cuda.is_available():
            properties = types.SimpleNamespace(
                major=capability[0],
                minor=capability[1],
                name=f"stand-in sm_{capability[0]}{capability[1]}",
                total_memory=0,
                multi_processor_count=0,
            )
            changes.set(
                torch.cuda, "get_device_capability", lambda *_a, **_k: capability, change="cpu-device-stand-ins"
            )
            changes.set(
                torch.cuda, "get_device_properties", lambda *_a, **_k: properties, change="cpu-device-stand-ins"
            )
        for module_name, names in TE_KERNELS:
            module = importlib.import_module(module_name)
            for name in names:
                if getattr(module, name, None) is None:  # TE's kernel did not import here
                    changes.set(module, name, _te_kernel_stand_in, change="te-kernel-stand-ins")
        if not compat.te_available():
            lowest = megatron_utils.PkgVersion(".".join(map(str, compat.SUPPORTED_TRANSFORMER_ENGINE[0])))
            changes.set(megatron_utils, "_te_version", lowest, change="te-version-stand-in")
        yield
