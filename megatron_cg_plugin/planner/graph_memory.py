"""Graph private-pool bytes predicted from the model's shapes, before any GPU is used (pure Python).

A TE-graphed Transformer layer allocates, during capture, what its forward saves for backward,
its outputs, and the backward's gradients and workspaces, all in the graph pool. This module writes
each graphed scope down as the program of allocations and frees that Megatron 0.19.2's TE layers
make under capture (read from allocator traces of real captures on an H200: ``docs/performance.md``),
with sizes from the shapes, and replays the program through the caching allocator's rules
(``planner.allocator``): the pool reserves its segments, so rounding and fragmentation are counted.

What it covers: PP = 1 with one graph per layer (Megatron's TE path), dense layers (LayerNorm or
RMSNorm, GELU or SwiGLU, with or without bias, RoPE, GQA, hidden dropout) and MoE layers with the
drop-and-pad or the router/preprocess scope (whose graph holds the shared experts, computed before
routing), bf16 or FP8 with delayed or tensorwise scaling (the
dense layers' quantized GEMM inputs and gradients, FP8 dot-product attention; read from allocator
traces of TE's capture). What it leaves out is said by ``GraphMemoryPlan.unpredicted``.

Which term comes from which measurement: cuDNN's attention workspace (``attention_workspace``) and the
dense programs from allocator traces of dense models at hidden 1024 and 2048; the FP8 quantize buffers
from traces of the FP8 farm cases; the MoE terms from traces of a 16-expert top-2 model; the bias
gradients' column sums (``planner.reduction``) from ATen's reduce-kernel arithmetic, checked against the
2048-token traces and the 4096-token trace of the 5 x 2048 FP8 slot case.

``--cg-slot-capture`` (``plan_slot_memory``) runs the same programs another way: everything a
forward leaves for its backward is copied into the layer's arena, and every graph boundary and
parameter gradient lives in buffers outside the pool (``slot_sharing.capture``), so each graph's pool
blocks are free again when its capture ends and the pool is sized by the largest graph. The arena
is what the forward program keeps alive past its end, less the graph's output, plus the graph's
input (the first norm saves it), attention's cu_seqlens and RoPE's frequencies, each storage
aligned as the arenas align them (``slot_sharing.plan.arena_aligned``); the saves in-graph offload moves
go to the host instead.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterator, Sequence

from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.moe.capacity import capacity_plan
from megatron_cg_plugin.planner.allocator import PoolModel
from megatron_cg_plugin.planner.capture_plan import plan_capture, required_setting
from megatron_cg_plugin.planner.reduction import column_sum_workspace
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.slot_sharing.offload_plan import (
    MEGATRON_MIN_OFFLOADED_TENSOR_SIZE,
    OffloadPolicy,
    OffloadStack,
    Save,
)
from megatron_cg_plugin.slot_sharing.plan import arena_aligned

__all__ = [
    "GraphMemoryPlan",
    "LayerShape",
    "MoeShape",
    "attention_workspace",
    "fp8_attention_saves",
    "fp8_quantized_saves",
    "plan_for_run",
    "plan_graph_memory",
    "plan_slot_memory",
    "scope_parts",
    "staging_ring_bytes",
    "thd_buffer_bytes",
]

_BF16 = 2
_FP32 = _INT32 = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeShape:
    experts: int  # local experts
    topk: int
    ffn: int  # --moe-ffn-hidden-size
    rows: int  # token rows the experts see: E x capacity with drop-and-pad, tokens x top-k dropless
    shared_ffn: int = 0  # --moe-shared-expert-intermediate-size
    # Megatron computes the shared experts before routing (MoELayer.shared_experts_compute), so a router graph
    # holds them too, their output one of its outputs; with --moe-shared-expert-overlap the dispatcher runs them.
    shared_overlap: bool = False
    router_fp32: bool = False
    router_experts: int | None = None  # the router's output width, every expert (EP splits only the experts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One rank's view of a Transformer layer for one microbatch."""

    seq: int  # tokens of a sequence on this rank (seq / CP)
    micro_batch: int
    hidden: int
    ffn: int
    heads: int  # attention heads on this rank (/ TP)
    query_groups: int  # on this rank
    head_dim: int
    gated: bool = False  # SwiGLU
    bias: bool = True
    rmsnorm: bool = False
    rope: bool = False
    rotary_dim: int | None = None  # RoPE's table width: head_dim x --rotary-percent (None: head_dim)
    hidden_dropout: bool = False
    deterministic: bool = True  # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: cuDNN's deterministic backward
    moe: MoeShape | None = None
    fp8_recipe: str | None = None  # --fp8-recipe of this layer (None: bf16, also a --first-last-layers-bf16 layer)
    fp8_attention: bool = False  # TransformerConfig's fp8_dot_product_attention on an FP8 layer (delayed scaling)
    thd_sequences: int | None = None  # packed graphs: --cg-thd-max-seqs, the THD batch cuDNN sees (None: unpacked)

    def __post_init__(self) -> None:
        for name in ("seq", "micro_batch", "hidden", "ffn", "heads", "query_groups", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.thd_sequences is not None and self.thd_sequences < 1:
            raise ValueError(f"thd_sequences must be >= 1, got {self.thd_sequences}.")
        if self.heads % self.query_groups:
            raise ValueError(f"{self.heads} attention heads do not divide into {self.query_groups} query groups.")
        if self.fp8_attention and self.fp8_recipe != "delayed":
            raise ValueError(
                "the planner models FP8 dot-product attention on a delayed-scaling FP8 layer only "
                f"(--fp8-recipe delayed), not with fp8_recipe={self.fp8_recipe!r}."
            )

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    def act(self, width: int, itemsize: int = _BF16) -> int:
        """Bytes of a [tokens, width] activation."""
        return self.tokens * width * itemsize


class _Program:
    """Allocations and frees in capture order; names are unique per graph."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.ops: list[tuple[str, str, int]] = []

    def alloc(self, name: str, nbytes: int) -> None:
        if nbytes > 0:
            self.ops.append(("alloc", self.prefix + name, nbytes))

    def free(self, *names: str) -> None:
        self.ops += [("free", self.prefix + name, 0) for name in names]

    def temp(self, name: str, nbytes: int) -> None:
        self.alloc(name, nbytes)
        self.free(name)


def _quantized(p: _Program, s: LayerShape, name: str, width: int, *, keep_columnwise: bool = True) -> None:
    """An FP8 GEMM input as TE 2.20.2 makes it: a row-wise copy for the forward GEMM, freed once the
    GEMM's output exists (``_gemm_done``), and a column-wise copy that backward keeps for the
    weight gradient; 1 byte an element each."""
    p.alloc(f"{name}.row", s.tokens * width)
    if keep_columnwise:
        p.alloc(f"{name}.col", s.tokens * width)


def _gemm_done(p: _Program, s: LayerShape, name: str) -> None:
    if s.fp8_recipe is not None:
        p.free(f"{name}.row")


def _norm_forward(p: _Program, s: LayerShape, name: str, *, feeds_fp8_gemm: bool = False) -> None:
    """A norm, fused into the linear after it (TE's LayerNormLinear); into an FP8 GEMM the fused
    kernel writes the output quantized (current scaling also writes a bf16 copy for its amax, freed
    at once)."""
    p.alloc(f"{name}.rsigma", s.tokens * _FP32)
    if not s.rmsnorm:
        p.alloc(f"{name}.mu", s.tokens * _FP32)
    if feeds_fp8_gemm and s.fp8_recipe is not None:
        _quantized(p, s, f"{name}.out", s.hidden)
        if s.fp8_recipe != "delayed":
            p.temp(f"{name}.out.bf16", s.act(s.hidden))
    else:
        p.alloc(f"{name}.out", s.act(s.hidden))
    p.temp(f"{name}.flag", 1)


def _norm_backward(p: _Program, s: LayerShape, name: str, grad: str) -> str:
    """TE's fused norm + linear backward: the input gradient, the norm's weight (and bias) grads."""
    p.alloc(f"{name}.dx", s.act(s.hidden))
    p.alloc(f"{name}.dgamma", s.hidden * _BF16)
    if not s.rmsnorm:
        p.alloc(f"{name}.dbeta", s.hidden * _BF16)
    p.temp(f"{name}.scratch", s.act(s.hidden))
    p.free(grad, f"{name}.rsigma", *(() if s.rmsnorm else (f"{name}.mu",)))
    return f"{name}.dx"


def _bda_forward(p: _Program, s: LayerShape, out: str, branch: str) -> None:
    p.alloc(f"{out}.seed", 8)
    if s.hidden_dropout:
        p.alloc(f"{out}.mask", s.tokens * s.hidden)
    p.alloc(out, s.act(s.hidden))
    p.free(branch, f"{out}.seed")


def _bda_backward(p: _Program, s: LayerShape, out: str) -> str:
    p.alloc(f"{out}.grad", s.act(s.hidden))
    p.temp(f"{out}.partial", 4096)
    if s.bias:
        p.alloc(f"{out}.dbias", s.hidden * _BF16)
    if s.hidden_dropout:
        p.free(f"{out}.mask")
    return f"{out}.grad"


def _attention_forward(p: _Program, s: LayerShape) -> None:
    q_width, kv_width = s.heads * s.head_dim, s.query_groups * s.head_dim
    q, kv = s.act(q_width), s.act(kv_width)
    _norm_forward(p, s, "ln1", feeds_fp8_gemm=True)
    p.alloc("qkv", q + 2 * kv)
    _gemm_done(p, s, "ln1.out")
    if s.rope:  # TE's fused RoPE writes q and k anew; the layout check makes v contiguous
        p.alloc("q", q)
        p.alloc("k", kv)
        p.alloc("v", kv)
    if s.fp8_attention:  # q, k and v combined in bf16, quantized into one FP8 storage; the output in FP8 and in bf16
        p.alloc("qkv.combined", q + 2 * kv)
        p.alloc("qkv.fp8", s.tokens * (q_width + 2 * kv_width))
        p.free("qkv.combined")
        p.alloc("o.fp8", s.tokens * q_width)
        p.alloc("o", q)
        p.free("v")
    else:
        p.alloc("o", q)
    p.alloc("rng", 16)
    p.temp("fa.scratch", 256)
    p.alloc("softmax_stats", s.micro_batch * s.heads * s.seq * _FP32)
    if s.fp8_recipe is not None:  # current scaling keeps the bf16 output for the projection's backward instead
        _quantized(p, s, "o.in", q_width, keep_columnwise=s.fp8_recipe == "delayed")
    p.alloc("proj", s.act(s.hidden))
    _gemm_done(p, s, "o.in")
    if s.rope:
        p.free("qkv")
    if s.fp8_attention:  # backward reads the FP8 copies
        p.free("q", "k", "o")
    _bda_forward(p, s, "x1", "proj")


def attention_workspace(s: LayerShape) -> int:
    """cuDNN fused attention's backward workspace (measured, TE 2.20.2 on sm_90): the softmax-stat
    gradients, under deterministic mode an s x s bf16 buffer per head, and with GQA the key and
    value gradients expanded to every head. A packed (THD) microbatch's deterministic buffer is
    ``next_pow2(sequences) x heads x tokens^2`` bf16, whatever its longest document: the packed farm cases'
    graph pools at 4096 tokens and 16 heads held 16 GiB at 32 sequences and 32 GiB at 48 (so did
    stock Megatron's eager steps at 18 and 43 documents), and predicted so they are within 0.2%. Fitted
    at micro-batch 1 and 4096 tokens only: the ``tokens^2`` factor is untested elsewhere."""
    nbytes = s.micro_batch * s.heads * s.seq * _FP32 + 256
    if s.deterministic and s.thd_sequences is not None:
        nbytes += (1 << (s.thd_sequences - 1).bit_length()) * s.heads * s.tokens * s.tokens * _BF16
    elif s.deterministic:
        nbytes += s.micro_batch * s.heads * s.seq * s.seq * _BF16
    if s.query_groups < s.heads:
        nbytes += 2 * s.act(s.heads * s.head_dim)
    return nbytes


def _attention_backward(p: _Program, s: LayerShape, grad_in: str) -> str:
    q, kv = s.act(s.heads * s.head_dim), s.act(s.query_groups * s.head_dim)
    grad = _bda_backward(p, s, "x1")
    if s.fp8_recipe is not None:  # the gradient quantized; current scaling quantizes the saved bf16 input too
        _quantized(p, s, "proj.g", s.hidden)
        if s.fp8_recipe != "delayed":
            p.alloc("o.in.col", s.tokens * s.heads * s.head_dim)
    p.alloc("proj.dgrad", s.act(s.hidden))
    p.alloc("proj.wgrad", s.hidden * s.heads * s.head_dim * _BF16)
    p.free(grad, "o.in.col", "proj.g.row", "proj.g.col")
    p.alloc("dq", q)
    p.alloc("dk", kv)
    p.alloc("dv", kv)
    p.temp("fa.workspace", attention_workspace(s))
    p.free("proj.dgrad", "o", "rng", "softmax_stats", "qkv.fp8", "o.fp8")
    if s.rope:
        p.alloc("dq.rope", q)
        p.alloc("dk.rope", kv)
        p.free("dq", "dk", "q", "k", "v")
    p.alloc("dqkv", q + 2 * kv)
    p.free(*(("dq.rope", "dk.rope") if s.rope else ("dq", "dk", "qkv")), "dv")
    if s.fp8_recipe is not None:
        _quantized(p, s, "dqkv.g", (s.heads + 2 * s.query_groups) * s.head_dim)
    if s.bias and s.fp8_recipe not in (None, "delayed"):  # current scaling: TE sums the QKV bias gradient unfused
        p.temp("dqkv.column_sum", column_sum_workspace(s.tokens, (s.heads + 2 * s.query_groups) * s.head_dim))
    p.alloc("ln1.dgrad", s.act(s.hidden))
    p.alloc("qkv.wgrad", (q + 2 * kv) // s.tokens * s.hidden)
    if s.bias:
        p.alloc("qkv.dbias", (q + 2 * kv) // s.tokens)
    p.free("dqkv", "ln1.out", "ln1.out.col", "dqkv.g.row", "dqkv.g.col")
    dx = _norm_backward(p, s, "ln1", "ln1.dgrad")
    p.alloc("dinput", s.act(s.hidden))  # the residual's gradient plus the norm's: the graph's grad input
    p.free(dx, grad_in)
    return "dinput"


def _mlp_forward(p: _Program, s: LayerShape, ffn: int, name: str, norm: str | None = None) -> None:
    """The MLP after its ``norm`` (fused into the first linear: its quantized output goes once that
    GEMM has run); under FP8 the second linear keeps its input quantized and the bf16 activation
    goes at the end."""
    fc1 = 2 * ffn if s.gated else ffn
    p.alloc(f"{name}.fc1", s.act(fc1))
    if norm is not None:
        _gemm_done(p, s, f"{norm}.out")
    p.alloc(f"{name}.act", s.act(ffn))
    if s.fp8_recipe is not None:
        _quantized(p, s, f"{name}.act.in", ffn)
    p.alloc(f"{name}.fc2", s.act(s.hidden))
    if s.fp8_recipe is not None:
        _gemm_done(p, s, f"{name}.act.in")
        p.free(f"{name}.act")


def _mlp_backward(p: _Program, s: LayerShape, ffn: int, name: str, grad: str, weights: int = 1) -> str:
    """``weights``: the MLPs whose weight gradients one GEMM writes (TE's grouped linear writes every
    local expert's at once: in traces of 16 experts, fc1 and fc2 gradients as two allocations)."""
    fc1 = 2 * ffn if s.gated else ffn
    fp8 = s.fp8_recipe is not None
    if fp8:
        _quantized(p, s, f"{name}.fc2.g", s.hidden)
    p.alloc(f"{name}.fc2.dgrad", s.act(ffn))
    p.alloc(f"{name}.fc2.wgrad", weights * s.hidden * ffn * _BF16)
    p.free(grad, f"{name}.act.in.col", f"{name}.fc2.g.row", f"{name}.fc2.g.col")
    p.alloc(f"{name}.act.dgrad", s.act(fc1))
    if s.bias and not s.gated:  # Megatron's fused bias-GELU: autograd sums the bias gradient from act.dgrad
        p.temp(f"{name}.bias.column_sum", column_sum_workspace(s.tokens, ffn))
    p.free(f"{name}.fc2.dgrad", f"{name}.act", f"{name}.fc1")
    if s.bias:
        p.alloc(f"{name}.fc1.dbias", fc1 * _BF16)
    if fp8:
        _quantized(p, s, f"{name}.fc1.g", fc1)
    p.alloc(f"{name}.fc1.dgrad", s.act(s.hidden))
    p.alloc(f"{name}.fc1.wgrad", weights * fc1 * s.hidden * _BF16)
    p.free(f"{name}.act.dgrad", f"{name}.fc1.g.row", f"{name}.fc1.g.col")
    return f"{name}.fc1.dgrad"


def _bf16(s: LayerShape) -> LayerShape:
    return dataclasses.replace(s, fp8_recipe=None, fp8_attention=False)


def _moe_forward(p: _Program, s: LayerShape, moe: MoeShape, parts: frozenset[str]) -> None:
    """The MoE block after its norm, as far as the graph holds it (traced with 16 experts top-2): the
    router, then with ``preprocess`` the dispatcher's permuted tokens and probabilities (outputs of a
    router graph, live until its backward), then through the experts, whose second GEMM's output
    stays until backward (the deterministic unpermute's index_add reads it through a temporary)."""
    if _shared_in_router_graph(moe, parts):
        _mlp_forward(p, _bf16(s), moe.shared_ffn, "shared")  # its fc2 output leaves the graph: live until backward
    router = _FP32 if moe.router_fp32 else _BF16
    p.alloc("router.logits", s.tokens * moe.experts * router)
    p.alloc("router.probs", s.tokens * moe.experts * _FP32)
    p.alloc("router.map", s.tokens * moe.experts)
    if not parts & {"moe", "preprocess"}:  # the graph ends after the router
        return
    p.alloc("permuted", moe.rows * s.hidden * _BF16)
    p.alloc("permuted.probs", moe.rows * _FP32)
    if "moe" not in parts:  # the graph ends after the dispatcher's preprocess
        return
    rows = _bf16(dataclasses.replace(s, seq=moe.rows, micro_batch=1))  # FP8 experts: not modelled
    _mlp_forward(p, rows, moe.ffn, "experts")
    p.alloc("unpermuted", s.act(s.hidden))
    p.temp("unpermute.index_add", rows.act(s.hidden))
    if moe.shared_ffn:
        _mlp_forward(p, _bf16(s), moe.shared_ffn, "shared")
        p.free("shared.fc2")


def _shared_in_router_graph(moe: MoeShape, parts: frozenset[str]) -> bool:
    """A graph of the router (and preprocess) without the experts holds the shared experts, computed first."""
    return bool(moe.shared_ffn) and not moe.shared_overlap and "moe" not in parts


def _moe_backward(p: _Program, s: LayerShape, moe: MoeShape, grad: str, parts: frozenset[str]) -> str:
    if "moe" in parts:
        rows = _bf16(dataclasses.replace(s, seq=moe.rows, micro_batch=1, bias=False))
        p.alloc("unpermuted.grad", rows.act(s.hidden))
        p.free("experts.fc2")
        expert_grad = _mlp_backward(p, rows, moe.ffn, "experts", "unpermuted.grad", weights=moe.experts)
        p.alloc("permuted.grad", s.act(s.hidden))
        p.free(expert_grad, "permuted", "permuted.probs")
        if moe.shared_ffn:
            shared_grad = _mlp_backward(p, _bf16(dataclasses.replace(s, bias=False)), moe.shared_ffn, "shared", grad)
            p.free(shared_grad)
        grad = "permuted.grad"
    elif "preprocess" in parts:  # the permuted tokens' gradient comes in; the unpermuted one goes to the norm
        p.alloc("permuted.grad_output", moe.rows * s.hidden * _BF16)
        p.alloc("permuted.grad", s.act(s.hidden))
        p.free("permuted.grad_output", "permuted", "permuted.probs")
        grad = "permuted.grad"
    p.alloc("router.dlogits", s.tokens * moe.experts * _FP32)
    p.free("router.logits", "router.probs", "router.map", "router.dlogits")
    if _shared_in_router_graph(moe, parts):  # the shared output's gradient comes in with the graph's others
        p.alloc("shared.grad_output", s.act(s.hidden))
        p.free("shared.fc2")
        shared = _bf16(dataclasses.replace(s, bias=False))
        p.free(_mlp_backward(p, shared, moe.shared_ffn, "shared", "shared.grad_output"))
    p.alloc("ln2.dgrad", s.act(s.hidden))
    p.free(grad, "ln2.out")
    return "ln2.dgrad"


_FP8_MODELLED_RECIPES = ("delayed", "tensorwise")  # the recipes whose quantize buffers the programs write
_MOE_OFFLOAD_GROUPS = frozenset({"mlp_norm", "expert_fc1", "moe_act", "fused_group_mlp"})  # saves of the MoE block
_SCOPE_PARTS = {"attn": "attn", "mlp": "mlp", "moe": "moe", "moe_router": "router", "moe_preprocess": "preprocess"}


def _graph(shape: LayerShape, parts: frozenset[str], prefix: str) -> tuple[_Program, _Program]:
    """The forward and backward programs of one graphed layer for ``parts`` of it."""
    fwd, bwd = _Program(prefix), _Program(prefix)
    moe = shape.moe
    if "attn" in parts:
        _attention_forward(fwd, shape)
    if moe is None and "mlp" in parts:
        _norm_forward(fwd, shape, "ln2", feeds_fp8_gemm=True)
        _mlp_forward(fwd, shape, shape.ffn, "mlp", norm="ln2")
        _bda_forward(fwd, shape, "out", "mlp.fc2")
    if moe is not None and parts & {"moe", "router"}:
        _norm_forward(fwd, shape, "ln2")
        _moe_forward(fwd, shape, moe, parts)
        if "moe" in parts:
            _bda_forward(fwd, shape, "out", "unpermuted")
    # Backward, in reverse.
    grad = "grad_output"
    if moe is None and "mlp" in parts:
        grad = _bda_backward(bwd, shape, "out")
        grad = _mlp_backward(bwd, shape, shape.ffn, "mlp", grad)
        bwd.free("ln2.out", "ln2.out.col")
        grad = _norm_backward(bwd, shape, "ln2", grad)
        bwd.free("x1")
    if moe is not None and parts & {"moe", "router"}:
        grad = _bda_backward(bwd, shape, "out") if "moe" in parts else grad
        grad = _moe_backward(bwd, shape, moe, grad, parts)
        grad = _norm_backward(bwd, shape, "ln2", grad)
        bwd.free("x1")
    if "attn" in parts:
        grad = _attention_backward(bwd, shape, grad)
    return fwd, bwd


def scope_parts(modules: Sequence[str]) -> frozenset[str]:
    """Megatron's ``--cuda-graph-modules`` as the parts of a layer one graph holds."""
    if not modules:
        return frozenset({"attn", "mlp", "moe"})
    unknown = [m for m in modules if m not in _SCOPE_PARTS]
    if unknown:
        raise ValueError(
            f"--cuda-graph-modules {' '.join(unknown)}: the memory planner knows only {', '.join(_SCOPE_PARTS)}."
        )
    return frozenset(_SCOPE_PARTS[m] for m in modules)


@dataclasses.dataclass(frozen=True)
class GraphMemoryPlan:
    pool_bytes: int  # what the graph pool reserves after capture
    peak_live_bytes: int  # the largest sum of live allocations during capture
    graphs: int
    unpredicted: tuple[str, ...] = ()  # parts of the run the prediction leaves out
    host_arena_bytes: int | None = None  # --cg-slot-capture with offload: the layers' pinned host arenas
    arena_bytes: int | None = None  # --cg-slot-capture: the layers' GPU saved-tensor arenas (outside the pool)
    # --cg-slot-capture: the graphs' outputs and gradients and the parameter-gradient buffers (outside the pool)
    boundary_bytes: int | None = None
    # packed graphs (--cg-thd-max-seqs without hybrid CP): the graphs' fixed-capacity offsets, static inputs outside
    # the pool
    thd_buffer_bytes: int | None = None
    thd_layout: tuple[int, int | None] | None = None  # packed graphs: (--cg-thd-max-seqs, the layout's max_seqlen)

    def describe(self) -> str:
        lines = [
            f"graph pool (predicted): {self.pool_bytes / 2**20:.0f} MiB reserved for {self.graphs} graph(s); "
            f"peak live {self.peak_live_bytes / 2**20:.0f} MiB during capture"
        ]
        if self.arena_bytes is not None:
            assert self.boundary_bytes is not None  # plan_slot_memory sets the arena and boundary figures together
            lines.append(
                f"GPU arenas (predicted, --cg-slot-capture): {self.arena_bytes / 2**20:.1f} MiB; outputs, "
                f"gradients and parameter-gradient buffers: {self.boundary_bytes / 2**20:.1f} MiB"
            )
        if self.host_arena_bytes is not None:
            lines.append(
                f"pinned host arenas (predicted, --cg-slot-capture offload): {self.host_arena_bytes / 2**20:.1f} MiB"
            )
        if self.thd_buffer_bytes is not None:
            layout = (
                ""
                if self.thd_layout is None
                else (
                    f"; layout: {self.thd_layout[0] + 1} cu_seqlens entries, "
                    f"max_seqlen {self.thd_layout[1] or '--seq-length'}"
                )
            )
            lines.append(
                f"fixed-capacity THD offsets (--cg-thd-max-seqs, static inputs outside the pool): "
                f"{self.thd_buffer_bytes} B{layout}"
            )
        lines += [f"  not predicted: {what}" for what in self.unpredicted]
        return "\n".join(lines)


def _replay(ops: Iterator[tuple[str, str, int]]) -> PoolModel:
    pool = PoolModel()
    live: dict[str, int] = {}
    for action, name, nbytes in ops:
        if action == "alloc":
            assert name not in live, name
            live[name] = pool.malloc(nbytes)
        elif name in live:  # a free of something this configuration never allocated is no-op
            pool.free(live.pop(name))
    return pool


def plan_graph_memory(layers: Sequence[LayerShape], modules: Sequence[str]) -> GraphMemoryPlan:
    """The pool of one TE capture (Megatron's PP = 1 order: every layer's forward graph, then the
    backward graphs in reverse). Each backward graph's weight gradients are freed when the next
    backward capture starts (Megatron has reduced them into its main grads by then), forward
    outputs and grad inputs stay to the end."""
    parts = scope_parts(modules)
    programs = [_graph(shape, parts, f"L{index}.") for index, shape in enumerate(layers)]

    def ops() -> Iterator[tuple[str, str, int]]:
        for fwd, _ in programs:
            yield from fwd.ops
        held: list[str] = []
        for _fwd, bwd in reversed(programs):
            yield from (("free", name, 0) for name in held)
            yield from bwd.ops
            held = [
                name
                for action, name, _ in bwd.ops
                if action == "alloc" and name.endswith(("wgrad", "dbias", "dgamma", "dbeta"))
            ]

    pool = _replay(ops())
    return GraphMemoryPlan(pool_bytes=pool.reserved, peak_live_bytes=pool.peak_allocated, graphs=len(programs))


def _graph_output(shape: LayerShape, parts: frozenset[str]) -> str | None:
    """The forward program's name of the graph's output: the attention's residual sum for an
    attention-only graph, the layer's output once the graph holds the MLP or the MoE block; None for
    a graph that ends inside the MoE block (the router scope), whose outputs are not modelled."""
    if ("mlp" in parts and shape.moe is None) or ("moe" in parts and shape.moe is not None):
        return "out"
    if "attn" in parts and not (shape.moe is not None and "router" in parts):
        return "x1"
    return None


def _parameter_layouts(s: LayerShape, parts: frozenset[str]) -> collections.Counter:
    """The shapes of one layer's parameters in the graphed parts, with their counts (the slot path
    keeps one gradient buffer per parameter of a layout, shared by the layers)."""
    q, kv = s.heads * s.head_dim, s.query_groups * s.head_dim
    shapes: collections.Counter = collections.Counter()

    def linear(rows: int, cols: int, bias: bool) -> None:
        shapes[(rows, cols)] += 1
        if bias:
            shapes[(rows,)] += 1

    def norm() -> None:
        shapes[(s.hidden,)] += 1 if s.rmsnorm else 2

    def mlp(ffn: int, bias: bool) -> None:
        linear(2 * ffn if s.gated else ffn, s.hidden, bias)
        linear(s.hidden, ffn, bias)

    if "attn" in parts:
        norm()
        linear(q + 2 * kv, s.hidden, s.bias)
        linear(s.hidden, q, s.bias)
    if s.moe is None and "mlp" in parts:
        norm()
        mlp(s.ffn, s.bias)
    if s.moe is not None and "moe" in parts:  # Megatron's experts have no linear biases
        norm()
        linear(s.moe.router_experts or s.moe.experts, s.hidden, False)
        for _ in range(s.moe.experts):
            mlp(s.moe.ffn, False)
        if s.moe.shared_ffn:
            mlp(s.moe.shared_ffn, False)
    return shapes


def _parameter_gradient_bytes(layers: Sequence[LayerShape], parts: frozenset[str]) -> int:
    """The slot path's shared parameter-gradient buffers: per layout, as many as the layer that has
    the most of it (a dense layer's MLP and an MoE layer's experts each keep their own), bf16."""
    most: collections.Counter = collections.Counter()
    for shape in layers:
        most |= _parameter_layouts(shape, parts)
    return _BF16 * sum(math.prod(layout) * count for layout, count in most.items())


def _rotary_dim(s: LayerShape) -> int:
    return s.head_dim if s.rotary_dim is None else s.rotary_dim


def staging_ring_bytes(offloaded: Sequence[int], depth: int) -> int:
    """The GPU staging buffers of ``--cg-offload-copies between-replays`` (``slot_sharing.offload_staging``): the
    layers, in capture order, take the ``depth`` ring positions round-robin; a position's buffer is
    sized by the first layer that offloads at it, and a later, larger layer there gets a buffer of
    its own. ``offloaded``: each layer's offloaded bytes."""
    buffers: dict[int, int] = {}
    own = 0
    for index, nbytes in enumerate(offloaded):
        if not nbytes:
            continue
        position = index % depth
        if position not in buffers:
            buffers[position] = nbytes
        elif buffers[position] < nbytes:
            own += nbytes
    return sum(buffers.values()) + own


def plan_slot_memory(
    layers: Sequence[LayerShape],
    modules: Sequence[str],
    policy: OffloadPolicy | None = None,
    staging_depth: int | None = None,
) -> GraphMemoryPlan:
    """``--cg-slot-capture`` with one slot per layer (PP = 1): the pool, the GPU arenas (less the
    saves ``policy`` offloads, which ``host_arena_bytes`` counts) and the boundary buffers: each
    graph's output and the gradients of its output and input, and the parameter-gradient buffers
    of the parameters the graphs reach (shared by layout: ``slot_sharing.param_grads``). The slot backend
    captures each layer's forward, then its backward, into one pool; each capture frees its blocks
    when it ends, except the forward's output, which lives until its backward is captured. With
    ``staging_depth`` (copies between replays), the GPU arenas include the staging ring."""
    parts = scope_parts(modules)
    pool, live = PoolModel(), {}

    def capture(ops: list[tuple[str, str, int]], keep: str | None = None) -> None:
        mine = []
        for action, name, nbytes in ops:
            if action == "alloc":
                live[name] = pool.malloc(nbytes)
                mine.append(name)
            elif name in live:
                pool.free(live.pop(name))
        for name in mine:  # copied into the arena or the boundary buffers: free when the capture ends
            if name in live and name != keep:
                pool.free(live.pop(name))

    arenas = host = 0
    offloaded_per_layer = []
    stack = None if policy is None else OffloadStack(policy, len(layers))
    for index, shape in enumerate(layers):
        output = _graph_output(shape, parts)
        if output is None:
            raise ValueError(
                f"the slot-capture planner models graphs that hold attention, the dense MLP or the whole "
                f"MoE block, not --cuda-graph-modules {' '.join(sorted(modules)) or '(whole layer)'} on "
                f"{'an MoE' if shape.moe is not None else 'a dense'} layer."
            )
        # The slot pool is modelled with bf16 programs (measured within 8% on the FP8 slot cases); FP8's saves
        # are the arenas' (_with_fp8_saves). The programs keep a forward's saves in the pool to the capture's
        # end, where slot capture frees each once copied into the arena: the dense 5 x 2048 FP8 case comes out
        # 684 / 620 MiB for it (its trace); freeing them fits the dense runs but leaves the attention-only
        # slot-offload cells at 0.83, whose in-graph staging in the pool is not modelled.
        fwd, bwd = _graph(_bf16(shape), parts, f"L{index}.")
        capture(fwd.ops, keep=fwd.prefix + output)
        capture(bwd.ops)
        pool.free(live.pop(fwd.prefix + output))
        kept: dict[str, int] = {}
        for action, name, nbytes in fwd.ops:
            if action == "alloc":
                kept[name] = nbytes
            else:
                kept.pop(name, None)
        kept.pop(fwd.prefix + output)
        kept = _with_fp8_saves(kept, shape, parts, fwd.prefix)
        kept["input"] = shape.act(shape.hidden)
        if "attn" in parts:  # TE's fused attention saves the full cu_seqlens it makes for an unpacked batch
            kept["cu_seqlens"] = (shape.micro_batch + 1) * _INT32
        if "attn" in parts and shape.rope:
            kept["rope.freqs"] = shape.seq * _rotary_dim(shape) * _FP32
        offloaded = 0 if stack is None else _offloaded_bytes(shape, parts, stack, index)
        arenas += sum(arena_aligned(nbytes) for nbytes in kept.values()) - offloaded
        host += offloaded
        offloaded_per_layer.append(offloaded)
    if staging_depth is not None:
        arenas += staging_ring_bytes(offloaded_per_layer, staging_depth)
    # Megatron's sample arguments are the static inputs (slot_sharing.capture adopts them), so the boundary
    # buffers are each graph's output, its gradient and the input's gradient.
    boundary = sum(3 * shape.act(shape.hidden) for shape in layers) + _parameter_gradient_bytes(layers, parts)
    return GraphMemoryPlan(
        pool_bytes=pool.reserved,
        peak_live_bytes=pool.peak_allocated,
        graphs=len(layers),
        arena_bytes=arenas,
        boundary_bytes=boundary,
        host_arena_bytes=None if policy is None else host,
    )


def _attention_saves(s: LayerShape) -> list[Save]:
    """What a graphed attention block of Megatron 0.19.2's TE layer spec saves for backward, in
    forward order, with Megatron's offload group of each save. The input norm is fused into the QKV
    linear (``input_layernorm`` is an IdentityOp), so ``attn_norm`` saves nothing and the linear
    saves the layer input, the norm's output and statistics; attention saves q, k and v (separate
    storages after the fused RoPE, views of one QKV storage without it), its output, softmax
    statistics and RNG state; the output projection saves attention's output again (under FP8 the
    GEMM inputs are saved quantized: ``fp8_quantized_saves``; FP8 dot-product attention saves q, k,
    v and its output quantized instead: ``fp8_attention_saves``). The pre-MLP
    norm is fused into the first MLP linear the same way: no offload group holds MLP saves."""
    q, kv = s.heads * s.head_dim, s.query_groups * s.head_dim

    def save(storage: str, width: int, group: str, itemsize: int = _BF16, tokens: int | None = None) -> Save:
        rows = s.tokens if tokens is None else tokens
        return Save(storage, rows * width * itemsize, rows * width, group)

    def gemm_input(storage: str, width: int, group: str) -> list[Save]:
        if storage not in quantized:
            return [save(storage, width, group)]
        return [save(f"{storage}.fp8", width, group, itemsize=1), Save(f"{storage}.scale_inv", _FP32, 1, group)]

    quantized = fp8_quantized_saves(s, frozenset({"attn"}))
    saves = [
        save("input", s.hidden, "qkv_linear"),
        *gemm_input("ln1.out", s.hidden, "qkv_linear"),
        save("ln1.rsigma", 1, "qkv_linear", _FP32),
    ]
    if not s.rmsnorm:
        saves.append(save("ln1.mu", 1, "qkv_linear", _FP32))
    if s.fp8_attention:  # q, k and v quantized together: three views of one FP8 storage, one scale inverse
        saves += [
            dataclasses.replace(save("qkv.fp8", q + 2 * kv, "core_attn", itemsize=1), numel=s.tokens * width)
            for width in (q, kv, kv)
        ]
        saves += [Save("qkv.scale_inv", _FP32, 1, "core_attn")] * 3
    elif s.rope:
        saves += [save("q", q, "core_attn"), save("k", kv, "core_attn"), save("v", kv, "core_attn")]
    else:  # three views of one storage
        saves += [
            dataclasses.replace(save("qkv", q + 2 * kv, "core_attn"), numel=s.tokens * width) for width in (q, kv, kv)
        ]
    stats = s.micro_batch * s.heads * s.seq
    output = (
        [save("o.fp8", q, "core_attn", itemsize=1), Save("o.scale_inv", _FP32, 1, "core_attn")]
        if s.fp8_attention
        else [save("o", q, "core_attn")]
    )
    return [
        *saves,
        *output,
        Save("softmax_stats", stats * _FP32, stats, "core_attn"),
        Save("rng", 16, 2, "core_attn"),
        *(gemm_input("proj.input", q, "attn_proj") if "proj.input" in quantized else [save("o", q, "attn_proj")]),
    ]


def fp8_quantized_saves(s: LayerShape, parts: frozenset[str]) -> dict[str, int]:
    """Under FP8 (delayed or current scaling, sm_90), the saves of a dense layer that Megatron
    0.19.2's TE layers keep quantized, by the name of the bf16 save they replace, with their width:
    a GEMM input kept for the weight gradient keeps only its column-wise data, 1 byte an element,
    beside a 4-byte scale inverse of its own. The norms' outputs (fused into the QKV and first MLP
    linears) and the activation the second MLP linear reads are saved so; the bf16 tensors go.
    Under delayed scaling the output projection also saves a quantized copy of attention's output
    (``proj.input``); under other recipes Megatron has it save the original (``set_save_original_input``).
    Measured exact on the three FP8 slot farm cases."""
    if s.fp8_recipe is None:
        return {}
    saves = {}
    if "attn" in parts:
        saves["ln1.out"] = s.hidden
        if s.fp8_recipe == "delayed":
            saves["proj.input"] = s.heads * s.head_dim
    if s.moe is None and "mlp" in parts:
        saves.update({"ln2.out": s.hidden, "mlp.act": s.ffn})
    return saves


def _with_fp8_saves(kept: dict[str, int], s: LayerShape, parts: frozenset[str], prefix: str) -> dict[str, int]:
    """The layer's saves with ``fp8_quantized_saves`` in place of their bf16 ones, and FP8
    attention's (``fp8_attention_saves``) in place of attention's bf16 q, k, v and output."""
    kept = dict(kept)
    for name, width in fp8_quantized_saves(s, parts).items():
        kept.pop(prefix + name, None)
        kept[prefix + name + ".fp8"] = s.tokens * width
        kept[prefix + name + ".scale_inv"] = _FP32
    if s.fp8_attention and "attn" in parts:
        for name in ("q", "k", "v", "qkv", "o"):
            kept.pop(prefix + name, None)
        kept.update({prefix + name: nbytes for name, nbytes in fp8_attention_saves(s).items()})
    return kept


def fp8_attention_saves(s: LayerShape) -> dict[str, int]:
    """What FP8 dot-product attention (delayed scaling, TE 2.20.2's ``FusedAttnFunc``) keeps for
    backward instead of bf16 q, k, v and output: q, k and v quantized together into one FP8
    storage, the FP8 output, each with a scale inverse, and the S quantizer's scale snapshot on
    ctx, which slot capture copies into the arena. The bf16 output goes on to the output
    projection, which keeps its own quantized copy (``fp8_quantized_saves``)."""
    q, kv = s.heads * s.head_dim, s.query_groups * s.head_dim
    return {
        "attn.qkv.fp8": s.tokens * (q + 2 * kv),
        "attn.qkv.scale_inv": _FP32,
        "attn.o.fp8": s.tokens * q,
        "attn.o.scale_inv": _FP32,
        "attn.s_scale": _FP32,
    }


def _offloaded_bytes(shape: LayerShape, parts: frozenset[str], stack: OffloadStack, index: int) -> int:
    """What in-graph offload moves out of layer ``index``'s arena: the attention storages every save
    of which Megatron's offload groups hold, in the groups Megatron offloads at that layer
    (``slot_sharing.offload_plan.OffloadStack``)."""
    return stack.plan(_attention_saves(shape), index).host_bytes if "attn" in parts else 0


def _fp8_layer(settings: RunSettings, number: int) -> bool:
    """Layer ``number`` (1-based) runs in FP8: ``--fp8-format`` set and not one of the
    ``--first-last-layers-bf16`` layers."""
    if not settings.fp8:
        return False
    if not settings.first_last_layers_bf16:
        return True
    return settings.num_layers_at_start_in_bf16 < number and number <= (
        required_setting(settings.num_layers, "--num-layers") - settings.num_layers_at_end_in_bf16
    )


def _offload_policy(settings: RunSettings) -> OffloadPolicy | None:
    """The policy of Megatron's offload flags (``OffloadPolicy.from_flags``), or None when they offload nothing."""
    if not settings.activation_offloading or not settings.offload_modules:
        return None
    return OffloadPolicy.from_flags(
        settings.offload_modules,
        min_tensor_elements=MEGATRON_MIN_OFFLOADED_TENSOR_SIZE
        if settings.min_offloaded_tensor_size is None
        else settings.min_offloaded_tensor_size,
        fraction=settings.activation_offload_fraction,
    )


def plan_for_run(settings: RunSettings, *, config: PluginConfig) -> GraphMemoryPlan:
    """The prediction for a run from its ``settings`` (``settings.read_settings``: Megatron's flags
    as validated; this module stays free of Megatron and torch) and the plugin's ``config`` in force
    (its offload copies and window; never the ``--cg-*`` flags, which an ``install(config)``
    overrides). ``settings.deterministic``: cuDNN's deterministic attention backward."""
    s = settings
    capture = plan_capture(s)
    policy = _offload_policy(s) if s.slot_capture else None
    unpredicted = [
        what
        for what, present in (
            ("pipeline parallelism (several microbatches captured per layer)", s.pipeline_parallel > 1),
            ("graph banks (their arenas are in the capture report)", bool(capture.banks)),
            (
                f"FP8 recipe {s.fp8_recipe!r} (modelled as tensorwise)",
                s.fp8 and s.fp8_recipe not in _FP8_MODELLED_RECIPES,
            ),
            (
                "FP8 MoE experts, routed and shared (modelled as bf16 in TE's graph pool)",
                s.fp8 and not s.slot_capture and s.has_moe_layers,
            ),
            ("FP8 MoE experts (their quantized saves)", s.fp8 and s.slot_capture and s.has_moe_layers),
            ("multi-latent attention (modelled as standard attention)", s.multi_latent_attention),
            (
                "Megatron's unfused attention (its s x s scores; modelled as TE's fused attention)",
                s.attention_backend in ("unfused", "local"),
            ),
            ("multi-token-prediction layers", bool(s.mtp_num_layers)),
            ("activation recomputation inside the graphs", s.recompute_granularity is not None),
            ("tensor parallelism's communication buffers", s.tensor_parallel > 1),
            (
                "Megatron's activation offloading (its offloaded saves leave the pool)",
                (s.activation_offloading and not s.slot_capture) or s.cpu_offloading,
            ),
            (
                "context parallelism (one rank's share of the sequence, without CP's communication buffers)",
                s.context_parallel > 1,
            ),
            (
                "in-graph offload's staging and reload buffers in the pool "
                "(up to --cg-offload-window + 1 groups' bytes)",
                s.slot_capture and policy is not None and config.offload_copies == "in-graph",
            ),
            (
                "FP8 attention's quantized copies in the slot pool (the pool is modelled with bf16 attention; "
                "the arenas count the FP8 saves)",
                s.slot_capture and s.fp8 and s.fp8_dot_product_attention,
            ),
            (
                "in-graph offload of the MoE block's saves (the plan offloads attention's only)",
                s.slot_capture
                and bool(policy and policy.modules & _MOE_OFFLOAD_GROUPS)
                and "moe" in scope_parts(s.modules)
                and s.has_moe_layers,
            ),
        )
        if present
    ]
    tp, cp = s.tensor_parallel, s.context_parallel
    heads = required_setting(s.num_attention_heads, "--num-attention-heads")
    hidden = required_setting(s.hidden_size, "--hidden-size")
    ffn_hidden = required_setting(s.ffn_hidden_size, "--ffn-hidden-size")
    groups = s.num_query_groups if s.group_query_attention and s.num_query_groups else heads
    head_dim = s.kv_channels or hidden // heads
    dense = LayerShape(
        seq=required_setting(s.seq_length, "--seq-length") // cp,
        micro_batch=s.micro_batch_size,
        hidden=hidden,
        ffn=ffn_hidden // tp,
        heads=max(1, heads // tp),
        query_groups=max(1, groups // tp),
        head_dim=head_dim,
        gated=s.swiglu,
        bias=s.add_bias_linear,
        rmsnorm=s.normalization == "RMSNorm",
        rope=s.position_embedding_type in ("rope", "yarn"),
        hidden_dropout=s.hidden_dropout > 0,
        deterministic=s.deterministic,
        rotary_dim=int(head_dim * s.rotary_percent),
        thd_sequences=s.thd_max_seqs if s.packed_graphs else None,
    )
    moe_shape = None
    if s.num_experts:
        local = s.num_experts // s.expert_parallel
        capacity = capacity_plan(s) if s.pad_to_capacity else None  # the plan megatron-cg plan prints
        # Padded: each local expert takes its capacity from every source rank; dropless: the router's assignments.
        rows = local * capacity.tokens_per_local_expert if capacity else dense.tokens * s.moe_topk
        moe_shape = MoeShape(
            experts=local,
            topk=s.moe_topk,
            ffn=s.moe_ffn_hidden_size or ffn_hidden,
            rows=rows,
            shared_ffn=s.moe_shared_expert_intermediate_size or 0,
            shared_overlap=s.moe_shared_expert_overlap,
            router_fp32=s.moe_router_dtype == "fp32",
            router_experts=s.num_experts,
        )
    first = set(capture.first_stage_layers)
    layers = [
        dataclasses.replace(
            dense,
            moe=moe_shape if s.is_moe_layer(n - 1) else None,
            fp8_recipe=s.fp8_recipe if _fp8_layer(s, n) else None,
            fp8_attention=_fp8_layer(s, n) and s.fp8_dot_product_attention and s.fp8_recipe == "delayed",
        )
        for n in capture.graphed_layers
        if n in first
    ]
    if not layers:
        return GraphMemoryPlan(pool_bytes=0, peak_live_bytes=0, graphs=0, unpredicted=tuple(unpredicted))
    if s.slot_capture:
        staged = policy is not None and config.offload_copies == "between-replays"
        plan = plan_slot_memory(layers, s.modules, policy, config.offload_window + 1 if staged else None)
    else:
        plan = plan_graph_memory(layers, s.modules)
    return dataclasses.replace(
        plan,
        unpredicted=tuple(unpredicted),
        thd_buffer_bytes=thd_buffer_bytes(s, len(layers)),
        # packed_graphs implies --cg-thd-max-seqs
        thd_layout=(s.thd_max_seqs, s.packed_max_seqlen) if s.packed_graphs and s.thd_max_seqs is not None else None,
    )


def thd_buffer_bytes(facts: RunSettings, graphs: int) -> int | None:
    """Packed graphs' static offsets: ``--cg-thd-max-seqs + 1`` int32 entries per graph that holds
    attention (None where the run has no packed graphs)."""
    if not facts.packed_graphs or facts.thd_max_seqs is None:  # packed_graphs implies --cg-thd-max-seqs
        return None
    return graphs * (facts.thd_max_seqs + 1) * _INT32 if facts.attention_graphed else 0
