"""FP8 in slot-shared capture: TE's quantization state around warmup, capture and each replay.

Which FP8 recipes slot-shared capture takes (``slot_fp8_refusal``); the autocast TE's own capture
runs under (``fp8_capture_autocast``); the amax histories, scales and weight-update flag saved
around the capture and joined to TE's reduction at replay (``Fp8Capture``, ``Fp8Replay``); and the
per-call quantizer copies and FP8 workspaces the arenas must hold or leave out
(``per_call_quantizers``, ``fp8_workspace_storages``). docs/fp8.md says how to use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_cg_plugin import foreign_state

__all__ = [
    "Fp8Capture",
    "Fp8Replay",
    "fp8_autocast_active",
    "fp8_capture_autocast",
    "fp8_workspace_storages",
    "per_call_quantizers",
    "slot_fp8_refusal",
]


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
        return (
            f"slot-shared capture takes FP8 with delayed or current scaling (--fp8-recipe delayed|tensorwise); "
            f"{type(recipe).__name__} is not verified in slot-shared graphs."
        )
    if (recipe.fp8_dpa or recipe.fp8_mha) and not recipe.delayed():
        return (
            "slot-shared capture takes FP8 attention (recipe fp8_dpa / fp8_mha) with delayed scaling only: "
            "FP8 attention under current scaling is not verified (TE 2.20.2 with cuDNN 9.14 on the verified "
            "H200 finds no FP8 attention backend for it); use DelayedScaling (--fp8-recipe delayed) or turn FP8 "
            "attention off."
        )
    if recipe.delayed() and not modules:
        return (
            "slot-shared capture with delayed scaling needs the TE modules the variants call: pass "
            "SlotFp8(recipe, modules=...) so their amax histories are restored after capture and reduced at replay."
        )
    if _fused_operations(modules):  # rule slot-capture-fp8-op-fuser
        return (
            "slot-shared capture with FP8 does not cover Transformer Engine's fused operations (te.ops; "
            "Megatron's --use-transformer-engine-op-fuser): they run without module hooks, so replays would not "
            "join their FP8 state to TE's amax reduction; drop --use-transformer-engine-op-fuser."
        )
    return None


def _fused_operations(modules: Sequence[Any]) -> bool:
    """The modules hold te.ops operations (whose forwards a fuser runs, not their module call)."""
    import torch

    try:
        from transformer_engine.pytorch.ops.op import BasicOperation
    except ImportError:  # without TE no module is one of its operations
        return False
    return any(
        isinstance(m, BasicOperation)
        for module in modules
        if isinstance(module, torch.nn.Module)
        for m in module.modules()
    )


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
                foreign_state.put(
                    FP8GlobalStateManager.quantization_state, "skip_fp8_weight_update_tensor", self._flag_before
                )
                if self._flag_before is not None:
                    self._flag_before.copy_(self._flag_value_before)

    def replay(self, enabled: bool) -> Fp8Replay | None:
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
        self._joining = tuple(
            (m, isinstance(m, TransformerEngineBaseModule), isinstance(m, DotProductAttention)) for m in modules
        )

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
            metas = (
                [module.fp8_meta]
                if is_base
                else [module._fp8_metas[mode] for mode in ("forward", "backward") if module.num_quantizers(mode)]
            )  # te.ops
            for meta in metas:
                meta["fp8_group"], meta["recipe"] = group, recipe
                manager.add_fp8_tensors_to_global_buffer(meta)


def _te_modules(modules: Sequence[Any]) -> list[Any]:
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    from transformer_engine.pytorch.ops.op import BasicOperation

    return [
        m
        for module in modules
        for m in module.modules()
        if isinstance(m, (TransformerEngineBaseModule, BasicOperation))
    ]


def per_call_quantizers(modules: Sequence[Any]) -> Callable[[Any], tuple[str, ...]]:
    """For the arenas' ctx protection (``slot_sharing.saved_tensors._Packer.entering``): TE's per-call
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
        return any(
            value is q for module in te_modules for group in getattr(module, "quantizers", {}).values() for q in group
        )

    def attributes(value: Any) -> tuple[str, ...]:
        if (
            isinstance(value, Quantizer)
            and isinstance(getattr(value, "scale", None), torch.Tensor)
            and not owned(value)
        ):
            return ("scale",)  # not amax: the copy shares the module's amax, which the graphs write
        return ()

    return attributes


def fp8_workspace_storages(modules: Sequence[Any]) -> list[Any]:
    """The tensors of the FP8 weight workspaces TE modules keep between calls (data, transpose,
    scale inverse): shared by every frame, refreshed only on a first microbatch."""
    import torch

    return [
        value
        for module in _te_modules(modules)
        for workspace in getattr(module, "_fp8_workspaces", {}).values()
        for value in vars(workspace).values()
        if isinstance(value, torch.Tensor)
    ]


def fp8_autocast_active() -> bool:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.is_fp8_enabled()
