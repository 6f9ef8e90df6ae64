"""The launcher's packed batches (``--dataloader-inter-document-masking`` without hybrid CP): the
batch keys Megatron's packed path reads, and the ``PackedSeqParams`` of a flattened microbatch, as
Megatron-LM's own ``pretrain_gpt.py`` makes them (``get_batch``, ``forward_step``), so the plugin's
layout (``packed.graphs``) meets the same params from either entry point.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["packed_batch_params", "with_packed_keys"]

# What Megatron's get_batch_on_this_tp_rank reads of a packed batch besides the tokens (None where absent).
_PACKED_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def with_packed_keys(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` with every key of ``_PACKED_KEYS`` (None where the dataset gives none: its
    ``cu_seqlens_padded``, which Megatron's broadcast reads under CP)."""
    return {**dict.fromkeys(_PACKED_KEYS), **batch}


def packed_batch_params(batch: Mapping[str, Any], *, tokens_per_sample: int) -> Any:
    """The ``PackedSeqParams`` of a flattened packed microbatch (``cu_seqlens`` of shape ``[1, n]``
    after ``flatten_batch_for_packed_sequences``), or None for an unpacked one. ``max_seqlen`` is read
    to the host, as Megatron's script reads it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = batch.get("cu_seqlens")
    if offsets is None:
        return None
    offsets = offsets.squeeze(0)
    padded = batch.get("cu_seqlens_padded")
    padded = None if padded is None else padded.squeeze(0)
    attended = offsets if padded is None else padded  # Megatron's script attends over the padded offsets when given
    longest = int(batch["max_seqlen"].max().item())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=attended,
        cu_seqlens_kv=attended,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        tokens_per_sample=tokens_per_sample,
    )
