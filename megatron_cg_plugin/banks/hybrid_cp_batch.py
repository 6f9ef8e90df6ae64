"""Megatron's hybrid-CP samples as fixed-capacity THD packs: the batch a ``forward_step`` feeds the
model under ``--hybrid-context-parallel``, eager or graphed.

Megatron's hybrid-CP loader (``HybridCPDataLoaderWrapper``) hands each microbatch one document:
1-D ``tokens``, ``labels``, ``loss_mask`` and ``position_ids``, with ``local_cp_size``, the CP size
its scheduler picked. Megatron 0.19.2's own ``get_batch_on_this_tp_rank`` fails on these (it reads
a second dimension the 1-D sample lacks). Here the document is padded to the pack of ``cp x
tokens_per_rank`` tokens (``packed.layout``: one layout for graphed and eager runs), split per sequence
across its CP group as TE splits THD inputs, and described by a ``PackedSeqParams`` carrying that
group. In your own script::

    from megatron_cg_plugin.data import get_hybrid_cp_batch

    session = megatron_cg_plugin.install()  # its config: the --cg-* flags, or the config given to install

    def forward_step(data_iterator, model):
        args = get_args()
        batch, packed = get_hybrid_cp_batch(data_iterator, tokens_per_rank=args.max_seqlen_per_dp_cp_rank,
                                            max_seqs=session.config.thd_capacity)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"], packed_seq_params=packed)
        return output, partial(loss_func, batch["loss_mask"])
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megatron_cg_plugin.banks.cp_packs import ensure_dynamic_cp_stream, packed_seq_params
from megatron_cg_plugin.packed.layout import fixed_capacity_layout, partitioned_indices

__all__ = ["SAMPLE_KEYS", "get_hybrid_cp_batch", "pack_hybrid_cp_sample"]

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _cp_size_of(sample: Mapping[str, Any]) -> int:
    """The CP size the hybrid-CP scheduler picked for ``sample`` (checking it is such a sample)."""
    missing = [key for key in (*SAMPLE_KEYS, "local_cp_size") if key not in sample]
    if missing:
        raise KeyError(
            f"a hybrid-CP sample lacks {missing}: feed the iterator Megatron's hybrid-CP loader yields "
            "(--hybrid-context-parallel with --dataloader-inter-document-masking)."
        )
    return int(sample["local_cp_size"])


def pack_hybrid_cp_sample(
    sample: Mapping[str, Any],
    *,
    tokens_per_rank: int,
    max_seqs: int,
    group: Any = None,
    rank: int = 0,
    device: Any = None,
) -> tuple[dict[str, Any], Any]:
    """One hybrid-CP sample as this rank's share of its fixed-capacity THD pack.

    ``group`` is the sample's CP group (``rank`` this rank's place in it); both matter only when
    ``sample["local_cp_size"] > 1``. Returns the batch (``[1, tokens / cp]`` tensors, no attention
    mask) and its ``PackedSeqParams``. Raises ``packed.layout.ThdCapacityError`` naming the flag to
    raise when the document does not fit."""
    size = _cp_size_of(sample)
    length = int(sample["tokens"].numel())
    layout = fixed_capacity_layout([length], size, tokens_per_rank, max_seqs)
    device = sample["tokens"].device if device is None else torch.device(device)
    batch: dict[str, Any] = {}
    for key in SAMPLE_KEYS:
        value = sample[key].reshape(-1).to(device, non_blocking=True)
        padded = torch.zeros(layout.tokens, dtype=value.dtype, device=device)
        padded[:length] = value
        batch[key] = padded
    if size > 1:
        index = torch.tensor(partitioned_indices(layout.cu_seqlens_padded, size, rank), device=device)
        batch = {key: value.index_select(0, index) for key, value in batch.items()}
    batch = {key: value.unsqueeze(0) for key, value in batch.items()}
    batch["attention_mask"] = None
    cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32, device=device)
    cu_padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device=device)
    return batch, packed_seq_params(cu, cu_padded, size, group, layout.max_seqlen)


def get_hybrid_cp_batch(
    data_iterator: Iterator[Mapping[str, Any]], *, tokens_per_rank: int, max_seqs: int = 8
) -> tuple[dict[str, Any], Any]:
    """The next microbatch of Megatron's hybrid-CP schedule, packed for this rank (on its GPU, with
    the hybrid data-context-parallel group of the sample's CP size). ``tokens_per_rank`` is
    ``--max-seqlen-per-dp-cp-rank``, ``max_seqs`` the run config's ``thd_capacity``
    (``--cg-thd-max-seqs``: what graph banks were captured for; any value >= 1 without banks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    ensure_dynamic_cp_stream()  # eager hybrid CP at static CP 1 needs it as much as graphs
    sample = next(data_iterator)
    size = _cp_size_of(sample)
    group = parallel_state.get_hybrid_data_context_parallel_groups(group_size=size) if size > 1 else None
    rank = dist.get_rank(group) if group is not None else 0
    return pack_hybrid_cp_sample(
        sample,
        tokens_per_rank=tokens_per_rank,
        max_seqs=max_seqs,
        group=group,
        rank=rank,
        device=torch.device("cuda", torch.cuda.current_device()),
    )
