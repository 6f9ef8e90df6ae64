"""``--cg-slot-capture``: Megatron's own ``create_cudagraphs`` with slot-shared capture standing in
for TE's ``make_graphed_callables``, so a plain run (PP=1, one graph per layer) gets what graph banks
have: each layer's backward state in an arena outside the pool, and in-graph activation offload.

Megatron's lifecycle stays Megatron's: it builds each layer's sample arguments, calls the capture
and hands graph i to layer i; its replay path (``_te_cuda_graph_replay``: scope post-processing,
the delayed offload flush) calls the graph with the layer's tensors. With
``--delay-offload-until-cuda-graph`` each graph call also checks that the groups queued at the
previous one were flushed (``DelayedFlushWatch``), and counts them. Here every layer is captured
by ``capture_slotted`` as one variant in one slot, all layers into one pool; the graphs' temporaries
share the pool, and what a layer's forward leaves for its backward goes to that layer's arena.

With Megatron's fine-grained offload flags (``--fine-grained-activation-offloading
--offload-modules ...``), the saves of the offloaded modules inside the graphed scope go to a
pinned host arena per layer, copied inside the graphs or between replays (``--cg-offload-copies``:
``slot_sharing.offload_arenas``, ``slot_sharing.offload_staging``); Megatron's own offload keeps the modules outside the
scope. During warmup and capture Megatron's offload interface only names its groups
(``slot_sharing.offload_groups``), and the layers' ``offload_module_in_cuda_graph`` is off, so the
capture callable does not join Megatron's offload streams (the plugin's copies bring their own).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from megatron_cg_plugin.capture.scratch import clearing, ends_inside_moe_block, moe_dispatcher_scratch
from megatron_cg_plugin.capture.te_backend import TEBackend, generators_out_of_capture
from megatron_cg_plugin.capture.transaction import Restorable
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.scopes import module_names
from megatron_cg_plugin.slot_sharing.capture import SlotFp8, SlottedGraphs, Variant, capture_slotted
from megatron_cg_plugin.slot_sharing.fp8_state import slot_fp8_refusal
from megatron_cg_plugin.slot_sharing.offload_groups import (
    MegatronOffload,
    OffloadCopies,
    delayed_offload_groups,
    still_queued,
)
from megatron_cg_plugin.slot_sharing.param_grads import ParamGradBuffers
from megatron_cg_plugin.slot_sharing.plan import exclusive_plan

__all__ = [
    "DelayedFlushWatch",
    "LayerSlotStats",
    "SlotBackend",
    "SlotCaptureError",
    "SlotLayerGraph",
    "SlotReplayError",
    "check_slot_capture_call",
]

_VARIANT = "layer"
# Keyword arguments Megatron's replay path passes that are no graph inputs: FP8 weight caching's
# first-microbatch switch (it fills TE's weight-update flag instead) and Megatron's offload streams
# (the plugin's copies have streams of their own).
_NOT_INPUTS = ("is_first_microbatch", "cuda_graph_stream", "cuda_graph_event")


class SlotCaptureError(ValueError):
    """A capture ``--cg-slot-capture`` cannot serve; the message names what to change."""


class SlotReplayError(RuntimeError):
    """A replay call of a slot-captured layer its graph cannot serve."""


@dataclasses.dataclass(frozen=True)
class LayerSlotStats:
    """What one layer's slot-shared graphs hold, for the run report."""

    arena_bytes: int  # GPU: the arena of the saves that stay, and the staging buffers this layer added to the ring
    host_arena_bytes: int  # pinned host arena: the saves offloaded
    offloaded_bytes: int  # per forward replay, to the host
    boundary_bytes: int
    offload_groups_flushed: int = 0  # Megatron's delayed offload groups seen flushed after this layer's replays


class DelayedFlushWatch:
    """Megatron's delayed offload flush (``--delay-offload-until-cuda-graph``), observed: the groups
    queued when a layer's graph is called must be gone by the next graph call, because Megatron's
    replay path flushes the queue right after each graph. Each verified group counts for the graph
    whose replay flushed it."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self._waiting: list[Any] = []
        self._flusher: SlotLayerGraph | None = None

    def on_replay(self, graph: SlotLayerGraph) -> None:
        now = delayed_offload_groups(self.config)
        left = still_queued(self._waiting, now)
        if left:
            raise SlotReplayError(
                f"{len(left)} of the {len(self._waiting)} offload groups delayed until the replay of "
                f"{self._flusher.label if self._flusher else 'a graph'} are still queued: Megatron's replay path did "
                "not flush them after the graph, so their activations stay on the GPU; this megatron-core release "
                "handles the delayed flush differently: train without --delay-offload-until-cuda-graph."
            )
        if self._flusher is not None:
            self._flusher.offload_groups_flushed += len(self._waiting)
        self._waiting, self._flusher = now, graph

    def clear(self) -> None:
        """The graphs go: Megatron's queue entries (and the tensors they hold) are let go."""
        self._waiting, self._flusher = [], None


class SlotLayerGraph:
    """One layer's graph as Megatron's replay path calls it: ``graph(hidden_states, **kwargs)``
    returns the tuple of outputs; ``reset()`` frees it (Megatron's ``delete_cuda_graphs``)."""

    def __init__(
        self,
        graphs: SlottedGraphs,
        label: str,
        arg_count: int,
        input_names: tuple[str, ...],
        flush_watch: DelayedFlushWatch | None = None,
        fp8_weight_caching: bool = True,
    ) -> None:
        self._graphs = graphs
        self._replay = graphs.callable(_VARIANT, 0)
        self.label, self.arg_count, self.input_names = label, arg_count, input_names
        self._flush_watch = flush_watch
        self._fp8_weight_caching = fp8_weight_caching  # False: every replay quantizes the weights anew
        self.offload_groups_flushed = 0

    @property
    def stats(self) -> LayerSlotStats:
        stats = self._graphs.stats
        return LayerSlotStats(
            arena_bytes=stats.arena_bytes + stats.staging_bytes,
            host_arena_bytes=sum(stats.host_arena_bytes),
            offloaded_bytes=sum(stats.offloaded_bytes.values()),
            boundary_bytes=stats.boundary_bytes,
            offload_groups_flushed=self.offload_groups_flushed,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        unknown = sorted(
            name
            for name, value in kwargs.items()
            if name not in self.input_names and name not in _NOT_INPUTS and value is not None
        )
        missing = [name for name in self.input_names if kwargs.get(name) is None]
        if len(args) != self.arg_count or unknown or missing:
            raise SlotReplayError(
                f"{self.label}: the graph was captured with {self.arg_count} positional tensor(s) and keyword tensors "
                f"{list(self.input_names)}, but the replay passes {len(args)} positional, {unknown} unknown and "
                f"{missing} missing: the call differs from the sample Megatron captured with (a changed "
                "--cuda-graph-modules or attention mask setting between capture and training?)."
            )
        if self._flush_watch is not None:
            self._flush_watch.on_replay(self)
        # Megatron's is_first_microbatch: TE's cached FP8 weights are refreshed on the first microbatch only.
        first = kwargs.get("is_first_microbatch")
        update = not self._fp8_weight_caching or first is None or bool(first)
        outputs = self._replay(*args, *(kwargs[name] for name in self.input_names), update_fp8_weights=update)
        return outputs if isinstance(outputs, tuple) else (outputs,)

    def reset(self) -> None:
        self._graphs.reset()
        if self._flush_watch is not None:
            self._flush_watch.clear()


def check_slot_capture_call(callables: Sequence[Any], sample_args: Sequence, kwargs: dict[str, Any]) -> None:
    """What ``--cg-slot-capture`` refuses of Megatron's capture call, before anything is captured."""
    recipe: Any = kwargs.get("fp8_recipe")  # set wherever FP8 is on
    if any(_fp8_enabled(kwargs, len(callables))):
        refusal = slot_fp8_refusal(recipe, tuple(callables))
        if refusal is None and recipe.fp8_mha:  # rule slot-capture-fp8
            refusal = (
                "FP8 multi-head attention (TransformerConfig fp8_multi_head_attention: FP8 tensors between "
                "the attention's modules) is not verified in slot-shared graphs; turn it off (FP8 dot-product "
                "attention with delayed scaling is taken)."
            )
        if refusal:
            raise SlotCaptureError(
                f"--cg-slot-capture: {refusal} Or drop --cg-slot-capture (TE's graphs take every FP8 recipe)."
            )
    # One graph per layer, so the layers' backward replays never overlap: they share parameter-gradient
    # buffers (slot_sharing.param_grads), which this refusal keeps safe.
    if len(sample_args) != len(callables):
        raise SlotCaptureError(
            f"Megatron asks for {len(sample_args)} graphs of {len(callables)} layers (one per microbatch in flight: "
            "pipeline parallelism or --overlap-moe-expert-parallel-comm); --cg-slot-capture captures one graph per "
            "layer: use --pipeline-model-parallel-size 1 without EP overlap, or drop --cg-slot-capture."
        )
    for layer in callables:
        if ends_inside_moe_block(layer):
            scopes = module_names(layer.config.cuda_graph_modules)
            raise SlotCaptureError(
                f"--cuda-graph-modules {' '.join(sorted(scopes))} ends the graph inside the MoE block "
                "and hands routing "
                "state to its eager rest, which slot capture does not verify: use attn moe (drop-and-pad) or attn."
            )


def _fp8_enabled(kwargs: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Megatron's ``fp8_enabled``, per layer: one flag for every layer, or one per layer (bf16
    first/last layers)."""
    enabled = kwargs.get("fp8_enabled", False)
    if isinstance(enabled, (tuple, list)):
        assert len(enabled) == layers, "Megatron passes one fp8_enabled per callable"
        return tuple(bool(e) for e in enabled)
    return (bool(enabled),) * layers


def _layer_fp8(kwargs: dict[str, Any], enabled: bool, layer: Any) -> SlotFp8:
    return SlotFp8(kwargs.get("fp8_recipe"), kwargs.get("fp8_group"), enabled, (layer,))


def _moe_block_in_graph(layer: Any) -> bool:
    scopes = module_names(layer.config.cuda_graph_modules)
    return getattr(layer, "is_moe_layer", False) and (not scopes or "moe" in scopes)


def _layer_variant(layer: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[Variant, tuple[str, ...]]:
    """The layer's capture call as a variant: positional tensors, then keyword tensors by name."""
    names = tuple(name for name, value in kwargs.items() if value is not None)
    arg_count = len(args)
    # A graphed MoE block leaves its dispatcher's per-forward state on attributes: a temporary of the graph.
    call: Callable[..., Any] = clearing(layer, moe_dispatcher_scratch(layer)) if _moe_block_in_graph(layer) else layer

    def forward(*tensors: Any) -> Any:
        return call(*tensors[:arg_count], **dict(zip(names, tensors[arg_count:])))

    return Variant(_VARIANT, forward, (*args, *(kwargs[name] for name in names))), names


class SlotBackend(TEBackend):
    """A ``GraphBackend`` whose capture call is slot-shared capture, layer by layer, into one pool.
    Graph tracking is TE's (``torch.cuda.CUDAGraph`` looked up at call time, as capture_slotted does)."""

    def __init__(
        self,
        *,
        offload: bool = True,
        copies: OffloadCopies | str = OffloadCopies(),
        debug: bool = False,
    ) -> None:
        self.offload = offload  # follow Megatron's offload flags inside the graphs (else all saves stay on the GPU)
        self.copies = OffloadCopies.given(copies)
        self.debug = debug

    def restorables(self, callables: Sequence[Any], capture_kwargs: dict[str, Any]) -> list[Restorable]:
        return [generators_out_of_capture()]  # TE's capture flag is restored by capture_slotted itself

    def make_graphed_callables(self, callables: tuple, sample_args: Sequence, **kwargs: Any) -> Sequence[Callable]:
        import torch

        check_slot_capture_call(callables, sample_args, kwargs)
        sample_kwargs = kwargs.get("sample_kwargs") or [{}] * len(sample_args)
        offload = MegatronOffload.from_config(callables[0].config, callables, offload=self.offload)
        fp8_enabled = _fp8_enabled(kwargs, len(callables))
        # FP8: the weight workspaces are made in the first warmup iteration, frames measured in the last.
        warmup = max(2 if any(fp8_enabled) else 1, int(kwargs.get("num_warmup_iters", 2)))
        # One pool and one capture stream for every layer: the allocator reuses a freed pool block
        # only for the stream it was allocated on, so layers captured on streams of their own
        # would each grow the pool by their temporaries.
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        config = callables[0].config
        watch = DelayedFlushWatch(config) if getattr(config, "delay_offload_until_cuda_graph", False) else None
        ring = self.copies.staging_ring()
        param_grads = ParamGradBuffers()  # the layers' backward replays run one at a time
        graphs: list[SlotLayerGraph] = []
        try:
            with offload.capturing() if offload is not None else contextlib.nullcontext():
                for index, (layer, args, layer_kwargs) in enumerate(zip(callables, sample_args, sample_kwargs)):
                    variant, names = _layer_variant(layer, tuple(args), dict(layer_kwargs))
                    fp8 = _layer_fp8(kwargs, fp8_enabled[index], layer) if any(fp8_enabled) else None
                    slotted = capture_slotted(
                        [variant],
                        exclusive_plan([_VARIANT]),
                        layer,
                        pool=pool,
                        stream=stream,
                        warmup_iterations=warmup,
                        debug=self.debug,
                        contract_check=ContractCheck.OFF,  # the helper holds each replay to its contract
                        offload=None if offload is None else offload.slot_offload(layer, ring, self.copies.window),
                        check_stale=False,  # the helper's stale-graph check covers every layer at once
                        param_grads=param_grads,
                        fp8=fp8,
                    )
                    label = f"layer {getattr(layer, 'layer_number', index + 1)}"
                    graphs.append(
                        SlotLayerGraph(
                            slotted, label, len(args), names, watch, bool(kwargs.get("fp8_weight_caching", False))
                        )
                    )
        except BaseException:
            for graph in graphs:
                graph.reset()
            raise
        return tuple(graphs)
