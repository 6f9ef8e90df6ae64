"""What a run would capture, worked out from the flags alone (the ``megatron-cg check`` dry run).

Mirrors how Megatron's ``TECudaGraphHelper`` picks layers (``_layer_is_graphable``) and microbatches
(one when PP = 1, since static inputs are reused; every microbatch of the schedule otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_cg_plugin.banks.sizes import bank_sizes
from megatron_cg_plugin.scopes import MOE_SCOPES
from megatron_cg_plugin.settings import RunSettings

__all__ = ["CapturePlan", "layer_is_graphed", "number_ranges", "plan_capture", "required_setting"]


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    impl: str
    scope: str  # "layer" for whole-layer capture
    graphed_layers: tuple[int, ...]  # 1-based global layer numbers
    layers_per_stage: int
    pipeline_stages: int
    model_chunks: int
    microbatches_per_step: int
    microbatches_captured: int
    warmup_steps: int
    banks: tuple[int, ...] = ()  # CP sizes with a graph bank (--cg-graph-banks under hybrid CP)
    banks_share_one_graph: bool = False  # the graphed scope has no attention: one graph serves every CP size

    @property
    def first_stage_layers(self) -> tuple[int, ...]:
        """Global numbers of the layers on pipeline stage 0: with virtual stages, chunk c of the
        first stage holds layers ``c * PP * per_chunk + 1 ... + per_chunk``."""
        per_chunk = self.layers_per_stage // self.model_chunks
        stride = per_chunk * self.pipeline_stages
        return tuple(c * stride + i + 1 for c in range(self.model_chunks) for i in range(per_chunk))

    @property
    def graphs_on_first_stage(self) -> int:
        """Graphs TE captures on a first-stage rank: its graphed layers times captured microbatches."""
        first = set(self.first_stage_layers)
        per_layer = (1 if self.banks_share_one_graph else len(self.banks)) if self.banks else self.microbatches_captured
        return sum(1 for n in self.graphed_layers if n in first) * per_layer

    def describe(self) -> str:
        if self.impl != "transformer_engine":
            return f"--cuda-graph-impl {self.impl}: the plugin captures nothing (eager run)."
        layers = number_ranges(self.graphed_layers) or "none"
        return "\n".join(
            [
                f"scope: {self.scope}",
                f"graphed layers (global numbers): {layers}",
                f"layers per pipeline stage: {self.layers_per_stage} in {self.model_chunks} model chunk(s)",
                f"microbatches per step: {self.microbatches_per_step}; captured per layer: "
                f"{self.microbatches_captured}",
                *(
                    [
                        f"graph banks for CP sizes {', '.join(map(str, self.banks))}: "
                        + (
                            "one graph per layer serves every bank (no attention in the graphed scope)"
                            if self.banks_share_one_graph
                            else "each layer captured once per bank"
                        )
                        + ", all in one slot-shared pool"
                    ]
                    if self.banks
                    else []
                ),
                f"graphs per rank on the first pipeline stage: {self.graphs_on_first_stage}",
                f"capture after {self.warmup_steps} eager warmup step(s), before step {self.warmup_steps + 1}",
            ]
        )


def number_ranges(numbers: Sequence[int]) -> str:
    """``1, 2, 3, 5, 7, 8`` as ``1-3, 5, 7, 8`` (three or more in a row as a range): a list of thousands of
    layers stays one short line."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ", ".join(
        f"{low}-{high}" if high - low > 1 else ", ".join(map(str, range(low, high + 1))) for low, high in runs
    )


def required_setting(value: int | None, flag: str) -> int:
    """``value`` of a setting the planners cannot do without; a run whose settings lack it gets a
    TypeError naming ``flag`` (the error the planners' arithmetic on None raised before)."""
    if value is None:
        raise TypeError(f"{flag} is not set: the planners need it.")
    return value


def layer_is_graphed(facts: RunSettings, index: int) -> bool:
    """``index`` is 0-based; dense/MoE layer kinds follow ``--moe-layer-freq``."""
    if not facts.modules:
        return True
    moe_layer = facts.is_moe_layer(index)
    if "attn" in facts.modules:
        return True
    if MOE_SCOPES & set(facts.modules) and moe_layer:
        return True
    return "mlp" in facts.modules and not moe_layer


def plan_capture(facts: RunSettings) -> CapturePlan:
    data_parallel = facts.data_parallel
    global_batch = facts.global_batch_size or facts.micro_batch_size * data_parallel
    microbatches = max(1, global_batch // (facts.micro_batch_size * data_parallel))
    num_layers = required_setting(facts.num_layers, "--num-layers")
    graphed = tuple(i + 1 for i in range(num_layers) if layer_is_graphed(facts, i))
    return CapturePlan(
        impl=facts.cuda_graph_impl,
        scope="+".join(facts.modules) if facts.modules else "layer",
        graphed_layers=graphed if facts.te_graphs else (),
        layers_per_stage=num_layers // facts.pipeline_parallel,
        pipeline_stages=facts.pipeline_parallel,
        model_chunks=facts.virtual_pipeline or 1,
        microbatches_per_step=microbatches,
        microbatches_captured=1 if facts.pipeline_parallel == 1 else microbatches,
        warmup_steps=facts.warmup_steps,
        banks=bank_sizes(facts.data_context_parallel, facts.bank_min_cp)
        if facts.te_graphs and facts.graph_banks and facts.hybrid_context_parallel
        else (),
        banks_share_one_graph=bool(facts.modules) and "attn" not in facts.modules,
    )
