"""What the planners predict for a run before any GPU work, from its ``settings.RunSettings`` and the
plugin config in force: the graph pool and arenas (``planner.graph_memory``) and the fixed-capacity
MoE plan (``moe.capacity``). ``megatron-cg plan`` prints them; an installed run hands them to its
session (``RunPrediction``) for the report to set beside what the run measures. A prediction never
stops a run: where the planner cannot model the layers it logs why and predicts nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.moe.capacity import MoeCapacityPlan, capacity_plan
from megatron_cg_plugin.planner.graph_memory import GraphMemoryPlan, plan_for_run
from megatron_cg_plugin.settings import RunSettings

__all__ = [
    "RunPrediction",
    "model_config_adds",
    "predict_graph_memory",
    "predict_run",
    "repredict_graph_memory",
    "with_model_config",
]

_log = logging.getLogger(__name__)

# TransformerConfig fields that change the prediction and that megatron-core 0.19.2 has no flag for
# (a user's script sets them on the model config after the flags are parsed), with their defaults;
# each is a field of ``RunSettings`` of the same name.
_MODEL_CONFIG_ONLY_FIELDS = {"fp8_dot_product_attention": False}


@dataclasses.dataclass(frozen=True)
class RunPrediction:
    """What the planners predicted for a run whose flags the rules passed, for the report to set
    beside what the run measures: the graph pool and arenas (None: not predicted), the
    fixed-capacity MoE plan (None: no such MoE), and ``repredict``, the prediction for the built
    model's ``TransformerConfig`` (None: nothing to redo)."""

    graph_memory: GraphMemoryPlan | None = None
    moe_capacity: MoeCapacityPlan | None = None
    repredict: Callable[[Any], GraphMemoryPlan | None] | None = None


def predict_graph_memory(settings: RunSettings, config: PluginConfig) -> GraphMemoryPlan | None:
    """``planner.graph_memory``'s prediction for the run under the plugin ``config`` in force, or None
    where nothing is TE-graphed or the planner cannot model the layers (the reason is logged)."""
    if not settings.te_graphs:
        return None
    try:
        return plan_for_run(settings, config=config)
    except (ValueError, TypeError, AttributeError) as error:  # a user script's parser may lack flags
        _log.warning("graph memory not predicted: %s", error)
        return None


def model_config_adds(settings: RunSettings, model_config: Any) -> bool:
    """The built model's ``TransformerConfig`` differs from the flags in a field the prediction reads."""
    return any(
        hasattr(model_config, name) and getattr(model_config, name) != getattr(settings, name, default)
        for name, default in _MODEL_CONFIG_ONLY_FIELDS.items()
    )


def with_model_config(settings: RunSettings, model_config: Any) -> RunSettings:
    """``settings`` with the ``_MODEL_CONFIG_ONLY_FIELDS`` the built model's ``TransformerConfig`` holds
    in place of the flags'."""
    seen = {name: getattr(model_config, name) for name in _MODEL_CONFIG_ONLY_FIELDS if hasattr(model_config, name)}
    return dataclasses.replace(settings, **seen)


def repredict_graph_memory(settings: RunSettings, config: PluginConfig, model_config: Any) -> GraphMemoryPlan | None:
    """``predict_graph_memory`` for the settings ``with_model_config`` (None: not predicted, as there)."""
    return predict_graph_memory(with_model_config(settings, model_config), config)


def _predict_moe_capacity(settings: RunSettings) -> MoeCapacityPlan | None:
    """``moe.capacity``'s plan for the run, or None (a dense or dropless model, or flags Megatron's own
    checks refuse first: logged)."""
    try:
        return capacity_plan(settings)
    except (ValueError, TypeError, AttributeError) as error:
        _log.warning("MoE capacity not planned: %s", error)
        return None


def predict_run(settings: RunSettings, config: PluginConfig) -> RunPrediction:
    """Both predictions for an installed run, and how to redo the first for the built model's
    ``TransformerConfig`` (only where it differs from the flags in a ``_MODEL_CONFIG_ONLY_FIELDS`` field)."""
    graph_memory = predict_graph_memory(settings, config)

    def repredict(model_config: Any) -> GraphMemoryPlan | None:
        if not model_config_adds(settings, model_config):
            return graph_memory  # as the flags predicted it
        return repredict_graph_memory(settings, config, model_config)

    return RunPrediction(graph_memory=graph_memory, moe_capacity=_predict_moe_capacity(settings), repredict=repredict)
