"""Dynamic-CP graph banks on Megatron TransformerLayers: one bank per CP size, one shared pool.

Under hybrid context parallelism each packed (THD) microbatch runs with its own power-of-two CP size
and the process group of that size. ``capture_banks`` captures, for every graphed layer, one graph
per CP size (a *bank*) with the real group of that size, all into one memory pool through the
slot-shared capture (``capture.slotted``): the banks are mutually exclusive variants of the layer,
so they share arenas and boundary storage sized by the largest instead of adding up. The layer
class comes from ``banked_layer_class`` (injected through the layer spec, no class is patched): a
call with packed sequences picks the bank from ``PackedSeqParams.local_cp_size``, requires the very
group object the bank was captured with (``banks.BankRouter``, fail closed), checks the THD layout
against the captured capacity (``plan.thd``) and replays; other calls run eagerly.

Graph inputs are the hidden states and the two ``cu_seqlens`` buffers of the fixed-capacity layout;
``max_seqlen`` is bound to the pack size at capture (the eager run uses the same bound).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import torch

from megatron_cg_plugin.banks import BankRouter, GraphBank
from megatron_cg_plugin.diagnostics import ReplayTotals
from megatron_cg_plugin.capture.slotted import SlottedGraphs, Variant, capture_slotted
from megatron_cg_plugin.plan.thd import ThdCapacityError, fixed_capacity_layout

# Layer call arguments a bank replay cannot honour (they are not graph inputs): refused if given.
_UNSUPPORTED = ("attention_mask", "context", "context_mask", "rotary_pos_emb", "rotary_pos_cos",
                "rotary_pos_sin", "rotary_pos_cos_sin", "attention_bias", "inference_context",
                "sequence_len_offset", "padding_mask")


class BankReplayError(RuntimeError):
    """A call of a banked layer that its graphs cannot serve."""


@dataclasses.dataclass(frozen=True)
class ThdCapacity:
    tokens_per_rank: int  # --max-seqlen-per-dp-cp-rank
    max_seqs: int  # --cg-thd-max-seqs

    @property
    def cu_length(self) -> int:
        return self.max_seqs + 2  # leading 0, the sequences, the dummy


def packed_seq_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, group: Any,
                      max_seqlen: int) -> Any:
    """Megatron's ``PackedSeqParams`` for a fixed-capacity THD pack of CP size ``cp_size``: the
    form both the capture and the eager run use."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, local_cp_size=cp_size,
                           cp_group=group if cp_size > 1 else None, pad_between_seqs=True)


def ensure_dynamic_cp_stream() -> None:
    """Megatron creates the side stream TE's CP attention needs (``TEDotProductAttention.cp_stream``)
    only when the static CP size is > 1; hybrid CP switches CP on per microbatch, so eager and
    graphed runs alike need it whatever the static size (without it TE's P2P attention fails on
    ``None.wait_event``). Sets it once; an existing stream is kept."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    if TEDotProductAttention.cp_stream is None:
        TEDotProductAttention.cp_stream = torch.cuda.Stream()


def banked_layer_class(base: type) -> type:
    """A subclass of Megatron's ``TransformerLayer`` class ``base`` whose training calls with packed
    sequences replay the bank of the microbatch's CP size once ``capture_banks`` has run."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        router = vars(self).get("_bank_router")
        params = kwargs.get("packed_seq_params")
        if router is None or params is None or not self.training or not torch.is_grad_enabled():
            return base.__call__(self, *args, **kwargs)
        unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
        if unsupported or len(args) > 1:
            raise BankReplayError(
                f"layer {self.layer_number}: a graph bank replays hidden states and the THD layout only, "
                f"but the call also passes {unsupported or 'extra positional arguments'}; use learned "
                "absolute positions (no RoPE) and no attention mask with --cg-graph-banks for now.")
        hidden_states = args[0] if args else kwargs["hidden_states"]
        bank = router.select(params.local_cp_size, params.cp_group)
        _check_layout(vars(self)["_bank_capacity"], bank.cp_size, params)
        return bank.payload(hidden_states, params.cu_seqlens_q, params.cu_seqlens_q_padded), None

    return type(f"Banked{base.__name__}", (base,), {"__call__": __call__, "__module__": __name__, "graph_banks": True,
                                                     "__doc__": f"{base.__name__} with dynamic-CP graph banks."})


def _check_layout(capacity: ThdCapacity, cp_size: int, params: Any) -> None:
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        tensor = getattr(params, name)
        if tensor is None or tuple(tensor.shape) != (capacity.cu_length,):
            raise ThdCapacityError(
                f"{name} has shape {None if tensor is None else tuple(tensor.shape)} but the banks were "
                f"captured for ({capacity.cu_length},): {capacity.max_seqs} sequences + the padding dummy. "
                "Build packs with plan.thd.fixed_capacity_layout, and raise --cg-thd-max-seqs if more "
                "sequences must fit.")
    if params.cu_seqlens_kv is not params.cu_seqlens_q or params.cu_seqlens_kv_padded is not params.cu_seqlens_q_padded:
        raise BankReplayError("graph banks serve self-attention packs: cu_seqlens_kv must be cu_seqlens_q.")
    bound = cp_size * capacity.tokens_per_rank
    if params.max_seqlen_q is not None and params.max_seqlen_q > bound:
        raise ThdCapacityError(f"max_seqlen {params.max_seqlen_q} exceeds the captured bound {bound} "
                               f"(CP size {cp_size} x --max-seqlen-per-dp-cp-rank {capacity.tokens_per_rank}).")


@dataclasses.dataclass
class BankedLayers:
    """What ``capture_banks`` returns: per layer its router and graphs; ``reset`` frees them."""

    routers: dict[int, BankRouter]
    graphs: dict[int, SlottedGraphs]
    layers: list[Any]

    def report(self) -> dict[str, Any]:
        """Per bank: replays and rejections summed over layers; pool and arena bytes overall."""
        banks: dict[int, dict[str, int]] = {}
        for router in self.routers.values():
            for row in router.report():
                entry = banks.setdefault(row["cp_size"], {"cp_size": row["cp_size"], "replays": 0, "rejected": 0})
                entry["replays"] += row["replays"]
                entry["rejected"] += row["rejected"]
        stats = [g.stats for g in self.graphs.values()]
        return {"banks": list(banks.values()),
                "unknown_size_rejections": sum(r.unknown_size_rejections for r in self.routers.values()),
                "pool_bytes": max((s.pool_bytes for s in stats), default=0),  # one pool shared by all layers
                "arena_bytes": sum(s.arena_bytes for s in stats),
                "boundary_bytes": sum(s.boundary_bytes for s in stats),
                "capture_seconds": sum(s.capture_seconds for s in stats)}

    def replay_counts(self) -> "BankReplayCounts":
        return BankReplayCounts(self)

    def reset(self) -> None:
        for layer in self.layers:
            vars(layer).pop("_bank_router", None)
            vars(layer).pop("_bank_capacity", None)
        for graphs in self.graphs.values():
            graphs.reset()
        self.graphs.clear()


class BankReplayCounts(ReplayTotals):
    """Replay counts per layer, read live from the banks' routers (for the run report)."""

    def __init__(self, banked: BankedLayers) -> None:
        self._routers = [banked.routers[id(layer)] for layer in banked.layers]

    @property
    def counts(self) -> list[int]:
        return [sum(bank.replays for bank in router.banks.values()) for router in self._routers]

    @property
    def rejected(self) -> list[int]:
        return [sum(bank.rejected for bank in router.banks.values()) + router.unknown_size_rejections
                for router in self._routers]


def capture_banks(layers: Iterable[Any], groups: Mapping[int, Any], capacity: ThdCapacity, *,
                  debug: bool = False, warmup_iterations: int = 2) -> BankedLayers:
    """Captures one bank per CP size in ``groups`` (CP size -> its process group; None for 1) for
    every layer (instances of a ``banked_layer_class``), all layers and banks into one pool.

    Every rank of a CP group must call this with the same layers and sizes (the captures of a bank
    communicate). On failure every graph captured so far is reset and no layer is left banked."""
    import torch.distributed as dist

    layers = list(layers)
    sizes = sorted(groups)
    if any(size > 1 for size in sizes):
        ensure_dynamic_cp_stream()
    for size in sizes:
        group = groups[size]
        if size > 1 and (group is None or dist.get_world_size(group) != size):
            raise ValueError(f"the group for CP size {size} has {None if group is None else dist.get_world_size(group)} "
                             "ranks; pass parallel_state.get_hybrid_data_context_parallel_groups(group_size=size).")
    pool = torch.cuda.graph_pool_handle()
    result = BankedLayers({}, {}, layers)
    try:
        for layer in layers:
            # The hidden states a layer gets: [tokens, 1, hidden] in the model's parameter dtype.
            hidden = torch.randn(capacity.tokens_per_rank, 1, layer.config.hidden_size, device="cuda",
                                 dtype=layer.config.params_dtype, requires_grad=True)
            variants = []
            for size in sizes:
                # One sequence filling the pack: a valid layout of the captured shapes (replays bring their own).
                layout = fixed_capacity_layout([size * capacity.tokens_per_rank], size, capacity.tokens_per_rank,
                                               capacity.max_seqs)
                cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32, device="cuda")
                cu_padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device="cuda")

                def forward(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                            layer: Any = layer, size: int = size, bound: int = layout.max_seqlen) -> torch.Tensor:
                    params = packed_seq_params(cu_seqlens, cu_seqlens_padded, size, groups[size], bound)
                    return layer.forward(hidden_states, attention_mask=None, packed_seq_params=params)[0]

                variants.append(Variant(f"cp{size}", forward, (hidden, cu, cu_padded), io_branch="thd"))
            graphs = capture_slotted(variants, 1, layer.parameters(), pool=pool, debug=debug,
                                     warmup_iterations=warmup_iterations)
            result.graphs[id(layer)] = graphs
            result.routers[id(layer)] = BankRouter({size: GraphBank(size, groups[size] if size > 1 else None,
                                                                    payload=graphs.callable(f"cp{size}", 0))
                                                    for size in sizes})
    except BaseException:
        result.reset()
        raise
    for layer in layers:
        vars(layer)["_bank_router"] = result.routers[id(layer)]
        vars(layer)["_bank_capacity"] = capacity
    return result
