"""Dynamic-CP graph banks on Megatron TransformerLayers: one bank per CP size, one shared pool.

Under hybrid context parallelism each packed (THD) microbatch runs with its own power-of-two CP size
and the process group of that size. ``capture_banks`` captures, for every graphed layer, Megatron's
own capture callable (``TransformerLayer._te_cuda_graph_capture``, which honours
``--cuda-graph-modules``) into one memory pool through the slot-shared capture
(``slot_sharing.capture``): the banks are mutually exclusive variants of the layer, so they share arenas
and boundary storage sized by the largest instead of adding up.

- Scopes with attention (the whole layer, ``attn``, ``attn mlp``): one graph per CP size, captured
  with the real group of that size; graph inputs are the hidden states and the two ``cu_seqlens``
  buffers of the fixed-capacity layout; ``max_seqlen`` and the RoPE table are bound per CP size at
  capture (the eager run uses the same bound, ``packed.layout``).
- Scopes without attention (``mlp``): the graphed part never sees the CP layout (tokens per rank
  are fixed), so one graph serves every CP size; attention runs eagerly with the microbatch's group.
- A graphed MoE block (``moe``, drop-and-pad): the token dispatcher keeps per-forward state on its
  attributes (Megatron's ``cudagraph_attrs``), which would outlive the graph and which the
  slot-shared capture refuses (``SlotCoverageError``); the capture clears those attributes as the
  forward returns (``capture.scratch``), so that state stays a temporary inside the graph.
- Partial MoE scopes (``moe_router``, ``moe_preprocess``: dropless MoE) end the graph inside the MoE
  block and hand routing state to its eager rest. Megatron's MoE forward returns there only while
  its capture flag is set, which the banks' capture sets as Megatron's own capture does
  (``megatron_capturing``). The routing tensors are graph outputs, which Megatron's replay path sets
  back on the dispatcher, so they are the replayed bank's. The shapes the preprocess keeps in Python
  (``_PREPROCESS_SHAPES``) are no graph outputs: Megatron's own path leaves them on the dispatcher
  from its capture on, but the banks' capture clears ``hidden_shape`` with the rest of the
  dispatcher's ``cudagraph_attrs`` (``capture.scratch``), and an eager forward of another shape (an
  evaluation step) would leave its own. So each bank records them at its capture, before the
  clearing, and puts them back before each of its replays (``BankGraph.dispatcher_state``). Not run
  on GPUs yet, so the ``banks-scope`` rule still refuses these scopes on the command line.

The layer class comes from ``banked_layer_class`` (injected through the layer spec, no class is
patched): a training call with packed sequences picks the bank from ``PackedSeqParams.local_cp_size``,
requires the very group object the bank was captured with (``banks.router.BankRouter``, fail closed), checks
the THD layout against the captured capacity and hands the bank's graph to Megatron's own replay
path (``_te_cuda_graph_replay``): its scope-specific post-processing and the delayed offload flush
(``--delay-offload-until-cuda-graph``) run after each bank replay as after any TE graph replay.
Other calls run eagerly. With Megatron's fine-grained offload flags, the offloaded modules inside the
graphed scope are offloaded inside the bank graphs, to pinned host arenas keyed like the GPU arenas
(``slot_sharing.offload_groups.MegatronOffload``); Megatron's own offload keeps the modules outside.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from megatron_cg_plugin import foreign_state
from megatron_cg_plugin.banks.cp_packs import ensure_dynamic_cp_stream, packed_seq_params
from megatron_cg_plugin.banks.router import BankRouter, GraphBank
from megatron_cg_plugin.capture.accounting import ReplayTotals
from megatron_cg_plugin.capture.scratch import clear, clearing, ends_inside_moe_block, moe_dispatcher_scratch
from megatron_cg_plugin.capture.step_marks import StepMarks
from megatron_cg_plugin.compat import check_parameters
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.packed.layout import ThdCapacityError, fixed_capacity_layout
from megatron_cg_plugin.scopes import attention_in_graph, module_names
from megatron_cg_plugin.slot_sharing.capture import SlottedGraphs, Variant, capture_slotted
from megatron_cg_plugin.slot_sharing.offload_groups import (
    MegatronOffload,
    OffloadCopies,
    delayed_offload_groups,
    still_queued,
)
from megatron_cg_plugin.slot_sharing.plan import exclusive_plan

__all__ = [
    "BankGraph",
    "BankReplayError",
    "BankedLayers",
    "LayerBanks",
    "ThdCapacity",
    "bank_capture_call",
    "bank_rope_tables",
    "banked_layer_class",
    "capture_banks",
    "megatron_capturing",
]

# What an MoE token dispatcher keeps in Python, not in tensors, from its preprocess (megatron-core 0.19.2,
# alltoall: token_dispatcher.py l.635, l.658; allgather: l.272, l.306), which a moe_preprocess graph's
# replay therefore does not set; the eager rest after the replay reads it (alltoall: l.887, l.894).
_PREPROCESS_SHAPES = ("hidden_shape", "hidden_shape_before_permute")

# Layer call arguments a bank replay cannot honour (they are not graph inputs): refused if given.
_UNSUPPORTED = (
    "attention_mask",
    "context",
    "context_mask",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "rotary_pos_cos_sin",
    "attention_bias",
    "inference_context",
    "sequence_len_offset",
    "padding_mask",
)


class BankReplayError(RuntimeError):
    """A call of a banked layer that its graphs cannot serve."""


@dataclasses.dataclass(frozen=True)
class ThdCapacity:
    tokens_per_rank: int  # --max-seqlen-per-dp-cp-rank
    max_seqs: int  # --cg-thd-max-seqs

    @property
    def cu_length(self) -> int:
        return self.max_seqs + 2  # leading 0, the sequences, the dummy


class BankGraph:
    """One bank's graph and the inputs it binds besides the hidden states: the THD layout and, when
    captured with RoPE, the rotary table of the bank's ``max_seqlen`` bound."""

    def __init__(
        self,
        replay: Callable[..., Any],
        *,
        takes_layout: bool,
        rope_table: torch.Tensor | None,
        dispatcher_state: dict[str, Any] | None = None,
    ) -> None:
        self._replay = replay
        self.takes_layout = takes_layout
        self.rope_table = rope_table  # held for the graph's lifetime: the graph reads it in place
        # A moe_preprocess graph: the dispatcher's PREPROCESS_SHAPES as this bank's capture left them.
        self.dispatcher_state = dispatcher_state or {}

    def restore_dispatcher(self, layer: Any) -> None:
        """Before a replay: the dispatcher's Python state as the replayed preprocess would leave it."""
        for name, value in self.dispatcher_state.items():
            assert value is not None, f"the capture recorded no {name}"  # recorded before capture.scratch clears it
            setattr(layer.mlp.token_dispatcher, name, value)

    def bind(self, params: Any, rope: torch.Tensor | None) -> Callable[..., tuple]:
        """The callable Megatron's replay path calls with the hidden states (and keyword arguments
        such as ``is_first_microbatch`` that only FP8 weight caching reads; banks run without FP8)."""
        extra: tuple[torch.Tensor, ...] = ()
        if self.takes_layout:
            self._load_rope(rope)
            extra = (params.cu_seqlens_q, params.cu_seqlens_q_padded)

        def replay(hidden_states: torch.Tensor, **_: Any) -> tuple:
            outputs = self._replay(hidden_states, *extra)
            return outputs if isinstance(outputs, tuple) else (outputs,)

        return replay

    def _load_rope(self, rope: torch.Tensor | None) -> None:
        if (rope is None) != (self.rope_table is None):
            raise BankReplayError(
                f"the bank was captured {'without' if self.rope_table is None else 'with'} a RoPE table but the call "
                f"passes {'one' if rope is not None else 'none'}: capture and training must use the same "
                "--position-embedding-type."
            )
        if rope is None or rope is self.rope_table:  # the model's cached table: nothing to copy
            return
        table = self.rope_table
        assert table is not None  # checked above: a call with a table goes to a bank captured with one
        if rope.shape != table.shape or rope.dtype != table.dtype:
            raise ThdCapacityError(
                f"rotary table {tuple(rope.shape)} {rope.dtype} but the bank was captured with "
                f"{tuple(table.shape)} {table.dtype}: the pack's max_seqlen must be its bound, "
                "CP size x --max-seqlen-per-dp-cp-rank (packed.layout.fixed_capacity_layout), "
                "in eager and graphed runs."
            )
        table.copy_(rope)


@dataclasses.dataclass
class LayerBanks:
    """What a banked layer holds once captured: its router, the capacity and the scope."""

    router: BankRouter
    capacity: ThdCapacity
    attention: bool

    def replay(self, layer: Any, base: type[Any], args: tuple, kwargs: dict) -> Any:
        unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
        if unsupported or len(args) > 1:
            raise BankReplayError(
                f"layer {layer.layer_number}: a graph bank replays hidden states, the THD layout and the RoPE "
                f"table only, but the call also passes {unsupported or 'extra positional arguments'}; train "
                "without attention masks or biases (packed sequences carry the layout) with --cg-graph-banks."
            )
        hidden_states = args[0] if args else kwargs.pop("hidden_states")
        params = kwargs["packed_seq_params"]
        bank = self.router.select(params.local_cp_size, params.cp_group)
        if self.attention:
            _check_layout(self.capacity, bank.cp_size, params)
            graph = bank.payload.bind(params, kwargs.get("rotary_pos_emb"))
            kwargs = {}  # the layout and the table are graph inputs now; Megatron's replay takes tensors only
        else:
            graph = bank.payload.bind(params, None)  # Megatron runs attention eagerly with kwargs
        bank.payload.restore_dispatcher(layer)
        # Megatron's replay path calls ``self.cuda_graphs[i]``: for this call it holds the bank's graph.
        try:
            with foreign_state.setting(layer, "cuda_graphs", [graph], change="bank-replay-cuda-graphs"):
                waiting = delayed_offload_groups(layer.config)
                output = base._te_cuda_graph_replay(layer, hidden_states, **kwargs)
            _check_flushed(layer, waiting)
            bank.offload_groups_flushed += len(waiting)
            return output
        finally:
            # A graph that ends inside the MoE block hands its outputs to the eager rest through this store,
            # which Megatron empties only after a rest that did not raise; a full store would feed later
            # forwards stale tensors.
            store = getattr(getattr(layer, "mlp", None), "cudagraph_tensor_store", None)
            if store is not None:
                store.clear()


def _check_flushed(layer: Any, waiting: list[Any]) -> None:
    """Every group waiting before a bank replay must be gone after it: Megatron's replay path
    flushes the queue after the graph (groups the eager rest of the layer delays may follow)."""
    left = still_queued(waiting, delayed_offload_groups(layer.config)) if waiting else []
    if left:
        raise BankReplayError(
            f"layer {layer.layer_number}: {len(left)} of the {len(waiting)} offload groups delayed until this graph "
            "replay are still queued after it: Megatron's replay path (TransformerLayer._te_cuda_graph_replay) "
            "did not flush them, so their activations would stay on the GPU; this megatron-core release handles "
            "the delayed flush differently: train without --delay-offload-until-cuda-graph."
        )


def banked_layer_class(base: type) -> type:
    """A subclass of Megatron's ``TransformerLayer`` class ``base`` whose training calls with packed
    sequences replay the bank of the microbatch's CP size once ``capture_banks`` has run. A banked
    class is returned as it is (block specs list one layer spec object once per layer)."""
    if getattr(base, "graph_banks", False):
        return base

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        banks = vars(self).get("_graph_banks")
        if banks is None or kwargs.get("packed_seq_params") is None or not self.training or not torch.is_grad_enabled():
            return base.__call__(self, *args, **kwargs)
        return banks.replay(self, base, args, kwargs)

    return type(
        f"Banked{base.__name__}",
        (base,),
        {
            "__call__": __call__,
            "__module__": __name__,
            "graph_banks": True,
            "__doc__": f"{base.__name__} with dynamic-CP graph banks.",
        },
    )


def _check_layout(capacity: ThdCapacity, cp_size: int, params: Any) -> None:
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        tensor = getattr(params, name)
        if tensor is None or tuple(tensor.shape) != (capacity.cu_length,):
            raise ThdCapacityError(
                f"{name} has shape {None if tensor is None else tuple(tensor.shape)} but the banks were "
                f"captured for ({capacity.cu_length},): {capacity.max_seqs} sequences + the padding dummy. "
                "Build packs with packed.layout.fixed_capacity_layout, and raise --cg-thd-max-seqs if more "
                "sequences must fit."
            )
    if params.cu_seqlens_kv is not params.cu_seqlens_q or params.cu_seqlens_kv_padded is not params.cu_seqlens_q_padded:
        raise BankReplayError("graph banks serve self-attention packs: cu_seqlens_kv must be cu_seqlens_q.")
    bound = cp_size * capacity.tokens_per_rank
    if params.max_seqlen_q is not None and params.max_seqlen_q > bound:
        raise ThdCapacityError(
            f"max_seqlen {params.max_seqlen_q} exceeds the captured bound {bound} "
            f"(CP size {cp_size} x --max-seqlen-per-dp-cp-rank {capacity.tokens_per_rank})."
        )


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
                entry = banks.setdefault(row["cp_size"], dict.fromkeys(row, 0) | {"cp_size": row["cp_size"]})
                for key in row.keys() - {"cp_size"}:
                    entry[key] += row[key]
        stats = [g.stats for g in self.graphs.values()]
        return {
            "banks": list(banks.values()),
            "unknown_size_rejections": sum(r.unknown_size_rejections for r in self.routers.values()),
            "pool_bytes": max((s.pool_bytes for s in stats), default=0),  # one pool shared by all layers
            "arena_bytes": sum(s.arena_bytes for s in stats),
            "boundary_bytes": sum(s.boundary_bytes for s in stats),
            "retained_bytes": sum(s.retained_bytes for s in stats),  # pool blocks still allocated after capture
            "capture_seconds": sum(s.capture_seconds for s in stats),
        }

    @property
    def graph_count(self) -> int:
        return sum(g.stats.graphs for g in self.graphs.values())

    def replay_counts(self) -> _BankReplayCounts:
        return _BankReplayCounts(self)

    def reset(self) -> None:
        for layer in self.layers:
            vars(layer).pop("_graph_banks", None)
        for graphs in self.graphs.values():
            graphs.reset()
        self.graphs.clear()


class _BankReplayCounts(ReplayTotals):
    """Replay counts per layer, read live from the banks' routers (for the run report)."""

    def __init__(self, banked: BankedLayers) -> None:
        self._routers = [banked.routers[id(layer)] for layer in banked.layers]

    @property
    def counts(self) -> list[int]:
        return [sum(bank.replays for bank in router.banks.values()) for router in self._routers]

    @property
    def rejected(self) -> list[int]:
        return [
            sum(bank.rejected for bank in router.banks.values()) + router.unknown_size_rejections
            for router in self._routers
        ]


def capture_banks(
    layers: Iterable[Any],
    groups: Mapping[int, Any],
    capacity: ThdCapacity,
    *,
    rope_tables: Mapping[int, torch.Tensor] | None = None,
    debug: bool = False,
    warmup_iterations: int = 2,
    contract_check: ContractCheck = ContractCheck.FULL,
    step_marks: StepMarks | None = None,
    offload: bool = True,
    offload_copies: OffloadCopies | str = OffloadCopies(),
) -> BankedLayers:
    """Captures, for every layer (instances of a ``banked_layer_class``), one bank per CP size in
    ``groups`` (CP size -> its process group; None for 1), all layers and banks into one pool.

    ``rope_tables``: per CP size, the RoPE table the model passes for a pack of that size (its
    ``rotary_pos_emb`` of the pack's ``max_seqlen``); None without RoPE. Every rank of a CP group
    must call this with the same layers and sizes (the captures of a bank communicate). ``debug``,
    ``warmup_iterations``, ``contract_check`` and ``step_marks`` go to ``capture_slotted``. With ``offload`` the
    modules Megatron's fine-grained offload flags name inside the graphed scope go to pinned host
    arenas (``slot_sharing.offload_groups.MegatronOffload``), copied between replays through one staging
    ring for all layers or inside the graphs (``offload_copies``). On failure every
    graph captured so far is reset and no layer is left banked."""
    layers = list(layers)
    sizes = sorted(groups)
    _validate_bank_capture(layers, groups, sizes, rope_tables)
    scratch = _prepare_bank_capture(layers, sizes)
    # One pool and one capture stream for all layers (the allocator reuses pool blocks per stream).
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    result = BankedLayers({}, {}, layers)
    megatron_offload = MegatronOffload.from_config(layers[0].config, layers, offload=offload) if layers else None
    offload_copies = OffloadCopies.given(offload_copies)
    ring = offload_copies.staging_ring()
    try:
        with (
            megatron_offload.capturing() if megatron_offload is not None else contextlib.nullcontext(),
            megatron_capturing(layers),
        ):
            for layer in layers:
                _capture_layer_banks(
                    layer,
                    sizes,
                    groups,
                    capacity,
                    rope_tables,
                    scratch[id(layer)],
                    result,
                    pool=pool,
                    stream=stream,
                    debug=debug,
                    warmup_iterations=warmup_iterations,
                    contract_check=contract_check,
                    step_marks=step_marks,
                    offload=None
                    if megatron_offload is None
                    else megatron_offload.slot_offload(layer, ring, offload_copies.window),
                )
    except BaseException:
        result.reset()
        raise
    for layer in layers:  # banked only once every layer's banks exist
        vars(layer)["_graph_banks"] = LayerBanks(
            result.routers[id(layer)], capacity, attention_in_graph(layer.config.cuda_graph_modules)
        )
    return result


def bank_rope_tables(model: Any, groups: Mapping[int, Any], capacity: ThdCapacity) -> dict[int, Any] | None:
    """Per CP size, the RoPE table ``model`` passes for a pack of that size: the very call
    ``GPTModel.forward`` makes (its result is cached, so replays usually bring this object). None
    for a model without RoPE."""
    from megatron.core.utils import get_attr_wrapped_model

    try:
        model = get_attr_wrapped_model(model, "position_embedding_type", return_model_obj=True)
    except RuntimeError:  # not a GPT-style model: no position embedding of its own
        return None
    if model.position_embedding_type != "rope":
        return None
    return {
        size: model.rotary_pos_emb(size * capacity.tokens_per_rank, packed_seq=True, cp_group=group)
        for size, group in groups.items()
    }


def _validate_bank_capture(
    layers: list[Any], groups: Mapping[int, Any], sizes: list[int], rope_tables: Mapping[int, torch.Tensor] | None
) -> None:
    """Everything ``capture_banks`` refuses, before anything is captured (``ValueError`` naming the fix)."""
    import torch.distributed as dist

    for layer_class in {type(layer) for layer in layers}:  # the call the banks' capture makes
        check_parameters(
            layer_class._forward_attention,
            ("attention_mask", "rotary_pos_emb", "packed_seq_params"),
            where=f"{layer_class.__name__}._forward_attention",
        )
    not_te = [layer.layer_number for layer in layers if layer.config.cuda_graph_impl != "transformer_engine"]
    if not_te:
        raise ValueError(
            f"layers {not_te} were built without cuda_graph_impl='transformer_engine'; banks replay "
            "through Megatron's TE graph path: pass --cuda-graph-impl transformer_engine (or set it "
            "in the TransformerConfig)."
        )
    for size in sizes:
        group = groups[size]
        if size > 1 and (group is None or dist.get_world_size(group) != size):
            raise ValueError(
                f"the group for CP size {size} has {None if group is None else dist.get_world_size(group)} "
                "ranks; pass parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)."
            )
    evaluating = [layer.layer_number for layer in layers if ends_inside_moe_block(layer) and not layer.training]
    if evaluating:  # the MoE forward returns inside the block only in training (moe_utils.maybe_raise_signal)
        raise ValueError(
            f"layers {evaluating} are in eval mode; their graphs end inside the MoE block only in "
            "training: call model.train() before capture_banks."
        )
    if rope_tables is not None and set(rope_tables) != set(sizes):
        raise ValueError(f"rope_tables has CP sizes {sorted(rope_tables)} but banks are captured for {sizes}.")


@contextlib.contextmanager
def megatron_capturing(layers: list[Any]) -> Any:
    """Megatron's capture flag, set while banks of layers whose graph ends inside the MoE block are
    captured: the MoE forward returns after the router or the dispatcher's preprocess only under it
    (``moe_utils.maybe_raise_signal``), as in Megatron's own capture (``_start_capturing``)."""
    if not any(ends_inside_moe_block(layer) for layer in layers):
        yield
        return
    from megatron.core.transformer import cuda_graphs

    with foreign_state.setting(cuda_graphs, "_IS_GRAPH_CAPTURING", True, change="megatron-capture-flag"):
        yield


def _recording_dispatcher(fn: Callable[..., Any], layer: Any, state: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` that leaves in ``state`` the dispatcher's ``_PREPROCESS_SHAPES`` after each call (the
    capture's is the last); ``fn`` itself where the graph does not hold the preprocess."""
    if not (ends_inside_moe_block(layer) and "moe_preprocess" in module_names(layer.config.cuda_graph_modules)):
        return fn
    dispatcher = layer.mlp.token_dispatcher

    def call(*args: Any, **kwargs: Any) -> Any:
        outputs = fn(*args, **kwargs)
        state.update({name: getattr(dispatcher, name) for name in _PREPROCESS_SHAPES if hasattr(dispatcher, name)})
        return outputs

    return call


def bank_capture_call(layer: Any, scratch: tuple, state: dict[str, Any]) -> Callable[..., Any]:
    """Megatron's capture callable for one bank: a graphed MoE block's dispatcher state stays inside
    the graph (``scratch`` cleared as the forward returns), the preprocess's Python state recorded
    into ``state`` before that clearing."""
    return clearing(_recording_dispatcher(layer._te_cuda_graph_capture, layer, state), scratch)


def _prepare_bank_capture(layers: list[Any], sizes: list[int]) -> dict[int, Any]:
    """The CP side stream, and each layer's MoE dispatcher scratch cleared: the last eager step's
    dispatcher state keeps that step's autograd graph, which reaches the parameters of every layer
    before it (``capture.scratch``). Returns the scratch attributes per layer (by id)."""
    if any(size > 1 for size in sizes):
        ensure_dynamic_cp_stream()
    scratch = {id(layer): moe_dispatcher_scratch(layer) for layer in layers}
    for attributes in scratch.values():
        clear(attributes)
    return scratch


def _capture_layer_banks(
    layer: Any,
    sizes: list[int],
    groups: Mapping[int, Any],
    capacity: ThdCapacity,
    rope_tables: Mapping[int, torch.Tensor] | None,
    scratch: Any,
    result: BankedLayers,
    *,
    pool: Any,
    **capture_options: Any,
) -> None:
    """One layer's banks in the shared ``pool``: a graph per CP size when attention is graphed,
    else one graph for every size. Its graphs go into ``result`` as soon as they exist (so a later
    failure resets them), then its router."""
    # The hidden states a layer gets: [tokens, 1, hidden] in the model's parameter dtype.
    hidden = torch.randn(
        capacity.tokens_per_rank,
        1,
        layer.config.hidden_size,
        device="cuda",
        dtype=layer.config.params_dtype,
        requires_grad=True,
    )
    attention = attention_in_graph(layer.config.cuda_graph_modules)
    states: dict[int | None, dict[str, Any]] = {size: {} for size in (sizes if attention else [None])}
    variants = (
        [
            _attention_variant(
                bank_capture_call(layer, scratch, states[size]),
                size,
                groups[size],
                capacity,
                hidden,
                None if rope_tables is None else rope_tables[size],
            )
            for size in sizes
        ]
        if attention
        else [Variant("any-cp", bank_capture_call(layer, scratch, states[None]), (hidden,))]
    )
    graphs = result.graphs[id(layer)] = capture_slotted(
        variants, exclusive_plan([v.name for v in variants]), layer, pool=pool, **capture_options
    )

    def payload(size: int) -> BankGraph:
        if not attention:  # one graph for every CP size
            return BankGraph(
                graphs.callable("any-cp", 0), takes_layout=False, rope_table=None, dispatcher_state=states[None]
            )
        return BankGraph(
            graphs.callable(f"cp{size}", 0),
            takes_layout=True,
            rope_table=None if rope_tables is None else rope_tables[size],
            dispatcher_state=states[size],
        )

    result.routers[id(layer)] = BankRouter(
        {size: GraphBank(size, groups[size] if size > 1 else None, payload=payload(size)) for size in sizes}
    )


def _attention_variant(
    capture: Callable[..., Any],
    size: int,
    group: Any,
    capacity: ThdCapacity,
    hidden: torch.Tensor,
    rope_table: torch.Tensor | None,
) -> Variant:
    """The bank of CP size ``size``: Megatron's capture callable ``capture`` on a pack of that size."""
    # One sequence filling the pack: a valid layout of the captured shapes (replays bring their own).
    layout = fixed_capacity_layout([size * capacity.tokens_per_rank], size, capacity.tokens_per_rank, capacity.max_seqs)
    cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32, device="cuda")
    cu_padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device="cuda")

    def forward(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> Any:
        params = packed_seq_params(cu_seqlens, cu_seqlens_padded, size, group, layout.max_seqlen)
        return capture(hidden_states, attention_mask=None, packed_seq_params=params, rotary_pos_emb=rope_table)

    return Variant(f"cp{size}", forward, (hidden, cu, cu_padded), io_branch="thd")
