"""What one packed microbatch of hybrid (dynamic) context parallelism hands Megatron's layers:
the ``PackedSeqParams`` of its fixed-capacity THD pack and, for TE's CP attention, the CP side
stream. Both the eager run (``banks.hybrid_cp_batch``) and the graph banks' capture (``banks.capture``)
build packs this way; the layer-spec adaptation above them is ``dynamic_cp``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_cg_plugin import foreign_state

__all__ = ["ensure_dynamic_cp_stream", "packed_seq_params"]


def packed_seq_params(cu_seqlens: Any, cu_seqlens_padded: Any, cp_size: int, group: Any, max_seqlen: int) -> Any:
    """Megatron's ``PackedSeqParams`` for a fixed-capacity THD pack of CP size ``cp_size``: the
    form both the capture and the eager run use."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        local_cp_size=cp_size,
        cp_group=group if cp_size > 1 else None,
        pad_between_seqs=True,
    )


def ensure_dynamic_cp_stream() -> None:
    """Megatron creates the side stream TE's CP attention needs (``TEDotProductAttention.cp_stream``)
    only when the static CP size is > 1; hybrid CP switches CP on per microbatch, so eager and
    graphed runs alike need it whatever the static size (without it TE's P2P attention fails on
    ``None.wait_event``). Sets it once (``ledger.LENT``: ``install()`` saved the attribute and
    ``uninstall()`` restores it); an existing stream is kept."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    if TEDotProductAttention.cp_stream is None:
        foreign_state.put(TEDotProductAttention, "cp_stream", torch.cuda.Stream())  # dynamic-cp-stream
