"""The single seam between the plugin and Transformer Engine's graph capture.

Everything the plugin needs from TE at capture time goes through a ``GraphBackend``: the capture
call itself, a way to learn about every CUDA graph object it creates (so a failed capture can
reset them), and the TE-global state a failed capture leaves behind. CPU tests swap in a fake.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from megatron_cg_plugin import foreign_state
from megatron_cg_plugin.capture.transaction import Restorable, attribute

__all__ = [
    "GraphBackend",
    "TEBackend",
    "generators_out_of_capture",
    "generators_preserved",
    "graph_generators",
    "register_graph_safe_generators",
    "te_capture_flag",
]


class GraphBackend(Protocol):
    def make_graphed_callables(self, callables: tuple, sample_args: Sequence, **kwargs: Any) -> Sequence[Callable]: ...

    def tracking(self, on_graph: Callable[[Any], None]) -> contextlib.AbstractContextManager[None]: ...

    def restorables(self, callables: Sequence[Any], capture_kwargs: dict[str, Any]) -> list[Restorable]: ...

    def is_capturing(self) -> bool: ...


class TEBackend:
    """Transformer Engine 2.20's ``make_graphed_callables``."""

    def make_graphed_callables(self, callables: tuple, sample_args: Sequence, **kwargs: Any) -> Sequence[Callable]:
        from transformer_engine.pytorch.graph import make_graphed_callables

        return make_graphed_callables(callables, sample_args, **kwargs)

    def is_capturing(self) -> bool:
        import torch

        return torch.cuda.is_current_stream_capturing()

    @contextlib.contextmanager
    def tracking(self, on_graph: Callable[[Any], None]) -> Iterator[None]:
        """Reports each ``torch.cuda.CUDAGraph`` created inside (TE looks the class up on
        ``torch.cuda`` at call time); the original class is back on exit, whatever happens
        (``ledger.SCOPED``, ``tracked-cuda-graphs``)."""
        import torch

        class TrackedCUDAGraph(torch.cuda.CUDAGraph):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                on_graph(self)

        with foreign_state.setting(torch.cuda, "CUDAGraph", TrackedCUDAGraph, change="tracked-cuda-graphs"):
            yield

    def restorables(self, callables: Sequence[Any], capture_kwargs: dict[str, Any]) -> list[Restorable]:
        """What TE 2.20.2's ``make_graphed_callables`` changes and, on failure, leaves changed:
        its capture flag, the ``__call__`` it installs on each module class (FP8 autocast wrapper),
        ``forward`` on modules (no ``_order``), and the FP8 meta tensors under delayed scaling.
        It also leaves GC disabled, which the transaction's owner snapshots for every capture
        (Megatron freezes GC too). It changes no allocator setting."""
        import transformer_engine.pytorch.graph as te_graph

        items = [
            attribute(te_graph, "_IS_GRAPH_CAPTURING", label="transformer_engine capture flag"),
            generators_out_of_capture(),
        ]
        for cls in {type(module): None for module in callables}:
            items.append(attribute(cls, "__call__"))
        items += [
            attribute(module, "forward", label=f"{type(module).__name__}#{i}.forward")
            for i, module in enumerate(callables)
        ]
        recipe = capture_kwargs.get("fp8_recipe")
        if recipe is not None and any(_as_tuple(capture_kwargs.get("fp8_enabled", False))):
            items.append(_fp8_meta_tensors(te_graph, callables, recipe))
        return items


def register_graph_safe_generators(graph: Any) -> None:
    """Registers TE's graph-safe RNG tracker states with ``graph``, as TE's own capture does, so
    random ops inside the graph advance them on every replay."""
    from transformer_engine.pytorch.distributed import get_all_rng_states, graph_safe_rng_available

    if graph_safe_rng_available():
        for generator in get_all_rng_states().values():
            graph.register_generator_state(generator)


def graph_generators() -> list[Any]:
    """The CUDA generators graphs draw from: torch's default one and TE's graph-safe tracker
    states (Megatron's with ``te_rng_tracker``)."""
    import torch
    from transformer_engine.pytorch.distributed import get_all_rng_states, graph_safe_rng_available

    generators = [torch.cuda.default_generators[torch.cuda.current_device()]]
    return generators + list(get_all_rng_states().values()) if graph_safe_rng_available() else generators


@contextlib.contextmanager
def generators_preserved(generators: Sequence[Any]) -> Iterator[None]:
    """Puts ``generators`` back where they were once the block succeeds, as TE's
    ``make_graphed_callables`` does around its warmup and capture (graph.py 1692-1725). A replay
    draws from a generator's live offset by the amount its capture drew, so the random numbers
    warmup and capture consumed would otherwise shift every later dropout mask: graphed training
    would differ from eager from its first graphed step. A failed block leaves them to the
    transaction's rollback (the generators may still be in capture mode)."""
    states = [generator.get_state() for generator in generators]
    yield
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)


@contextlib.contextmanager
def te_capture_flag() -> Iterator[None]:
    """TE's own "inside make_graphed_callables" flag, set around a capture the plugin runs itself:
    TE modules pick graph-safe paths under it (cuDNN's graph mode, the CP tail handling without a
    device-to-host slice). Its previous value is back on exit, whatever happens."""
    import transformer_engine.pytorch.graph as te_graph

    with foreign_state.held(te_graph, "_IS_GRAPH_CAPTURING", change="te-capture-flag"):
        te_graph.set_capture_start()
        yield


def generators_out_of_capture() -> Restorable:
    """A capture that CUDA invalidates never reaches torch's capture epilogue, so the generators
    registered with it (the default one and TE's graph-safe tracker states) stay in capture mode and
    the next eager random op fails ("Offset increment outside graph capture encountered
    unexpectedly"). Restoring runs one empty capture with the same generators registered: its
    prologue/epilogue put them back out of capture mode while keeping their state objects, which
    graphs captured earlier still use. Seeds and offsets are restored afterwards by the RNG
    snapshot (restored later: snapshots are restored in reverse order)."""

    def restore(_: None) -> None:
        import warnings

        import torch

        if not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
            return
        graph = torch.cuda.CUDAGraph()  # the default generator registers itself
        register_graph_safe_generators(graph)
        with warnings.catch_warnings(), torch.cuda.stream(torch.cuda.Stream()):
            warnings.simplefilter("ignore")  # "the CUDA Graph is empty": intended
            graph.capture_begin()
            graph.capture_end()
        graph.reset()

    return Restorable("random generators out of capture mode", lambda: None, restore)


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _fp8_meta_tensors(te_graph: Any, modules: Sequence[Any], recipe: Any) -> Restorable:
    def save() -> Any:
        return te_graph.save_fp8_tensors(modules, recipe=recipe)  # TE returns clones

    def restore(saved: Any) -> None:
        if saved is not None:
            te_graph.restore_fp8_tensors(modules, list(saved))  # TE pops from the list it is given

    return Restorable("FP8 meta tensors (delayed scaling)", save, restore)
