"""Tests for megatron_cg_plugin.setups.graph_setups: the one list of a model's graph setups that the memory
guard (test_memory_guard.py) and megatron-cg tune (test_tune.py) read. Which setups each kind of model
gets, the settings and flags each is built with, the rules' refusals each carries, and its prediction."""

from __future__ import annotations

import dataclasses

import pytest
from test_memory_guard import DEFAULTS, dense  # the guard's model, graphed whole by TE

from megatron_cg_plugin import rules
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.planner.graph_memory import GraphMemoryPlan, plan_for_run
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.setups.graph_setups import (
    OFFLOAD_ENVIRONMENT,
    CaptureNeed,
    GraphSetup,
    ModelKind,
    enumerate_setups,
    graph_bytes,
    graph_setups,
    scopes,
    setup_settings,
)

TE = "transformer_engine"
ATTENTION = "core_attn attn_proj"


def moe(**changes) -> RunSettings:
    """The guard's model with 8 experts on every layer, alltoall, dropless unless ``changes`` give a capacity."""
    base = dict(num_experts=8, moe_ffn_hidden_size=1024, dispatcher="alltoall", modules=("attn",))
    return dense(**(base | changes))


def labels(kind: ModelKind) -> list[str]:
    return [setup.label for setup in graph_setups(kind)]


# -- which setups a model gets -------------------------------------------------------------------


def test_a_dense_model_gets_attn_attn_mlp_and_the_whole_layer_each_te_slot_and_slot_with_attention_offloaded():
    assert labels(ModelKind()) == [
        "attn",
        "attn, slot",
        "attn, slot, attention offloaded",
        "attn mlp",
        "attn mlp, slot",
        "attn mlp, slot, attention offloaded",
        "whole layer",
        "whole layer, slot",
        "whole layer, slot, attention offloaded",
    ]


def test_a_dropless_moe_gets_the_router_and_preprocess_scope_and_no_mlp_or_moe_block():
    found = labels(ModelKind(moe=True, dense_layers=False))
    assert "attn moe_router moe_preprocess" in found and "attn moe_router moe_preprocess, slot" in found
    assert not any("mlp" in label.split() or "moe" in label.split() for label in found)
    assert "whole layer" in found  # kept: the rules refuse it with their reason (whole-layer-moe-needs-drop-and-pad)


def test_a_moe_with_a_capacity_factor_also_gets_the_moe_block_whole():
    assert scopes(ModelKind(moe=True, dense_layers=False, capacity_factor=1.5)) == (
        ("attn",),
        ("attn", "moe_router", "moe_preprocess"),
        ("attn", "moe"),
        (),
    )


def test_a_moe_with_dense_layers_graphs_their_mlp_beside_the_moe_scopes():
    found = labels(ModelKind(moe=True, dense_layers=True, capacity_factor=1.0))
    assert {"attn mlp", "attn mlp moe_router moe_preprocess", "attn mlp moe"} <= set(found)


def test_the_runs_own_scope_comes_first_where_it_is_none_of_its_kinds():
    assert scopes(ModelKind(modules=("mlp",)))[0] == ("mlp",)
    assert scopes(ModelKind(modules=("attn", "mlp"))) == scopes(ModelKind())  # already there: not twice


def test_offload_flags_double_every_setup_and_attention_offload_adds_to_the_runs_modules():
    with_offload = graph_setups(ModelKind(offload=True, offload_modules=("qkv_linear",)))
    without = [setup for setup in graph_setups(ModelKind()) if not setup.attention_offload]
    assert len([setup for setup in with_offload if not setup.attention_offload]) == 2 * len(without)
    assert {"attn, offload", "attn", "attn, slot, offload", "attn, slot"} <= {setup.label for setup in with_offload}
    attention = [setup for setup in with_offload if setup.attention_offload]
    assert len(attention) == len(scopes(ModelKind())) and all(setup.offload and setup.slot for setup in attention)
    # A run that offloads attention's groups already has nothing to add.
    assert not any(
        setup.attention_offload
        for setup in graph_setups(ModelKind(offload=True, offload_modules=("core_attn", "attn_proj")))
    )


def test_the_model_kind_is_read_from_the_settings():
    plain = ModelKind.of(RunSettings(num_layers=4))
    assert plain == ModelKind()
    mixed = ModelKind.of(
        RunSettings(num_layers=4, num_experts=8, moe_layer_freq=2, capacity_factor=1.25, activation_offloading=True)
    )
    assert mixed.moe and mixed.dense_layers and mixed.capacity_factor == 1.25 and not mixed.offload  # no modules
    all_moe = ModelKind.of(RunSettings(num_layers=2, num_experts=4, activation_offloading=True, offload_modules=("x",)))
    assert not all_moe.dense_layers and all_moe.offload and all_moe.capacity_factor is None
    assert all_moe.offload_modules == ("x",) and all_moe.modules is None  # no graphs: no scope of its own
    assert all_moe.describe() == "MoE, dropless, with activation offload flags"
    assert ModelKind.of(dense(modules=("attn",))).modules == ("attn",)


# -- each setup built, checked and predicted -----------------------------------------------------


@pytest.mark.parametrize(
    "run",
    [
        dense(),
        dense(modules=("attn",), slot_capture=True, activation_offloading=True, offload_modules=("qkv_linear",)),
        moe(),
        moe(capacity_factor=1.0, pad_to_capacity=True),
        dense(pipeline_parallel=2, world_size=2),
    ],
    ids=["dense", "dense-offloading", "moe-dropless", "moe-drop-and-pad", "dense-pp2"],
)
def test_each_setup_is_checked_by_the_rules_and_predicted_by_the_planner(run):
    found = enumerate_setups(run, DEFAULTS)
    assert [setup.graph for setup in found] == list(graph_setups(ModelKind.of(run)))
    assert any(not setup.refused for setup in found)
    for setup in found:
        assert setup.settings is not None and setup.config is not None
        assert setup.refused == tuple(rules.violations(setup.settings))
        if setup.refused:
            assert setup.plan is None and setup.need is None
            continue
        assert setup.plan == plan_for_run(setup.settings, config=setup.config)
        assert setup.need == CaptureNeed.of(setup.plan)
        assert (setup.settings.modules, setup.settings.slot_capture) == (setup.graph.modules, setup.graph.slot)
        assert setup.config.slot_capture == setup.graph.slot


@pytest.mark.parametrize(
    "run, label, rule",
    [
        (moe(), "whole layer", "whole-layer-moe-needs-drop-and-pad"),
        (moe(), "attn moe_router moe_preprocess, slot", "slot-capture-scope"),
        (moe(capacity_factor=1.0, pad_to_capacity=True), "attn moe, slot, attention offloaded", "offload-moe-scope"),
        (dense(pipeline_parallel=2, world_size=2), "attn, slot", "slot-capture-pipeline"),
        (
            dense(position_embedding_type="learned_absolute"),
            "attn, slot, attention offloaded",
            "offload-learned-positions",
        ),
    ],
)
def test_a_refused_setup_stays_in_the_list_with_its_rule(run, label, rule):
    (refused,) = [setup for setup in enumerate_setups(run, DEFAULTS) if setup.graph.label == label]
    assert rule in [name for name, _ in refused.refused] and refused.plan is None


def test_the_flags_to_add_and_to_drop_and_the_environment_of_each_setup():
    run = dense(modules=("attn",), slot_capture=True)
    by_label = {setup.graph.label: setup for setup in enumerate_setups(run, DEFAULTS)}
    assert by_label["attn, slot"].command_line == ""  # the run's own
    assert by_label["attn"].command_line == "without --cg-slot-capture"
    assert by_label["whole layer"].command_line == "without --cuda-graph-modules --cg-slot-capture"
    offloaded = by_label["attn mlp, slot, attention offloaded"]
    assert offloaded.command_line == (
        f"--cuda-graph-modules attn mlp --fine-grained-activation-offloading --offload-modules {ATTENTION}"
    )
    assert offloaded.environment == (OFFLOAD_ENVIRONMENT,)
    assert offloaded.settings.offload_modules == ("core_attn", "attn_proj") and offloaded.settings.activation_offloading
    assert all(setup.environment == () for setup in by_label.values() if not setup.graph.attention_offload)
    eager = dataclasses.replace(run, cuda_graph_impl="none", modules=(), slot_capture=False)
    assert {setup.flags[0] for setup in enumerate_setups(eager, DEFAULTS)} == {f"--cuda-graph-impl {TE}"}


def test_without_the_runs_offload_its_knobs_go_and_with_it_they_stay():
    run = dense(
        modules=("attn",),
        slot_capture=True,
        activation_offloading=True,
        offload_modules=("qkv_linear",),
        min_offloaded_tensor_size=4096,
    )
    config = PluginConfig(slot_capture=True, offload_window=2)
    kept, _ = setup_settings(run, config, GraphSetup(graphed=True, modules=("attn",), slot=True, offload=True))
    assert kept == run
    dropped, dropped_config = setup_settings(run, config, GraphSetup(graphed=True, modules=("attn",), slot=True))
    assert not dropped.activation_offloading and dropped.offload_modules == ()
    assert dropped.min_offloaded_tensor_size != 4096 and dropped_config.offload_window == PluginConfig().offload_window
    te, te_config = setup_settings(run, config, GraphSetup(graphed=True, modules=("attn",), offload=True))
    assert te.activation_offloading and not te_config.slot_capture  # TE's graphs take no slot offload knobs:
    assert te_config.offload_window == PluginConfig().offload_window  # Megatron's offload, not the plugin's


def test_a_setup_its_build_refuses_carries_the_refusal_and_no_settings():
    asked: list[tuple[GraphSetup, tuple[str, ...]]] = []

    def build(graph, environment):
        asked.append((graph, environment))
        if graph.slot:
            raise rules.RuleViolation([("megatron", "Megatron refuses it")])
        return setup_settings(dense(), DEFAULTS, graph)[0], None

    found = enumerate_setups(dense(), DEFAULTS, build=build)
    assert [graph for graph, _ in asked] == list(graph_setups(ModelKind.of(dense())))
    assert all(env == ((OFFLOAD_ENVIRONMENT,) if graph.attention_offload else ()) for graph, env in asked)
    for setup in found:
        if setup.graph.slot:
            assert setup.refused == (("megatron", "Megatron refuses it"),) and setup.settings is None
        else:
            assert setup.config == PluginConfig() and setup.plan is not None


def test_graph_bytes_are_the_captures_gpu_bytes():
    plan = GraphMemoryPlan(
        pool_bytes=5, peak_live_bytes=4, graphs=1, arena_bytes=7, boundary_bytes=11, thd_buffer_bytes=17
    )
    assert graph_bytes(plan) == CaptureNeed.of(plan).device_bytes == 5 + 7 + 11 + 17
    assert graph_bytes(dataclasses.replace(plan, host_arena_bytes=100)) == graph_bytes(plan)  # pinned host: not GPU
    assert graph_bytes(None) is None
