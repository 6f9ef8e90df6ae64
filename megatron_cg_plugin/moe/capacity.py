"""The fixed-capacity MoE plan (pure Python): what Megatron's drop-and-pad dispatcher fixes at
capture, from the flags alone.

With ``--moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity`` every expert takes
exactly its capacity from every source rank, so the graphed MoE block has static shapes. Megatron
0.19.2 computes it in ``moe_utils.get_capacity`` from the tokens entering a rank's router times
top-k (``token_dispatcher.py``: ``num_tokens = routing_map.size(0) * topk``):
``ceil((N * K / E) * F)`` slots per expert per source rank, the formula NeMo Automodel's
fixed-capacity scope uses too. Each local expert's grouped GEMM then sees that capacity from every
rank of its TP x EP group; tokens over an expert's capacity are dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from megatron_cg_plugin.settings import RunSettings

__all__ = [
    "MoeCapacityPlan",
    "capacity_plan",
    "megatron_capacity",
    "parse_load",
    "tokens_per_rank",
    "uniform_load",
    "zipf_load",
]


def megatron_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's ``get_capacity``, in the same float arithmetic."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeCapacityPlan:
    """One MoE layer's fixed capacity on one rank, per microbatch."""

    tokens_per_rank: int  # N: tokens entering this rank's router
    topk: int
    num_experts: int
    capacity_factor: float
    expert_parallel: int = 1
    tensor_parallel: int = 1  # the expert TP size: each local expert gathers from TP x EP ranks

    def __post_init__(self) -> None:
        if self.tokens_per_rank < 1 or self.topk < 1 or self.num_experts < 1:
            raise ValueError(
                f"tokens per rank, top-k and experts must be >= 1, got {self.tokens_per_rank}, "
                f"{self.topk}, {self.num_experts}."
            )
        if self.topk > self.num_experts:
            raise ValueError(f"--moe-router-topk {self.topk} exceeds --num-experts {self.num_experts}.")
        if self.capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor {self.capacity_factor} must be > 0.")
        if self.num_experts % self.expert_parallel:
            raise ValueError(
                f"--num-experts {self.num_experts} must be a multiple of "
                f"--expert-model-parallel-size {self.expert_parallel}."
            )

    @property
    def assignments(self) -> int:
        """Token-to-expert assignments on this rank: N x K."""
        return self.tokens_per_rank * self.topk

    @property
    def capacity(self) -> int:
        """Slots per expert per source rank."""
        return megatron_capacity(self.assignments, self.num_experts, self.capacity_factor)

    @property
    def exceeds_tokens(self) -> bool:
        """The capacity is larger than the rank's tokens (F x K > E): Megatron's router then pads each
        expert to the N tokens alone, and its alltoall dispatcher cannot lay the capacity out."""
        return self.capacity > self.tokens_per_rank

    @property
    def slots(self) -> int:
        """What each expert takes from each source rank: its capacity, or all N tokens when that is less."""
        return min(self.capacity, self.tokens_per_rank)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.expert_parallel

    @property
    def tokens_per_local_expert(self) -> int:
        """The rows of each local expert's GEMM: its slots from every rank of TP x EP."""
        return self.slots * self.tensor_parallel * self.expert_parallel

    def gemm_shapes(self, hidden: int, ffn_hidden: int, *, gated: bool) -> dict[str, tuple[int, int, int]]:
        """Per local expert, (rows, in, out) of fc1 and fc2 (fc1 doubles its output for a gated
        activation such as SwiGLU; the expert TP size splits the ffn dimension)."""
        if ffn_hidden % self.tensor_parallel:
            raise ValueError(
                f"the expert ffn size {ffn_hidden} must be a multiple of the expert TP size {self.tensor_parallel}."
            )
        rows, ffn = self.tokens_per_local_expert, ffn_hidden // self.tensor_parallel
        return {"fc1": (rows, hidden, ffn * (2 if gated else 1)), "fc2": (rows, ffn, hidden)}

    def routed(self, load: Sequence[float]) -> list[float]:
        """The assignments each expert gets when the router prefers expert ``e`` in proportion to
        ``load[e]``. A token picks K different experts, so no expert gets more than N: what a full
        expert would get goes to the others, in proportion to their shares (water-filling)."""
        if len(load) != self.num_experts:
            raise ValueError(
                f"the router load lists {len(load)} experts; give one share per expert ({self.num_experts})."
            )
        if any(share < 0 for share in load):
            raise ValueError("router load shares must be >= 0.")
        if sum(1 for share in load if share > 0) < self.topk:
            raise ValueError(
                f"a router picks {self.topk} different experts per token: give at least {self.topk} experts a share."
            )
        routed = [0.0] * self.num_experts
        full: set[int] = set()
        left = float(self.assignments)
        while left > 1e-9 * self.assignments:
            open_shares = {e: share for e, share in enumerate(load) if share > 0 and e not in full}
            total = sum(open_shares.values())
            spill = 0.0
            for expert, share in open_shares.items():
                routed[expert] += left * share / total
                if routed[expert] >= self.tokens_per_rank:
                    spill += routed[expert] - self.tokens_per_rank
                    routed[expert] = float(self.tokens_per_rank)
                    full.add(expert)
            left = spill
        return routed

    def dropped_fraction(self, load: Sequence[float]) -> float:
        """The fraction of this rank's assignments dropped for the router load ``load`` (``routed``):
        each expert keeps at most its capacity."""
        return sum(max(0.0, tokens - self.capacity) for tokens in self.routed(load)) / self.assignments


def uniform_load(num_experts: int) -> list[float]:
    return [1.0] * num_experts


def zipf_load(num_experts: int, exponent: float) -> list[float]:
    """A skewed router: expert ``e`` (0-based) gets a share proportional to ``1 / (e + 1) ** exponent``."""
    if exponent < 0:
        raise ValueError(f"the Zipf exponent {exponent} must be >= 0 (0 is uniform).")
    return [1.0 / (expert + 1) ** exponent for expert in range(num_experts)]


def parse_load(text: str, num_experts: int) -> list[float]:
    """``uniform``, ``zipf:S`` or a comma-separated share per expert."""
    if text == "uniform":
        return uniform_load(num_experts)
    if text.startswith("zipf:"):
        try:
            exponent = float(text.split(":", 1)[1])
            if not math.isfinite(exponent):
                raise ValueError(f"the Zipf exponent {exponent} is not a finite number")
            return zipf_load(num_experts, exponent)
        except ValueError as error:
            raise ValueError(f"--router-load {text!r}: {error}; write zipf:S with S >= 0, e.g. zipf:1.0.") from None
    try:
        shares = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--router-load {text!r} is not understood: use uniform, zipf:S, or one share per "
            "expert separated by commas."
        ) from None
    bad = [
        part for part, share in zip(text.split(","), shares, strict=True) if not (math.isfinite(share) and share >= 0)
    ]
    if bad or not any(shares):
        raise ValueError(
            f"--router-load {text!r}: "
            + (
                f"{', '.join(bad)} is no share (a finite number >= 0)"
                if bad
                else "every share is 0, so no token is routed"
            )
            + "; give one share >= 0 per expert, not all 0, e.g. 4,2,1,1."
        )
    if len(shares) != num_experts:
        raise ValueError(f"--router-load lists {len(shares)} shares for {num_experts} experts.")
    return shares


def tokens_per_rank(
    *,
    seq_length: int | None,
    micro_batch_size: int,
    context_parallel: int,
    tensor_parallel: int,
    sequence_parallel: bool,
) -> int:
    """Tokens entering one rank's MoE router per microbatch: the rank's sequence share (CP, and TP,
    which Megatron's MoE layers train with only under sequence parallelism) times the micro-batch size."""
    if tensor_parallel > 1 and not sequence_parallel:
        raise ValueError(
            "Megatron trains MoE layers under tensor parallelism only with sequence parallelism "
            "(moe_layer.py refuses it): add --sequence-parallel."
        )
    if seq_length is None:  # unknown --seq-length: no share to compute
        raise TypeError("the tokens per rank need --seq-length")
    shards = context_parallel * tensor_parallel
    if seq_length % shards:
        raise ValueError(
            f"--seq-length {seq_length} must be a multiple of CP x (TP with sequence parallelism) = {shards}."
        )
    return seq_length // shards * micro_batch_size


def capacity_plan(settings: RunSettings) -> MoeCapacityPlan | None:
    """The plan for a run's ``settings`` (``settings.read_settings``), or None for a dense or dropless model."""
    if not settings.num_experts or settings.capacity_factor is None:
        return None
    return MoeCapacityPlan(
        tokens_per_rank=tokens_per_rank(
            seq_length=settings.seq_length,
            micro_batch_size=settings.micro_batch_size,
            context_parallel=settings.context_parallel,
            tensor_parallel=settings.tensor_parallel,
            sequence_parallel=settings.sequence_parallel,
        ),
        topk=settings.moe_topk,
        num_experts=settings.num_experts,
        capacity_factor=settings.capacity_factor,
        expert_parallel=settings.expert_parallel,
        tensor_parallel=settings.expert_tensor_parallel or 1,
    )
