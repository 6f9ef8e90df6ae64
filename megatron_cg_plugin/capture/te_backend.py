"""The single seam between the plugin and Transformer Engine's graph capture.

Everything the plugin needs from TE at capture time goes through a ``GraphBackend``: the capture
call itself, a way to learn about every CUDA graph object it creates (so a failed capture can
reset them), and the TE-global state a failed capture leaves behind. CPU tests swap in a fake.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol, Sequence

from megatron_cg_plugin import foreign_state
from megatron_cg_plugin.capture.transaction import Restorable, attribute


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

        class TrackedCUDAGraph(torch.cuda.CUDAGraph):  # type: ignore[misc, valid-type]
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

        items = [attribute(te_graph, "_IS_GRAPH_CAPTURING", label="transformer_engine capture flag"),
                 _generators_out_of_capture()]
        for cls in {type(module): None for module in callables}:
            items.append(attribute(cls, "__call__"))
        items += [attribute(module, "forward", label=f"{type(module).__name__}#{i}.forward")
                  for i, module in enumerate(callables)]
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


def fp8_capture_autocast(enabled: bool, recipe: Any, group: Any) -> Any:
    """The autocast TE's ``make_graphed_callables`` runs warmup and capture under (``_graph=True``:
    modules join no global amax buffer and its exit runs no reduction); a fresh one per use."""
    from transformer_engine.pytorch.quantization import autocast

    return autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group, _graph=True)


def slot_fp8_refusal(recipe: Any, modules: Sequence[Any] = ()) -> str | None:
    """Why slot-shared capture cannot take this FP8 recipe, or None. Current (tensorwise) and
    delayed scaling are taken, FP8 attention with delayed scaling only (its S-scale snapshot is
    protected by ``per_call_quantizers``); delayed scaling needs the modules, whose amax histories
    and scales are saved around the capture and joined to TE's reduction at replay."""
    if recipe is None:
        return "slot-shared capture with FP8 needs the recipe: pass SlotFp8(recipe)."
    if not (recipe.delayed() or recipe.float8_current_scaling()):
        return (f"slot-shared capture takes FP8 with delayed or current scaling (--fp8-recipe delayed|tensorwise); "
                f"{type(recipe).__name__} is not verified in slot-shared graphs.")
    if (recipe.fp8_dpa or recipe.fp8_mha) and not recipe.delayed():
        return ("slot-shared capture takes FP8 attention (recipe fp8_dpa / fp8_mha) with delayed scaling only: "
                "FP8 attention under current scaling is not verified (TE 2.20.2 with cuDNN 9.14 on the verified "
                "H200 finds no FP8 attention backend for it); use DelayedScaling (--fp8-recipe delayed) or turn FP8 "
                "attention off.")
    if recipe.delayed() and not modules:
        return ("slot-shared capture with delayed scaling needs the TE modules the variants call: pass "
                "SlotFp8(recipe, modules=...) so their amax histories are restored after capture and reduced at replay.")
    if _fused_operations(modules):  # rule slot-capture-fp8-op-fuser
        return ("slot-shared capture with FP8 does not cover Transformer Engine's fused operations (te.ops; "
                "Megatron's --use-transformer-engine-op-fuser): they run without module hooks, so replays would not "
                "join their FP8 state to TE's amax reduction; drop --use-transformer-engine-op-fuser.")
    return None


def _fused_operations(modules: Sequence[Any]) -> bool:
    """The modules hold te.ops operations (whose forwards a fuser runs, not their module call)."""
    import torch

    try:
        from transformer_engine.pytorch.ops.op import BasicOperation
    except ImportError:  # without TE no module is one of its operations
        return False
    return any(isinstance(m, BasicOperation) for module in modules if isinstance(module, torch.nn.Module)
               for m in module.modules())


class Fp8Capture:
    """TE's FP8 state around one slot-shared capture, as ``make_graphed_callables`` handles it
    (``enter`` before warmup, ``exit`` after the last capture, whatever happens):

    - the global weight-update flag exists from the first warmup on, so each module quantizes its
      weight into its cached workspace under that flag, inside the graphs; a replay fills it
      (``Fp8Replay``). A failed capture puts back what was there before;
    - delayed scaling: amax histories and scales are cloned before warmup and copied back after
      capture, so warmup and capture leave no trace in them;
    - the TE modules each forward reaches are recorded (forward hooks), for the replays to join
      TE's amax reduction."""

    def __init__(self, recipe: Any, modules: Sequence[Any]) -> None:
        self.recipe, self.modules = recipe, tuple(modules)
        self.flag: Any = None
        self.visited: dict[int, Any] = {}
        self._flag_before: Any = None
        self._flag_value_before: Any = None
        self._meta: Any = None
        self._hooks: list[Any] = []

    def enter(self) -> None:
        import transformer_engine.pytorch.graph as te_graph
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        state = FP8GlobalStateManager.quantization_state
        self._flag_before = state.skip_fp8_weight_update_tensor
        # An existing flag is filled in place (its graphs read it by address): its value is put back too.
        self._flag_value_before = None if self._flag_before is None else self._flag_before.clone()
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)  # False: update the workspaces
        self.flag = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
        self._meta = te_graph.save_fp8_tensors(self.modules, recipe=self.recipe)  # None unless delayed
        for module in _te_modules(self.modules):
            self._hooks.append(module.register_forward_hook(self._visit))

    def _visit(self, module: Any, _inputs: Any, _outputs: Any) -> None:
        self.visited[id(module)] = module  # returns None: a forward hook's return value replaces the output

    def exit(self, failed: bool) -> None:
        import transformer_engine.pytorch.graph as te_graph
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        try:
            if self._meta is not None:
                te_graph.restore_fp8_tensors(self.modules, list(self._meta))  # TE pops from the list it is given
                self._meta = None
        finally:
            if failed:  # read anew: a reset inside replaces the state object
                foreign_state.put(FP8GlobalStateManager.quantization_state, "skip_fp8_weight_update_tensor",
                                  self._flag_before)
                if self._flag_before is not None:
                    self._flag_before.copy_(self._flag_value_before)

    def replay(self, enabled: bool) -> "Fp8Replay | None":
        """What each replay of the graphs captured now does, or None for a variant kept in bf16."""
        if not enabled:
            return None
        return Fp8Replay(self.flag, tuple(self.visited.values()), bool(self.recipe.delayed()))


class Fp8Replay:
    """Around each replay of an FP8 graph, what TE's graphed callables do (graph.py 1068-1075,
    1134-1136, 1300-1346): fill the weight-update flag (a skip on every microbatch but the first
    refreshes no workspace), and under delayed scaling join the visited modules to the replay-time
    autocast's amax buffer; the autocast's first FP8 graph reduces and updates the backward amaxes
    after its backward replay. The forward update stays at the exit of the caller's autocast."""

    def __init__(self, flag: Any, modules: tuple[Any, ...], delayed: bool) -> None:
        from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        self.flag, self.modules, self.delayed = flag, modules, delayed
        self._manager = FP8GlobalStateManager  # resolved once: the replay path is hot
        # (module, is a base module, is attention), classified once for each replay's join.
        self._joining = tuple((m, isinstance(m, TransformerEngineBaseModule), isinstance(m, DotProductAttention))
                              for m in modules)

    def before_forward(self, update_weights: bool) -> bool:
        """Returns whether this replay is its autocast's first FP8 module (it updates after backward)."""
        self.flag.fill_(not update_weights)
        if not self._manager.is_fp8_enabled():
            return False
        first = self._manager.is_first_fp8_module()
        if self.delayed:
            self._join_amax_reduction()
        return first and self.delayed

    def after_backward(self, first: bool) -> None:
        if first:
            self._manager.reduce_and_update_fp8_tensors(forward=False)

    def _join_amax_reduction(self) -> None:
        """TE's ``new_fwd`` (graph.py 1300-1346): each module takes the replay-time group and
        recipe and joins the global amax buffer (once per autocast; TE keeps the key)."""
        manager = self._manager
        recipe, group = manager.get_fp8_recipe(), manager.get_fp8_group()
        for module, is_base, is_attention in self._joining:
            if is_attention and not (recipe.fp8_mha or recipe.fp8_dpa):
                continue
            metas = [module.fp8_meta] if is_base else \
                [module._fp8_metas[mode] for mode in ("forward", "backward") if module.num_quantizers(mode)]  # te.ops
            for meta in metas:
                meta["fp8_group"], meta["recipe"] = group, recipe
                manager.add_fp8_tensors_to_global_buffer(meta)


def _te_modules(modules: Sequence[Any]) -> list[Any]:
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    from transformer_engine.pytorch.ops.op import BasicOperation

    return [m for module in modules for m in module.modules()
            if isinstance(m, (TransformerEngineBaseModule, BasicOperation))]


def per_call_quantizers(modules: Sequence[Any]) -> Callable[[Any], tuple[str, ...]]:
    """For the arenas' ctx protection (``memory.saved_tensors._Packer.entering``): TE's per-call
    quantizer copies keep a scale snapshot the backward reads. FusedAttnFunc copies S with its
    scale cloned inside the graph (backends.py 1856-1858), a pool block another variant's replay
    may overwrite. The CP functions keep QKV/O/S copies whose scale is cloned only under delayed
    scaling (context_parallel.py 2414-2421, 3983-3990, 5038-5045). Each copy's ``scale`` goes to
    the frame's arena, a snapshot taken at forward time as FusedAttnFunc means it. The quantizers
    the modules own are shared state and are not entered. Ownership is looked up when a ctx object
    is met, by identity: DotProductAttention rebuilds its quantizers in a forward (its recipe
    state re-made), so a set of ids taken earlier goes stale, and a copy made later in the forward
    can take a freed quantizer's id (seen on Hopper: the S-scale snapshot left in the pool)."""
    import torch
    from transformer_engine.pytorch.quantized_tensor import Quantizer

    te_modules = _te_modules(modules)

    def owned(value: Any) -> bool:
        return any(value is q for module in te_modules for group in getattr(module, "quantizers", {}).values()
                   for q in group)

    def attributes(value: Any) -> tuple[str, ...]:
        if isinstance(value, Quantizer) and isinstance(getattr(value, "scale", None), torch.Tensor) and not owned(value):
            return ("scale",)  # not amax: the copy shares the module's amax, which the graphs write
        return ()

    return attributes


def fp8_workspace_storages(modules: Sequence[Any]) -> list[Any]:
    """The tensors of the FP8 weight workspaces TE modules keep between calls (data, transpose,
    scale inverse): shared by every frame, refreshed only on a first microbatch."""
    import torch

    return [value for module in _te_modules(modules)
            for workspace in getattr(module, "_fp8_workspaces", {}).values()
            for value in vars(workspace).values() if isinstance(value, torch.Tensor)]


def fp8_autocast_active() -> bool:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.is_fp8_enabled()


def _generators_out_of_capture() -> Restorable:
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
