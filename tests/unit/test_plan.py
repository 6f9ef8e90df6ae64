"""Tests for megatron_cg_plugin.planner.capture_plan: which layers and microbatches a run would capture."""

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.planner.capture_plan import CapturePlan, layer_is_graphed, plan_capture
from megatron_cg_plugin.settings import RunSettings

TE = "transformer_engine"
MOE_SCOPE_SETS = [("moe",), ("moe_router",), ("moe_router", "moe_preprocess"), ("attn", "moe_router")]


def moe_pattern(num_layers, freq):
    """Megatron's layer kinds (get_gpt_decoder_layer_specs): 1 = MoE, 0 = dense."""
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    return list(freq)


def freqs_for(num_layers):
    """Int frequencies 1..num_layers and every list pattern of that length."""
    return [*range(1, num_layers + 1), *itertools.product((0, 1), repeat=num_layers)]


GRID = [(n, f) for n in range(1, 5) for f in freqs_for(n)]


def te(**kw) -> RunSettings:
    return RunSettings(cuda_graph_impl=TE, **kw)


@pytest.mark.parametrize("num_layers, num_experts", itertools.product(range(1, 7), [None, 4]))
def test_whole_layer_graphs_every_layer(num_layers, num_experts):
    plan = plan_capture(te(num_layers=num_layers, num_experts=num_experts, moe_layer_freq=2))
    assert plan.scope == "layer"
    assert plan.graphed_layers == tuple(range(1, num_layers + 1))


@pytest.mark.parametrize("num_layers, freq", GRID)
@pytest.mark.parametrize("modules", [("attn",), ("attn", "mlp"), ("attn", "moe_router"), ("attn", "moe")])
def test_attn_graphs_every_layer(num_layers, freq, modules):
    plan = plan_capture(te(modules=modules, num_layers=num_layers, num_experts=8, moe_layer_freq=freq))
    assert plan.graphed_layers == tuple(range(1, num_layers + 1))
    assert plan.scope == "+".join(modules)


@pytest.mark.parametrize("num_layers, freq", GRID)
def test_mlp_graphs_exactly_the_dense_layers(num_layers, freq):
    pattern = moe_pattern(num_layers, freq)
    plan = plan_capture(te(modules=("mlp",), num_layers=num_layers, num_experts=4, moe_layer_freq=freq))
    assert plan.graphed_layers == tuple(i + 1 for i, kind in enumerate(pattern) if kind == 0)
    assert plan.scope == "mlp"


@pytest.mark.parametrize("num_layers", range(1, 5))
def test_mlp_graphs_every_layer_of_a_dense_model(num_layers):
    plan = plan_capture(te(modules=("mlp",), num_layers=num_layers, num_experts=None, moe_layer_freq=1))
    assert plan.graphed_layers == tuple(range(1, num_layers + 1))


@pytest.mark.parametrize("num_layers, freq", GRID)
@pytest.mark.parametrize("modules", MOE_SCOPE_SETS[:3])
def test_moe_scopes_graph_exactly_the_moe_layers(num_layers, freq, modules):
    pattern = moe_pattern(num_layers, freq)
    plan = plan_capture(te(modules=modules, num_layers=num_layers, num_experts=4, moe_layer_freq=freq))
    assert plan.graphed_layers == tuple(i + 1 for i, kind in enumerate(pattern) if kind == 1)


@pytest.mark.parametrize("num_layers, freq", GRID)
def test_mlp_plus_moe_router_graphs_every_layer(num_layers, freq):
    plan = plan_capture(te(modules=("mlp", "moe_router"), num_layers=num_layers, num_experts=4, moe_layer_freq=freq))
    assert plan.graphed_layers == tuple(range(1, num_layers + 1))


def test_moe_scope_on_dense_model_graphs_nothing():
    assert plan_capture(te(modules=("moe_router",), num_layers=3)).graphed_layers == ()


def test_single_expert_layers_are_moe_layers():
    plan = plan_capture(te(modules=("mlp",), num_layers=2, num_experts=1))
    assert plan.graphed_layers == ()


@pytest.mark.parametrize("num_layers", range(1, 5))
def test_layer_is_graphed_matches_plan(num_layers):
    facts = te(modules=("mlp",), num_layers=num_layers, num_experts=4, moe_layer_freq=2)
    plan = plan_capture(facts)
    assert plan.graphed_layers == tuple(i + 1 for i in range(num_layers) if layer_is_graphed(facts, i))


# -- microbatches -----------------------------------------------------------------------------------

PARALLEL_GRID = [
    (world, tp, pp, cp, mbs, gbs)
    for world in (1, 2, 4, 8)
    for tp, pp, cp in itertools.product((1, 2), (1, 2, 4), (1, 2))
    if world % (tp * pp * cp) == 0
    for mbs in (1, 2)
    for gbs in (8, 16, 32)
    if gbs % (mbs * (world // (tp * pp * cp))) == 0  # Megatron rejects the rest
]


@pytest.mark.parametrize("world, tp, pp, cp, mbs, gbs", PARALLEL_GRID)
def test_microbatches(world, tp, pp, cp, mbs, gbs):
    dp = world // (tp * pp * cp)
    facts = te(
        num_layers=8,
        world_size=world,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        context_parallel=cp,
        micro_batch_size=mbs,
        global_batch_size=gbs,
    )
    plan = plan_capture(facts)
    expected = gbs // (mbs * dp)
    assert plan.microbatches_per_step == expected
    assert plan.microbatches_captured == (1 if pp == 1 else expected)
    assert plan.layers_per_stage == 8 // pp


def test_microbatches_worked_example():
    # 8 ranks, TP2 x PP2 -> DP 2; 64 / (4 x 2) = 8 microbatches, all captured under PP
    plan = plan_capture(
        te(num_layers=4, world_size=8, tensor_parallel=2, pipeline_parallel=2, micro_batch_size=4, global_batch_size=64)
    )
    assert (plan.microbatches_per_step, plan.microbatches_captured) == (8, 8)
    assert plan.graphs_on_first_stage == 2 * 8
    plan = plan_capture(
        te(num_layers=4, world_size=8, tensor_parallel=2, pipeline_parallel=1, micro_batch_size=4, global_batch_size=64)
    )
    assert (plan.microbatches_per_step, plan.microbatches_captured) == (4, 1)
    assert plan.graphs_on_first_stage == 4


def test_global_batch_defaults_to_one_microbatch():
    plan = plan_capture(te(world_size=4, micro_batch_size=2, global_batch_size=None, pipeline_parallel=2))
    assert plan.microbatches_per_step == 1 and plan.microbatches_captured == 1


# -- impl none / describe ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["none", "local", "full_iteration"])
@pytest.mark.parametrize("modules", [(), ("attn",), ("mlp",)])
def test_non_te_impl_graphs_nothing(impl, modules):
    plan = plan_capture(RunSettings(cuda_graph_impl=impl, modules=modules, num_layers=4))
    assert plan.graphed_layers == ()
    assert plan.graphs_on_first_stage == 0
    text = plan.describe()
    assert f"--cuda-graph-impl {impl}" in text and "eager run" in text
    assert "graphed layers" not in text


def test_describe_te_plan():
    plan = plan_capture(
        te(
            modules=("attn", "moe_router"),
            num_layers=4,
            num_experts=4,
            world_size=4,
            pipeline_parallel=2,
            micro_batch_size=1,
            global_batch_size=8,
            warmup_steps=2,
        )
    )
    text = plan.describe()
    assert "eager run" not in text
    assert "scope: attn+moe_router" in text
    assert "graphed layers (global numbers): 1-4" in text
    assert "layers per pipeline stage: 2 in 1 model chunk(s)" in text
    assert "microbatches per step: 4; captured per layer: 4" in text
    assert "graphs per rank on the first pipeline stage: 8" in text
    assert "capture after 2 eager warmup step(s), before step 3" in text


def test_describe_says_none_when_nothing_graphed():
    text = plan_capture(te(modules=("mlp",), num_layers=2, num_experts=4)).describe()
    assert "graphed layers (global numbers): none" in text
    assert "graphs per rank on the first pipeline stage: 0" in text


# -- graphs on the first stage ----------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("freq", [1, 2, (1, 1, 1, 1, 0, 0, 0, 0), (0, 0, 0, 0, 1, 1, 1, 1), (0, 1, 0, 0, 1, 1, 0, 1)])
@pytest.mark.parametrize("modules", [(), ("mlp",), ("moe",), ("attn",)])
def test_graphs_on_first_stage_counts_first_stage_layers_only(pp, freq, modules):
    facts = te(
        modules=modules,
        num_layers=8,
        num_experts=4,
        moe_layer_freq=freq,
        world_size=pp,
        pipeline_parallel=pp,
        micro_batch_size=1,
        global_batch_size=4,
    )
    plan = plan_capture(facts)
    first_stage = range(1, 8 // pp + 1)
    expected_layers = [n for n in first_stage if n in plan.graphed_layers]
    assert plan.graphs_on_first_stage == len(expected_layers) * plan.microbatches_captured


def test_graphs_on_first_stage_excludes_later_stages():
    # MoE layers only on stage 2 of 2: a first-stage rank captures nothing for --cuda-graph-modules moe
    plan = plan_capture(
        te(
            modules=("moe",),
            num_layers=4,
            num_experts=4,
            moe_layer_freq=(0, 0, 1, 1),
            world_size=2,
            pipeline_parallel=2,
            global_batch_size=4,
        )
    )
    assert plan.graphed_layers == (3, 4)
    assert plan.graphs_on_first_stage == 0
    plan = plan_capture(
        te(
            modules=("mlp",),
            num_layers=4,
            num_experts=4,
            moe_layer_freq=(0, 0, 1, 1),
            world_size=2,
            pipeline_parallel=2,
            global_batch_size=4,
        )
    )
    assert plan.graphs_on_first_stage == 2 * 4


def test_graphs_on_first_stage_with_virtual_pipeline():
    plan = plan_capture(
        te(
            modules=("mlp",),
            num_layers=8,
            num_experts=4,
            moe_layer_freq=(1, 1, 1, 1, 0, 0, 0, 0),
            world_size=2,
            pipeline_parallel=2,
            virtual_pipeline=2,
            micro_batch_size=1,
            global_batch_size=4,
        )
    )
    assert plan.model_chunks == 2
    assert plan.graphed_layers == (5, 6, 7, 8)
    assert plan.graphs_on_first_stage == 2 * 4  # layers 5 and 6, four microbatches each


def test_plan_is_frozen():
    plan = plan_capture(te())
    assert isinstance(plan, CapturePlan)
    with pytest.raises(AttributeError):
        plan.scope = "attn"


# -- property ---------------------------------------------------------------------------------------


@st.composite
def te_facts(draw):
    num_layers = draw(st.integers(1, 12))
    freq = draw(
        st.one_of(
            st.integers(1, 4), st.lists(st.sampled_from([0, 1]), min_size=num_layers, max_size=num_layers).map(tuple)
        )
    )
    modules = tuple(
        draw(st.lists(st.sampled_from(["attn", "mlp", "moe", "moe_router", "moe_preprocess"]), unique=True, max_size=3))
    )
    return te(
        num_layers=num_layers, modules=modules, moe_layer_freq=freq, num_experts=draw(st.sampled_from([None, 2, 8]))
    )


@settings(max_examples=300, deadline=None)
@given(te_facts())
def test_graphed_layers_are_a_sorted_subset(facts):
    plan = plan_capture(facts)
    layers = plan.graphed_layers
    assert list(layers) == sorted(set(layers))
    assert set(layers) <= set(range(1, facts.num_layers + 1))
    if not facts.modules or "attn" in facts.modules:
        assert layers == tuple(range(1, facts.num_layers + 1))
    # every layer is either graphed or excluded for a reason: its kind is not in the scope
    for n in set(range(1, facts.num_layers + 1)) - set(layers):
        moe_layer = facts.is_moe_layer(n - 1)
        assert "attn" not in facts.modules
        assert (
            ("mlp" not in facts.modules)
            if not moe_layer
            else not ({"moe", "moe_router", "moe_preprocess"} & set(facts.modules))
        )


@pytest.mark.parametrize("world, min_cp, banks", [(2, 1, (1, 2)), (4, 1, (1, 2, 4)), (4, 2, (2, 4)), (8, 8, (8,))])
def test_graph_banks_in_the_plan(world, min_cp, banks):
    facts = RunSettings(
        cuda_graph_impl="transformer_engine",
        hybrid_context_parallel=True,
        graph_banks=True,
        world_size=world,
        bank_min_cp=min_cp,
        num_layers=3,
    )
    plan = plan_capture(facts)
    assert plan.banks == banks
    assert plan.graphs_on_first_stage == 3 * len(banks)
    assert f"graph banks for CP sizes {', '.join(map(str, banks))}" in plan.describe()
    assert plan_capture(dataclasses.replace(facts, graph_banks=False)).banks == ()
    assert plan_capture(dataclasses.replace(facts, cuda_graph_impl="none")).banks == ()


@pytest.mark.parametrize("modules, per_layer", [((), 2), (("attn",), 2), (("mlp",), 1), (("attn", "mlp"), 2)])
def test_banks_without_attention_in_the_scope_share_one_graph_per_layer(modules, per_layer):
    facts = RunSettings(
        cuda_graph_impl="transformer_engine",
        hybrid_context_parallel=True,
        graph_banks=True,
        world_size=2,
        num_layers=3,
        modules=modules,
    )
    plan = plan_capture(facts)
    assert plan.banks == (1, 2) and plan.graphs_on_first_stage == 3 * per_layer
    assert ("one graph per layer serves every bank" in plan.describe()) == (per_layer == 1)


@pytest.mark.parametrize(
    "numbers, text",
    [([], ""), ([4], "4"), ([1, 2], "1, 2"), ([1, 2, 3, 5, 7, 8], "1-3, 5, 7, 8"), ([9, 1, 3, 2], "1-3, 9")],
)
def test_layer_lists_print_three_or_more_in_a_row_as_a_range(numbers, text):
    from megatron_cg_plugin.planner.capture_plan import number_ranges

    assert number_ranges(numbers) == text
    assert number_ranges(range(1, 100_001)) == "1-100000"  # one short line, not 100,000 numbers
