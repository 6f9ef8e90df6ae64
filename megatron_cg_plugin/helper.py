"""The plugin's ``TECudaGraphHelper``: Megatron's lifecycle, plus capture diagnostics and replay
counters. It only adds around Megatron's own methods; capture itself is still Megatron's and TE's.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Iterable

from megatron_cg_plugin import diagnostics
from megatron_cg_plugin.session import CaptureStats, RunSession


def scope_label(modules: Iterable[Any]) -> str:
    """``[attn, moe_router]`` -> ``'attn+moe_router'``; an empty list means the whole layer."""
    names = [getattr(module, "name", str(module)) for module in modules or ()]
    return "+".join(names) if names else "layer"


class PluginHelperMixin:
    """Mixed in front of Megatron's ``TECudaGraphHelper`` by ``bind_helper_class``."""

    session: ClassVar[RunSession]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture_stats: CaptureStats | None = None
        self.session.attach_helper(self)

    def _graphed_layers(self) -> list[Any]:
        return [layer for layers in self.callables_per_chunk for layer in layers]

    def create_cudagraphs(self) -> None:
        pools_before = diagnostics.pool_bytes_by_id(diagnostics.allocator_segments())
        start = time.perf_counter()
        super().create_cudagraphs()
        seconds = time.perf_counter() - start
        if not self.graphs_created():
            return
        pools_after = diagnostics.pool_bytes_by_id(diagnostics.allocator_segments())
        layers = self._graphed_layers()
        counter = diagnostics.ReplayCounter(len(layers))
        for slot, layer in enumerate(layers):
            layer.cuda_graphs = [counter.wrap(graph, slot) for graph in layer.cuda_graphs]
        self.capture_stats = CaptureStats(
            scope=scope_label(self.config.cuda_graph_modules),
            layers=len(layers),
            graphs=sum(len(layer.cuda_graphs) for layer in layers),
            seconds=seconds,
            pool_bytes=diagnostics.new_pool_bytes(pools_before, pools_after),
            replays=counter,
        )


def bind_helper_class(base: type, session: RunSession) -> type:
    """A subclass of ``base`` (Megatron's helper) whose instances report to ``session``."""
    return type("PluginTECudaGraphHelper", (PluginHelperMixin, base), {"session": session,
                                                                      "__module__": __name__})
