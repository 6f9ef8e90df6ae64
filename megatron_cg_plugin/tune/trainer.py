"""The tune's trainer on Megatron's side (GPU): the bench's ``MegatronTrainer`` whose arms are setups of
different scopes and capture modes, captured on the same model's layers.

Megatron 0.19.2's layers read the graphed scope from their ``TransformerConfig`` at every capture and
replay (``TransformerLayer._te_cuda_graph_capture`` and ``_te_cuda_graph_replay`` branch on
``config.cuda_graph_modules``, ``_layer_is_graphable`` picks the layers from it), and the plugin's
helper reads it there too. So an arm is its graphs (the layers' graph lists, which
``MegatronTrainer`` switches) plus its scope: the trainer sets every config the model's modules hold
to the arm's scope before it captures or steps it, and back to the built one for eager. Of what
Megatron fixes from the scope at build time, the alltoall dispatcher's device-to-host copy point is
set per arm as its own build would (``candidates.dispatcher_dtoh_point``); the rest stays the built
model's (``candidates.build_time_notes`` names it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megatron_cg_plugin import foreign_state
from megatron_cg_plugin.bench.command import MegatronTrainer
from megatron_cg_plugin.capture_lifecycle import bind_helper_class
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.session import RunSession
from megatron_cg_plugin.setups.graph_setups import EAGER, GraphSetup
from megatron_cg_plugin.slot_sharing.megatron_backend import SlotBackend
from megatron_cg_plugin.slot_sharing.offload_groups import OffloadCopies
from megatron_cg_plugin.tune.candidates import dispatcher_dtoh_point

__all__ = ["TuneTrainer"]


class TuneTrainer(MegatronTrainer):
    """``MegatronTrainer`` with one arm per setup label: ``setups`` gives each its setup and the plugin config
    its own flags resolve (what its helper's session reports to and checks with)."""

    def __init__(
        self,
        train_step: Callable[..., Any],
        step_args: tuple,
        step_kwargs: dict,
        *,
        setups: Mapping[str, tuple[GraphSetup, PluginConfig]],
    ) -> None:
        super().__init__(train_step, step_args, step_kwargs)
        self.setups = dict(setups)
        # Every config object a module holds (MoE shared experts deep-copy theirs), the step's own first.
        configs = {id(self.config): self.config}
        for chunk in self.model:
            for module in chunk.modules():
                config = getattr(module, "config", None)
                if config is not None and hasattr(config, "cuda_graph_modules"):
                    configs.setdefault(id(config), config)
        self._configs = list(configs.values())
        # MoE layers' alltoall dispatchers (plain objects beside the modules), each with its copy point
        self._dispatchers: list[Any] = [
            dispatcher
            for chunk in self.model
            for module in chunk.modules()
            if hasattr(dispatcher := getattr(module, "token_dispatcher", None), "cuda_dtoh_point")
        ]
        # The built model's scope, put back when no arm is active (ledger: tune-scope)
        self._built = [
            foreign_state.save(config, "cuda_graph_modules", change="tune-scope") for config in self._configs
        ]

    def helper_class(self, arm: str) -> Any:
        if arm not in self.helpers:
            setup, config = self.setups[arm]
            session = RunSession(config)
            backend = SlotBackend(offload=setup.offloads, copies=OffloadCopies.of(config)) if setup.slot else None
            self.helpers[arm] = bind_helper_class(self._te_helper, session, backend)
        return self.helpers[arm]

    def _scope(self, arm: str) -> None:
        """Every config of the model set to ``arm``'s scope (eager: the built model's, which replays nothing)
        and every alltoall dispatcher to the copy point ``arm``'s own build would give it."""
        from megatron.core.transformer.enums import CudaGraphModule

        setup = GraphSetup(graphed=False) if arm == EAGER else self.setups[arm][0]
        for config, built in zip(self._configs, self._built, strict=True):
            modules = built.value if arm == EAGER else [CudaGraphModule[name] for name in setup.modules]
            foreign_state.put(config, "cuda_graph_modules", modules)
        for dispatcher in self._dispatchers:
            foreign_state.put(dispatcher, "cuda_dtoh_point", dispatcher_dtoh_point(setup))

    def capture(self, arm: str) -> Any:
        self._scope(arm)
        try:
            return super().capture(arm)
        except BaseException:
            self._scope(EAGER)
            raise

    def activate(self, arm: str) -> None:
        super().activate(arm)
        self._scope(arm)

    def deactivate(self) -> None:
        super().deactivate()
        self._scope(EAGER)

    def release(self, helper: Any) -> None:
        super().release(helper)
        self._scope(EAGER)
