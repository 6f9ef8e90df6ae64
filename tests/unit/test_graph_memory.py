"""The graph-pool planner: the caching-allocator model (planner.allocator) and the capture programs of
TE layers (planner.graph_memory), on CPU. The measured figures here are graph pools and arenas of real
captures on an H200 (benchmarks/planner_pool, planner_slot and planner_fp8 publish them)."""

from __future__ import annotations

import dataclasses
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.planner import allocator
from megatron_cg_plugin.planner.allocator import PoolModel, round_request, segment_size
from megatron_cg_plugin.planner.graph_memory import (
    LayerShape,
    MoeShape,
    attention_workspace,
    plan_for_run,
    plan_graph_memory,
    scope_parts,
)
from megatron_cg_plugin.settings import RunSettings, read_settings

MiB = 2**20
DEFAULTS = PluginConfig()  # the prediction reads the offload copies and window from the config in force


@pytest.mark.parametrize(
    "size, rounded, segment",
    [
        (1, 512, 2 * MiB),
        (512, 512, 2 * MiB),
        (513, 1024, 2 * MiB),
        (MiB, MiB, 2 * MiB),
        (MiB + 1, MiB + 512, 20 * MiB),
        (10 * MiB - 512, 10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB, 10 * MiB),
        (134349056, 134349312, 130 * MiB),  # cuDNN's s=2048 workspace: the 130 MiB segment seen
    ],
)
def test_requests_round_and_take_the_segments_the_caching_allocator_makes(size, rounded, segment):
    assert round_request(size) == rounded
    assert segment_size(rounded) == segment


def test_small_requests_share_a_2mib_segment_and_large_ones_split_only_above_1mib():
    pool = PoolModel()
    handles = [pool.malloc(256 * 1024) for _ in range(8)]  # 8 x 256 KiB fill one 2 MiB segment
    assert pool.reserved == 2 * MiB
    pool.malloc(1)
    assert pool.reserved == 4 * MiB
    big = pool.malloc(3 * MiB)  # a 20 MiB segment, split: 17 MiB stay free
    assert pool.reserved == 24 * MiB
    pool.malloc(15 * MiB)  # >= 10 MiB: fits the 17 MiB remainder (best fit), no new segment
    assert pool.reserved == 24 * MiB
    for handle in [*handles, big]:
        pool.free(handle)
    assert pool.allocated == round_request(1) + 15 * MiB


def test_a_freed_block_merges_with_its_free_neighbours():
    pool = PoolModel()
    a, b, c = (pool.malloc(4 * MiB) for _ in range(3))  # one 20 MiB segment: 4 + 4 + 4, 8 free
    pool.free(a)
    pool.free(c)
    pool.free(b)  # a, b, c and the tail are one 20 MiB block again
    pool.malloc(20 * MiB)
    assert pool.reserved == 20 * MiB


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 24 * MiB), st.booleans()), min_size=1, max_size=60))
def test_the_pool_never_holds_less_than_its_live_bytes_and_frees_balance(requests):
    pool = PoolModel()
    live = []
    for size, free_one in requests:
        live.append(pool.malloc(size))
        assert pool.allocated <= pool.peak_allocated <= pool.reserved
        if free_one and len(live) > 1:
            pool.free(live.pop(0))
    reserved = pool.reserved
    for handle in live:
        pool.free(handle)
    assert pool.allocated == 0 and pool.reserved == reserved  # graph pools keep their segments
    # Everything free again: each segment is one block, so the largest request fits without growing.
    pool.malloc(max(s for s, _ in requests))
    assert pool.reserved == reserved


def tiny(**changes):
    base = dict(seq=256, micro_batch=2, hidden=256, ffn=1024, heads=4, query_groups=4, head_dim=64, rope=True)
    return LayerShape(**(base | changes))


def test_the_attention_workspace_is_the_one_measured():
    assert attention_workspace(tiny()) == 1057024  # traces/dense_tiny_dropout: fused_attn_bwd
    big = tiny(seq=2048, micro_batch=1, hidden=1024, heads=16, query_groups=16)
    assert attention_workspace(big) == 134349056  # traces/dense_1024
    assert attention_workspace(dataclasses.replace(big, deterministic=False)) == 131072 + 256
    gqa = tiny(seq=512, hidden=512, heads=8, query_groups=2)
    assert attention_workspace(gqa) - attention_workspace(dataclasses.replace(gqa, query_groups=8)) == 2 * MiB


def test_tiny_pools_are_one_20mib_segment_and_a_few_2mib_ones():
    attn = plan_graph_memory([tiny()] * 2, ["attn"])
    assert attn.pool_bytes == 26 * MiB  # the farm's tiny_gpt_attn measured 26 MiB
    assert attn.peak_live_bytes < 6 * MiB
    # Not deterministic: the workspace stays in the small pool, so no 20 MiB segment.
    assert plan_graph_memory([tiny(deterministic=False)] * 2, ["attn"]).pool_bytes < 20 * MiB


def test_more_layers_more_tokens_and_wider_scopes_never_take_less():
    shapes = [tiny(seq=1024, micro_batch=1, hidden=1024, heads=16, query_groups=16, ffn=4096)]
    two, four = plan_graph_memory(shapes * 2, []), plan_graph_memory(shapes * 4, [])
    assert four.pool_bytes > two.pool_bytes and four.peak_live_bytes > two.peak_live_bytes
    attn = plan_graph_memory(shapes * 2, ["attn"])
    assert attn.pool_bytes < two.pool_bytes  # the MLP's saves come on top
    longer = [dataclasses.replace(shapes[0], seq=2048)] * 2
    assert plan_graph_memory(longer, []).pool_bytes > two.pool_bytes


def test_dropout_masks_and_gated_mlps_are_counted():
    shapes = [tiny(seq=1024, hidden=1024, heads=16, query_groups=16, ffn=4096)]
    plain = plan_graph_memory(shapes * 2, [])
    masks = plan_graph_memory([dataclasses.replace(shapes[0], hidden_dropout=True)] * 2, [])
    # Without biases: the bias-GELU's column sum (a temporary of the ungated MLP's backward) stays out of it.
    gated = plan_graph_memory([dataclasses.replace(shapes[0], gated=True, bias=False)] * 2, [])
    ungated = plan_graph_memory([dataclasses.replace(shapes[0], bias=False)] * 2, [])
    assert masks.peak_live_bytes - plain.peak_live_bytes >= 2 * shapes[0].tokens * shapes[0].hidden  # a byte each
    assert gated.peak_live_bytes > ungated.peak_live_bytes  # fc1's doubled output is saved


def test_moe_scopes_count_the_experts_only_when_the_graph_holds_them():
    moe = MoeShape(experts=4, topk=2, ffn=512, rows=4 * 384)
    shape = tiny(gated=True, bias=False, moe=moe)
    whole = plan_graph_memory([shape] * 2, ["attn", "moe"])
    router = plan_graph_memory([shape] * 2, ["attn", "moe_router", "moe_preprocess"])
    assert whole.peak_live_bytes > router.peak_live_bytes
    more_rows = plan_graph_memory(
        [dataclasses.replace(shape, moe=dataclasses.replace(moe, rows=8 * 384))] * 2, ["attn", "moe"]
    )
    assert more_rows.peak_live_bytes > whole.peak_live_bytes


def test_a_router_graph_holds_the_shared_experts_megatron_computes_before_routing():
    """MoELayer runs shared_experts_compute before the router, inside a moe_router graph (the fine-grained MoE
    case: 64 experts top-6 with a shared expert, `attn moe_router moe_preprocess`, was predicted 0.82x without
    them); with --moe-shared-expert-overlap the dispatcher runs them, outside the graph."""
    base = MoeShape(experts=8, topk=6, ffn=256, rows=6 * 1024)
    shapes = {
        name: [tiny(gated=True, bias=False, seq=1024, micro_batch=1, hidden=512, moe=moe)] * 3
        for name, moe in {
            "none": base,
            "shared": dataclasses.replace(base, shared_ffn=704),
            "overlap": dataclasses.replace(base, shared_ffn=704, shared_overlap=True),
        }.items()
    }
    scope = ["attn", "moe_router", "moe_preprocess"]
    plan = {name: plan_graph_memory(layers, scope) for name, layers in shapes.items()}
    saves = 1024 * (2 * 704 + 704 + 512) * 2  # fc1 (gated), the activation and fc2's output, bf16
    assert plan["shared"].peak_live_bytes - plan["none"].peak_live_bytes >= 3 * saves
    assert plan["overlap"].peak_live_bytes == plan["none"].peak_live_bytes
    whole = {name: plan_graph_memory(layers, ["attn", "moe"]) for name, layers in shapes.items()}
    assert whole["overlap"] == whole["shared"]  # the whole block holds them either way: modelled once


def test_unknown_scopes_and_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="--cuda-graph-modules mamba: the memory planner knows only"):
        scope_parts(["mamba"])
    with pytest.raises(ValueError, match="6 attention heads do not divide into 4 query groups"):
        tiny(heads=6, query_groups=4)
    with pytest.raises(ValueError, match="seq must be >= 1"):
        tiny(seq=0)


def megatron_args(**changes):
    base = dict(
        num_attention_heads=4,
        group_query_attention=False,
        num_query_groups=None,
        kv_channels=None,
        hidden_size=256,
        seq_length=256,
        micro_batch_size=2,
        ffn_hidden_size=1024,
        swiglu=False,
        add_bias_linear=True,
        normalization="LayerNorm",
        position_embedding_type="rope",
        hidden_dropout=0.0,
        moe_router_topk=2,
        moe_ffn_hidden_size=512,
        moe_shared_expert_intermediate_size=None,
        moe_router_dtype=None,
        expert_model_parallel_size=1,
        multi_latent_attention=False,
        mtp_num_layers=None,
        attention_backend=types.SimpleNamespace(name="auto"),
        num_experts=None,
        moe_expert_capacity_factor=None,
        context_parallel_size=1,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        expert_tensor_parallel_size=1,
    )
    return types.SimpleNamespace(**(base | changes))


_DEFAULT_SETTINGS = RunSettings()


def run_settings(args, facts: RunSettings, *, deterministic: bool = True) -> RunSettings:
    """A run's settings: Megatron's ``args`` (``read_settings``) under what ``facts`` sets away from
    the defaults (the rules' side of a test run), deterministic as NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 makes it."""
    flags = types.SimpleNamespace(**({"num_layers": facts.num_layers} | vars(args)))
    read, _config = read_settings(flags)
    given = {
        field.name: getattr(facts, field.name)
        for field in dataclasses.fields(RunSettings)
        if getattr(facts, field.name) != getattr(_DEFAULT_SETTINGS, field.name)
    }
    return dataclasses.replace(read, **given, deterministic=deterministic)


def plan_of(args, facts: RunSettings, *, config: PluginConfig, deterministic: bool):
    return plan_for_run(run_settings(args, facts, deterministic=deterministic), config=config)


def test_flags_become_shapes_and_what_the_model_leaves_out_is_named():
    facts = RunSettings(cuda_graph_impl="transformer_engine", num_layers=2, modules=("attn",))
    plan = plan_of(megatron_args(), facts, config=DEFAULTS, deterministic=True)
    assert plan.pool_bytes == plan_graph_memory([tiny()] * 2, ["attn"]).pool_bytes and plan.unpredicted == ()
    left_out = plan_of(
        megatron_args(
            multi_latent_attention=True,
            mtp_num_layers=1,
            fp8="hybrid",
            fp8_recipe="blockwise",
            attention_backend=types.SimpleNamespace(name="unfused"),
        ),
        dataclasses.replace(facts, fp8=True),
        config=DEFAULTS,
        deterministic=True,
    ).unpredicted
    assert len(left_out) == 4 and any("FP8" in what for what in left_out) and any("unfused" in w for w in left_out)
    offloaded = plan_of(
        megatron_args(), dataclasses.replace(facts, activation_offloading=True), config=DEFAULTS, deterministic=True
    ).unpredicted
    assert offloaded == ("Megatron's activation offloading (its offloaded saves leave the pool)",)
    in_graphs = plan_of(
        megatron_args(
            fine_grained_activation_offloading=True,
            offload_modules=["core_attn"],
            min_offloaded_tensor_size=65536,
            activation_offload_fraction=1.0,
        ),
        dataclasses.replace(facts, activation_offloading=True, slot_capture=True),
        config=DEFAULTS,
        deterministic=True,
    )
    # The slot planner counts what it offloads; the copies' transient buffers in the pool it names as left out.
    assert in_graphs.host_arena_bytes > 0 and in_graphs.unpredicted == (
        "in-graph offload's staging and reload buffers in the pool (up to --cg-offload-window + 1 groups' bytes)",
    )
    assert (
        "not predicted: "
        in plan_of(megatron_args(mtp_num_layers=1), facts, config=DEFAULTS, deterministic=True).describe()
    )


def test_packed_graphs_print_their_layouts_bound():
    facts = RunSettings(
        cuda_graph_impl="transformer_engine",
        num_layers=2,
        modules=("attn",),
        micro_batch_size=2,
        inter_document_masking=True,
        thd_max_seqs=8,
        seq_length=256,
    )
    plan = plan_of(megatron_args(), facts, config=DEFAULTS, deterministic=True)
    assert plan.thd_buffer_bytes == 2 * 9 * 4 and "9 cu_seqlens entries, max_seqlen 256" in plan.describe()
    bounded = plan_of(
        megatron_args(), dataclasses.replace(facts, thd_max_seqlen=64), config=DEFAULTS, deterministic=True
    )
    assert "9 cu_seqlens entries, max_seqlen 64" in bounded.describe()
    unpacked = plan_of(
        megatron_args(),
        dataclasses.replace(facts, thd_max_seqs=None, inter_document_masking=False),
        config=DEFAULTS,
        deterministic=True,
    )
    assert unpacked.thd_layout is None and "cu_seqlens" not in unpacked.describe()


def test_moe_flags_size_the_experts_by_the_capacity_megatron_fixes():
    facts = RunSettings(
        cuda_graph_impl="transformer_engine",
        num_layers=2,
        modules=("attn", "moe"),
        num_experts=4,
        capacity_factor=1.5,
        pad_to_capacity=True,
    )
    args = megatron_args(swiglu=True, add_bias_linear=False, num_experts=4, moe_expert_capacity_factor=1.5)
    plan = plan_of(args, facts, config=DEFAULTS, deterministic=True)
    expected = plan_graph_memory(
        [tiny(gated=True, bias=False, moe=MoeShape(experts=4, topk=2, ffn=512, rows=4 * 384))] * 2, ["attn", "moe"]
    )
    assert plan.pool_bytes == expected.pool_bytes == 30 * MiB  # the farm's tiny_moe_droppad: 30 MiB measured


def test_no_graphed_layer_predicts_an_empty_pool():
    facts = RunSettings(
        cuda_graph_impl="transformer_engine", num_layers=2, modules=("mlp",), num_experts=4, capacity_factor=None
    )
    assert (
        plan_of(megatron_args(), facts, config=DEFAULTS, deterministic=True).pool_bytes == 0
    )  # mlp scope, every layer MoE


def test_segment_constants_are_the_allocators():
    assert (MiB, 2 * MiB, 20 * MiB) == (allocator.SMALL_REQUEST, allocator.SMALL_SEGMENT, allocator.LARGE_SEGMENT)


def big(**changes):
    return LayerShape(
        **(
            {
                "seq": 2048,
                "micro_batch": 1,
                "hidden": 1024,
                "ffn": 4096,
                "heads": 16,
                "query_groups": 16,
                "head_dim": 64,
                "rope": True,
            }
            | changes
        )
    )


def offloaded_host_bytes(layers, modules, policy):
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory

    return plan_slot_memory(layers, modules, policy).host_arena_bytes


def first_layer_host_bytes(shape, modules, policy):
    """A layer's offload where it is not the last (the last keeps its groups, as Megatron does)."""
    return offloaded_host_bytes([shape, shape], modules, policy)


def test_host_arenas_are_the_attention_storages_every_save_of_which_megatrons_groups_offload():
    from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy

    act = 2048 * 1024 * 2  # a [tokens, hidden] bf16 activation: 4 MiB
    every = OffloadPolicy.from_flags(["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"])
    # Input, norm output, q, k, v and the attention output (its stats and RNG are under the 1M-element minimum),
    # of every layer but the last, which keeps its groups as Megatron does: 264 MiB, as measured on the GPU.
    assert offloaded_host_bytes([big()] * 12, ["attn", "mlp"], every) == 11 * 6 * act
    # Without attn_proj, the attention output is saved outside the offloaded groups too: it stays (alias rule).
    core = OffloadPolicy.from_flags(["core_attn"])
    assert first_layer_host_bytes(big(), ["attn"], core) == 3 * act
    # Without RoPE, q, k and v are views of one QKV storage, moved whole; GQA shrinks k and v.
    assert first_layer_host_bytes(big(rope=False), ["attn"], core) == 3 * act
    assert first_layer_host_bytes(big(query_groups=4), ["attn"], core) == act  # k, v: 512K elements, under 1M
    any_size = OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=0)
    assert (
        first_layer_host_bytes(big(query_groups=4), ["attn"], any_size) == act + 2 * act // 4 + 128 * 1024 + 256
    )  # with the stats and the RNG state (aligned)
    # The minimum size, an MLP-only graph and a policy without attention groups offload nothing.
    tiny_shape = tiny(rope=True)
    small = OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=10**9)
    assert first_layer_host_bytes(tiny_shape, ["attn"], small) == 0
    assert first_layer_host_bytes(big(), ["mlp"], every) == 0
    assert first_layer_host_bytes(big(), ["attn"], OffloadPolicy.from_flags(["mlp_norm"])) == 0


def test_slot_capture_runs_get_the_host_arena_prediction_and_others_none():
    facts = RunSettings(
        cuda_graph_impl="transformer_engine",
        num_layers=2,
        modules=("attn",),
        slot_capture=True,
        activation_offloading=True,
        offload_modules=("core_attn",),
    )
    args = megatron_args(
        fine_grained_activation_offloading=True,
        offload_modules=["core_attn"],
        min_offloaded_tensor_size=65536,
        activation_offload_fraction=1.0,
    )
    plan = plan_of(args, facts, config=DEFAULTS, deterministic=True)
    assert plan.host_arena_bytes == 3 * 256 * 2 * 256 * 2  # q, k, v of the first layer (the last keeps its own)
    assert "pinned host arenas (predicted, --cg-slot-capture offload): 0.8 MiB" in plan.describe()
    assert (
        plan_of(
            args, dataclasses.replace(facts, slot_capture=False), config=DEFAULTS, deterministic=True
        ).host_arena_bytes
        is None
    )


# -- --cg-slot-capture: arenas, boundary buffers, the pool of temporaries ----------------------------------

EVERY_ATTENTION_GROUP = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")


def dense_1b(**changes):
    return big(**({"hidden": 2048, "ffn": 8192, "head_dim": 128} | changes))


# Measured on the H200 (each run's report): (layers, modules, policy flags, GPU arena bytes, host, pool MiB).
MEASURED_SLOT_RUNS = {
    # Measured on the 12x1024 bench, slot arm.
    "12x1024 slot": (big(), 12, ("attn", "mlp"), None, 813570048, None, 252),
    # Measured after offload followed Megatron's choice across the layers (the last layer keeps its groups):
    # the slot-offload farm cases (gpt_12x1024_slot_offload_user_script; tiny_gpt_slot_offload;
    # tiny_moe_slot_offload, attention only; gpt_1b_slot_offload_user_script, whole layer; tiny_gpt_slot_fp8_offload).
    "12x1024 slot-offload": (
        big(),
        12,
        ("attn", "mlp"),
        (EVERY_ATTENTION_GROUP, 1024 * 1024),
        536745984,
        276824064,
        272,
    ),
    "tiny_gpt_slot_offload": (tiny(), 2, (), (("attn_norm", "core_attn", "mlp_norm"), 65536), 7767040, 786432, 26),
    "tiny_moe_slot_offload": (
        tiny(gated=True, bias=False),
        2,
        ("attn",),
        (("attn_norm", "core_attn", "expert_fc1", "moe_act"), 65536),
        2515968,
        786432,
        24,
    ),
    "1b slot-offload": (dense_1b(), 16, (), (EVERY_ATTENTION_GROUP, 1024 * 1024), 1411915776, 754974720, 480),
    # The FP8 slot farm cases (quantized saves), whole layers;
    # tensorwise keeps its first and last layers in bf16.
    "tiny_gpt_slot_fp8_delayed": ([tiny(fp8_recipe="delayed")] * 3, 3, (), None, 10867200, None, 26),
    "tiny_gpt_slot_fp8_tensorwise": (
        [tiny(), tiny(fp8_recipe="tensorwise"), tiny(fp8_recipe="tensorwise"), tiny()],
        4,
        (),
        None,
        15535616,
        None,
        26,
    ),
    "tiny_gpt_slot_fp8_offload": (  # qkv_linear offloaded too: its FP8 input goes to the host
        [tiny(), tiny(fp8_recipe="tensorwise"), tiny(fp8_recipe="tensorwise"), tiny()],
        4,
        (),
        (("attn_norm", "qkv_linear", "core_attn", "mlp_norm"), 65536),
        11865600,
        3670016,
        26,
    ),
    # A user-sized FP8 GPT (5 x 2048, ffn 8192, seq 2048, FP8 hybrid,
    # RoPE, no dropout) through Megatron-LM's pretrain_gpt.py; mbs 2 took 788 MiB of pool predicted (1.21x) while
    # the bias-GELU column sum was tokens x ffn x 8.
    "5x2048 tensorwise mbs 2": (
        big(hidden=2048, ffn=8192, head_dim=128, micro_batch=2, fp8_recipe="tensorwise"),
        5,
        (),
        None,
        1097406720,
        None,
        652,
    ),
    "5x2048 delayed mbs 2": (
        big(hidden=2048, ffn=8192, head_dim=128, micro_batch=2, fp8_recipe="delayed"),
        5,
        (),
        None,
        1139351040,
        None,
        652,
    ),
    "5x2048 tensorwise mbs 1": (
        big(hidden=2048, ffn=8192, head_dim=128, fp8_recipe="tensorwise"),
        5,
        (),
        None,
        551328000,
        None,
        420,
    ),
    "5x2048 tensorwise h1024 mbs 2": (
        big(heads=8, query_groups=8, head_dim=128, micro_batch=2, fp8_recipe="tensorwise"),
        5,
        (),
        None,
        551491840,
        None,
        388,
    ),
    # tiny_gpt_slot_fp8_attention_user_script, FP8 dot-product attention
    # (delayed scaling, head size 128, non-deterministic cuDNN), whole layers; modelled after the run, not held out.
    "tiny_gpt_slot_fp8_attention_user_script": (
        [tiny(heads=2, query_groups=2, head_dim=128, deterministic=False, fp8_recipe="delayed", fp8_attention=True)]
        * 3,
        3,
        (),
        None,
        9480960,
        None,
        6,
    ),
}


@pytest.mark.parametrize("name", sorted(MEASURED_SLOT_RUNS))
def test_slot_arenas_are_predicted_to_the_byte_and_the_pool_within_15_percent(name):
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory
    from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy

    shape, layers, modules, policy, arenas, host, pool_mib = MEASURED_SLOT_RUNS[name]
    offload = None if policy is None else OffloadPolicy.from_flags(policy[0], min_tensor_elements=policy[1])
    plan = plan_slot_memory(shape if isinstance(shape, list) else [shape] * layers, modules, offload)
    assert plan.arena_bytes == arenas
    assert plan.host_arena_bytes == host
    assert 0.85 <= plan.pool_bytes / (pool_mib * MiB) <= 1.15
    assert plan.graphs == layers  # one per layer, as on the TE path


def test_slot_arenas_are_the_forwards_saves_less_its_output_plus_its_input():
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory

    shape = big()
    act = shape.act(shape.hidden)  # 4 MiB
    norm_stats = 2 * 2048 * 4  # mean and rsigma, fp32 per token
    attention_small = 128 * 1024 + norm_stats + 512 * 1024 + 256 + 256  # softmax stats, RoPE table, RNG, cu_seqlens
    # The whole layer keeps input, norm output, q, k, v, attention output, the residual sum, the MLP norm output
    # (8 activations) and fc1's and GELU's outputs (4 each): 16 activations.
    assert plan_slot_memory([shape], ()).arena_bytes == 16 * act + attention_small + norm_stats
    # Attention alone: its output (the residual sum) goes to the boundary, not the arena.
    assert plan_slot_memory([shape], ("attn",)).arena_bytes == 6 * act + attention_small
    # An MLP-only graph saves its input, the norm output and fc1's and GELU's outputs; SwiGLU's fc1 is twice as wide.
    mlp = plan_slot_memory([shape], ("mlp",)).arena_bytes
    assert mlp == 10 * act + norm_stats
    assert plan_slot_memory([big(gated=True)], ("mlp",)).arena_bytes == mlp + 4 * act
    assert plan_slot_memory([big(rmsnorm=True)], ("mlp",)).arena_bytes == mlp - norm_stats // 2  # no mean


def test_slot_boundaries_are_each_graphs_output_and_gradients_and_one_layers_parameter_gradients():
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory

    shape = big()
    act = shape.act(shape.hidden)
    h, ffn = shape.hidden, shape.ffn
    attention = 2 * h + 3 * h * h + 3 * h + h * h + h  # norm, QKV, projection (weights and biases)
    mlp = 2 * h + h * ffn + ffn + ffn * h + h
    # Megatron's sample arguments are the static inputs: output, output gradient, input gradient per graph.
    assert plan_slot_memory([shape] * 3, ()).boundary_bytes == 3 * 3 * act + 2 * (attention + mlp)
    assert plan_slot_memory([shape], ("attn",)).boundary_bytes == 3 * act + 2 * attention
    assert plan_slot_memory([shape], ("mlp",)).boundary_bytes == 3 * act + 2 * mlp
    # The tiny GPT's whole layers: a GPU run measured 4069888 B with copies of the inputs (hidden states, Megatron's
    # [2, 1, 256, 256] bool mask, the [256, 1, 1, 64] fp32 RoPE table); adopted, those 2 x 448 KiB are Megatron's.
    assert plan_slot_memory([tiny()] * 2, ()).boundary_bytes == 4069888 - 2 * (256 * 1024 + 128 * 1024 + 64 * 1024)
    # An MoE layer's graphed block brings its router and experts' gradients; an attn graph does not.
    moe = tiny(gated=True, bias=False, moe=MoeShape(experts=4, topk=2, ffn=512, rows=1024))
    experts = 256 * 4 + 4 * (256 * 1024 + 512 * 256) + 2 * 256
    assert (
        plan_slot_memory([moe], ("attn", "moe")).boundary_bytes - plan_slot_memory([moe], ("attn",)).boundary_bytes
        == 2 * experts
    )


def test_the_slot_pool_holds_one_graphs_temporaries_not_every_layers_saves():
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory

    layers = [big()] * 12
    slot, te = plan_slot_memory(layers, ("attn",)), plan_graph_memory(layers, ["attn"])
    assert slot.pool_bytes < te.pool_bytes / 2  # TE's pool keeps every layer's saves (440 MiB measured)
    assert plan_slot_memory([big()] * 24, ("attn",)).pool_bytes == slot.pool_bytes  # no more with more layers


# PyTorch's reduce kernel's staging buffer for a bias gradient's column sum, as the H200 traces allocated it:
# (rows, columns, bytes). Dense traces at 2048 and 1024 hidden (bias-GELU, 2048 tokens), an FP8 trace
# (the QKV bias under current scaling, 4 x 1024), the farm case
# gpt_5x2048_slot_fp8_tensorwise_megatron_lm (4096 tokens: bias-GELU and the QKV bias), tiny models (512 tokens).
TRACED_COLUMN_SUMS = [
    (2048, 8192, 128 * MiB),
    (2048, 4096, 64 * MiB),
    (2048, 3072, 48 * MiB),
    (4096, 8192, 132 * MiB),
    (4096, 6144, 132 * MiB),
    (512, 1024, 0),
    (512, 4096, 0),
]


@pytest.mark.parametrize("rows, cols, traced", TRACED_COLUMN_SUMS)
def test_the_bias_gradients_column_sum_stages_what_the_reduce_kernel_allocated(rows, cols, traced):
    from megatron_cg_plugin.planner.reduction import column_sum_workspace

    assert column_sum_workspace(rows, cols) == traced


def test_the_column_sum_stops_growing_once_its_blocks_fill_the_gpu():
    """Twice the tokens of 2048 x 8192 take 132 MiB, not the 256 MiB of ``tokens x ffn x 8``, the
    model of the 2048-token traces that over-predicted the 5 x 2048 FP8 slot pool (808 MiB, 1.30x)."""
    from megatron_cg_plugin.planner.reduction import column_sum_workspace

    assert column_sum_workspace(8192, 8192) == column_sum_workspace(4096, 8192) < 4096 * 8192 * 8
    # The SM count sizes it: on 66 SMs, 17 blocks a column (66 x 16 blocks of 128 threads over 64) instead of 33.
    assert column_sum_workspace(4096, 8192, multiprocessors=66) == 4 * 8192 * 17 * 128


def _temps(shape, parts):
    from megatron_cg_plugin.planner.graph_memory import _graph

    _, bwd = _graph(shape, scope_parts(parts), "")
    return {name: nbytes for action, name, nbytes in bwd.ops if action == "alloc" and name.endswith("column_sum")}


def test_the_backward_sums_the_bias_gelu_bias_and_under_current_scaling_the_qkv_bias():
    assert _temps(big(), ()) == {"mlp.bias.column_sum": 64 * MiB}
    assert _temps(big(gated=True), ()) == _temps(big(bias=False), ()) == {}  # no fused bias-GELU
    assert _temps(big(), ["attn"]) == _temps(big(fp8_recipe="delayed"), ["attn"]) == {}  # TE fuses the bias gradient
    assert _temps(big(fp8_recipe="tensorwise"), ["attn"]) == {"dqkv.column_sum": 48 * MiB}
    # Each graph frees it at once; the pool keeps its segment, which a graph without it does not take.
    assert (
        plan_graph_memory([big()] * 2, []).pool_bytes
        >= plan_graph_memory([big(bias=False)] * 2, []).pool_bytes + 56 * MiB
    )


def test_the_5x2048_fp8_slot_case_is_predicted_from_its_flags_within_15_percent(tmp_path):
    """Farm case gpt_5x2048_slot_fp8_tensorwise_megatron_lm (620 MiB measured, and its allocator
    trace): 808 MiB predicted (1.30x) while the bias-GELU column sum
    was ``tokens x ffn x 8`` (256 MiB at 4096 tokens where the kernel staged 132); now 684 (1.10x)."""
    from megatron_cg_plugin.farm import runner
    from megatron_cg_plugin.launch import dry_run
    from megatron_cg_plugin.planner.prediction import predict_graph_memory

    case, _ = runner.prepare_case(runner.case_folder("gpt_5x2048_slot_fp8_tensorwise_megatron_lm"), out_dir=tmp_path)
    env = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", **dict(case.env)}
    args, facts, config = dry_run.validated_args(case.checked_flags(graphed=True, out_dir=tmp_path), nproc=1, env=env)
    plan = predict_graph_memory(facts, config)
    assert facts.slot_capture and args.fp8_recipe == "tensorwise" and args.hidden_dropout > 0
    assert abs(plan.pool_bytes / (620 * MiB) - 1) <= 0.15, plan.pool_bytes / MiB


def test_slot_runs_get_the_arena_and_boundary_prediction_and_graphs_that_end_in_the_moe_block_are_refused():
    facts = RunSettings(cuda_graph_impl="transformer_engine", num_layers=2, modules=("attn",), slot_capture=True)
    plan = plan_of(megatron_args(), facts, config=DEFAULTS, deterministic=True)
    assert plan.arena_bytes is not None and plan.boundary_bytes is not None and plan.host_arena_bytes is None
    assert "GPU arenas (predicted, --cg-slot-capture)" in plan.describe()
    assert not any("slot" in what for what in plan.unpredicted)
    te = plan_of(megatron_args(), dataclasses.replace(facts, slot_capture=False), config=DEFAULTS, deterministic=True)
    assert te.arena_bytes is None and "GPU arenas" not in te.describe()
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory

    moe = tiny(moe=MoeShape(experts=4, topk=2, ffn=512, rows=1024))
    with pytest.raises(ValueError, match="not --cuda-graph-modules attn moe_router on an MoE layer"):
        plan_slot_memory([moe], ("attn", "moe_router"))
    with pytest.raises(ValueError, match="not --cuda-graph-modules moe on a dense layer"):
        plan_slot_memory([tiny()], ("moe",))
    assert plan_graph_memory([], ["attn"]).pool_bytes == 0  # no layer, no transient either


def test_parameter_gradient_buffers_keep_every_layout_the_layers_need():
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory

    dense = tiny(gated=True, bias=False)
    moe = dataclasses.replace(dense, moe=MoeShape(experts=2, topk=2, ffn=512, rows=1024, router_experts=8))
    h = 256
    attention = 2 * h + 3 * h * h + h * h
    dense_mlp = 2 * h + 2 * 1024 * h + 1024 * h
    experts = 2 * h + 8 * h + 2 * (2 * 512 * h + 512 * h)  # norm, a router over all 8 experts (EP 4), 2 local experts

    def boundary(layers):
        return plan_slot_memory(layers, ()).boundary_bytes - sum(
            3 * shape.act(h) for shape in layers
        )  # less activations

    assert boundary([dense, dense]) == 2 * (attention + dense_mlp)  # one layer's worth, shared
    # A dense and an MoE layer: the MoE block's buffers come on top of the dense MLP's, not instead.
    assert boundary([dense, moe]) == 2 * (attention + dense_mlp + experts - 2 * h)  # the norm layout is shared


def test_ropes_table_follows_the_rotary_percent():
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory

    full, half = plan_slot_memory([big()], ("attn",)), plan_slot_memory([big(rotary_dim=32)], ("attn",))
    table = 2048 * 64 * 4
    assert full.arena_bytes - half.arena_bytes == table // 2  # the saved table


def test_what_the_slot_plan_leaves_out_is_named():
    base = dict(
        fine_grained_activation_offloading=True, min_offloaded_tensor_size=65536, activation_offload_fraction=1.0
    )
    facts = RunSettings(
        cuda_graph_impl="transformer_engine", num_layers=2, slot_capture=True, activation_offloading=True
    )
    args, attention = (
        megatron_args(**base, offload_modules=["core_attn"]),
        dataclasses.replace(facts, offload_modules=("core_attn",)),
    )
    in_graph = plan_of(args, attention, config=DEFAULTS, deterministic=True)
    staged = plan_of(
        args, attention, config=PluginConfig(slot_capture=True, offload_copies="between-replays"), deterministic=True
    )
    per_layer = in_graph.host_arena_bytes // 2
    assert staged.arena_bytes == in_graph.arena_bytes + 2 * per_layer  # the staging ring's two buffers
    assert not any("between-replays" in what for what in staged.unpredicted)
    moe_facts = dataclasses.replace(
        facts, num_experts=4, capacity_factor=1.5, pad_to_capacity=True, offload_modules=("core_attn", "expert_fc1")
    )
    moe = plan_of(
        megatron_args(
            **base,
            offload_modules=["core_attn", "expert_fc1"],
            swiglu=True,
            add_bias_linear=False,
            num_experts=4,
            moe_expert_capacity_factor=1.5,
        ),
        moe_facts,
        config=DEFAULTS,
        deterministic=True,
    )
    assert any("MoE block's saves" in what for what in moe.unpredicted)
    cp = plan_of(
        megatron_args(context_parallel_size=2),
        RunSettings(cuda_graph_impl="transformer_engine", num_layers=2, context_parallel=2, world_size=2),
        config=DEFAULTS,
        deterministic=True,
    )
    assert any("context parallelism" in what for what in cp.unpredicted)


def test_the_offload_copies_and_window_come_from_the_config_in_force_not_the_flags():
    """An ``install(config)`` run's flags keep their defaults (in-graph, window 1): the prediction
    must follow the config, the staging ring of window + 1 buffers and no note on in-graph copies."""
    base = dict(
        fine_grained_activation_offloading=True,
        min_offloaded_tensor_size=65536,
        activation_offload_fraction=1.0,
        offload_modules=["core_attn"],
        num_layers=4,
    )
    facts = RunSettings(
        cuda_graph_impl="transformer_engine",
        num_layers=4,
        slot_capture=True,
        activation_offloading=True,
        offload_modules=("core_attn",),
    )
    in_graph = plan_of(megatron_args(**base), facts, config=DEFAULTS, deterministic=True)
    per_layer = in_graph.host_arena_bytes // 3  # Megatron keeps the last layer's saves on the GPU
    flags = megatron_args(**base, cg_offload_copies="in-graph", cg_offload_window=1)
    for window in (1, 2):
        staged = plan_of(
            flags,
            facts,
            config=PluginConfig(slot_capture=True, offload_copies="between-replays", offload_window=window),
            deterministic=True,
        )
        assert staged.arena_bytes == in_graph.arena_bytes + (window + 1) * per_layer  # the staging ring
        assert staged.unpredicted == ()
    assert (
        plan_of(megatron_args(**base, cg_offload_copies="between-replays"), facts, config=DEFAULTS, deterministic=True)
        == in_graph
    )


DENSE_SHAPES = st.builds(
    lambda seq, mb, heads, groups, head_dim, ffn_mult, gated, bias, rmsnorm, rope: LayerShape(
        seq=seq,
        micro_batch=mb,
        hidden=heads * head_dim,
        ffn=heads * head_dim * ffn_mult,
        heads=heads,
        query_groups=groups if heads % groups == 0 else heads,
        head_dim=head_dim,
        gated=gated,
        bias=bias,
        rmsnorm=rmsnorm,
        rope=rope,
    ),
    st.sampled_from([128, 256, 512, 2048]),
    st.integers(1, 2),
    st.sampled_from([2, 4, 8]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([32, 64]),
    st.integers(2, 4),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
POLICIES = st.builds(
    lambda modules, minimum: (tuple(sorted(modules)), minimum),
    st.sets(st.sampled_from(["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]), min_size=1),
    st.sampled_from([0, 65536, 1024 * 1024]),
)


@settings(max_examples=60, deadline=None)
@given(DENSE_SHAPES, st.integers(1, 3), st.sampled_from([(), ("attn",), ("mlp",), ("attn", "mlp")]), POLICIES)
def test_slot_offload_moves_arena_bytes_to_the_host_and_leaves_the_rest_alone(shape, layers, modules, policy):
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory
    from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy

    kept = plan_slot_memory([shape] * layers, modules)
    offloaded = plan_slot_memory(
        [shape] * layers, modules, OffloadPolicy.from_flags(policy[0], min_tensor_elements=policy[1])
    )
    assert offloaded.arena_bytes + offloaded.host_arena_bytes == kept.arena_bytes  # every byte goes one way
    assert 0 <= offloaded.host_arena_bytes <= kept.arena_bytes
    assert (offloaded.pool_bytes, offloaded.boundary_bytes) == (kept.pool_bytes, kept.boundary_bytes)
    # More identical layers: arenas and boundary activations add up, the shared pool and buffers do not grow.
    more = plan_slot_memory([shape] * (layers + 1), modules)
    assert more.arena_bytes - kept.arena_bytes == kept.arena_bytes // layers
    assert more.pool_bytes == kept.pool_bytes
    assert more.boundary_bytes - kept.boundary_bytes == 3 * shape.act(shape.hidden)


def test_fp8_layers_save_their_gemm_inputs_quantized_and_delayed_scaling_also_the_projections():
    from megatron_cg_plugin.planner.graph_memory import fp8_quantized_saves, plan_slot_memory

    bf16 = plan_slot_memory([tiny()], ()).arena_bytes
    tokens, hidden, ffn, q = 512, 256, 1024, 256
    scale_inv = 256  # a 4-byte scale inverse of its own, arena-aligned
    # Two norm outputs and the second MLP linear's input go from 2 bytes an element to 1, each with a scale inverse.
    quantized = -(2 * tokens * hidden + tokens * ffn) + 3 * scale_inv
    assert plan_slot_memory([tiny(fp8_recipe="tensorwise")], ()).arena_bytes == bf16 + quantized
    # Delayed scaling: the output projection keeps a quantized copy of attention's output as well.
    assert plan_slot_memory([tiny(fp8_recipe="delayed")], ()).arena_bytes == bf16 + quantized + tokens * q + scale_inv
    assert fp8_quantized_saves(tiny(), frozenset({"attn", "mlp"})) == {}  # a bf16 layer
    assert set(fp8_quantized_saves(tiny(fp8_recipe="delayed"), frozenset({"attn"}))) == {"ln1.out", "proj.input"}


def test_fp8_flags_pick_the_layers_megatron_runs_in_fp8():
    base = dict(fp8="hybrid", fp8_recipe="tensorwise", num_layers=4)
    facts = RunSettings(
        cuda_graph_impl="transformer_engine", num_layers=4, slot_capture=True, fp8=True, fp8_recipe="tensorwise"
    )
    every = plan_of(megatron_args(**base), facts, config=DEFAULTS, deterministic=True)
    ends = plan_of(
        megatron_args(**base, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1),
        facts,
        config=DEFAULTS,
        deterministic=True,
    )
    plain = plan_of(
        megatron_args(fp8=None, num_layers=4),
        dataclasses.replace(facts, fp8=False),
        config=DEFAULTS,
        deterministic=True,
    )
    per_layer = (plain.arena_bytes - every.arena_bytes) // 4
    assert per_layer > 0 and ends.arena_bytes == plain.arena_bytes - 2 * per_layer  # layers 2 and 3 in FP8
    assert not any("FP8" in what for what in ends.unpredicted)
    te_path = plan_of(
        megatron_args(**base), dataclasses.replace(facts, slot_capture=False), config=DEFAULTS, deterministic=True
    )
    assert not any("FP8" in what for what in te_path.unpredicted)  # tensorwise is modelled on TE's path too
    assert (
        te_path.pool_bytes
        != plan_of(
            megatron_args(fp8=None, num_layers=4),
            dataclasses.replace(facts, fp8=False, slot_capture=False),
            config=DEFAULTS,
            deterministic=True,
        ).pool_bytes
    )
    mxfp8 = plan_of(
        megatron_args(**base | {"fp8_recipe": "mxfp8"}),
        dataclasses.replace(facts, slot_capture=False, fp8_recipe="mxfp8"),
        config=DEFAULTS,
        deterministic=True,
    )
    assert mxfp8.unpredicted == ("FP8 recipe 'mxfp8' (modelled as tensorwise)",)


# TE's own graph pools under FP8, measured (the report's pool bytes), from which
# the FP8 programs were written: (layers, --cuda-graph-modules, measured MiB).
def _four_by_1024(**changes):
    return [big(heads=8, query_groups=8, head_dim=128, **changes)] * 4


def _tiny_attention(**changes):
    return [tiny(heads=2, query_groups=2, head_dim=128, deterministic=False, **changes)] * 3


MEASURED_TE_FP8_POOLS = {
    "4x1024 bf16 (the baseline)": (_four_by_1024(), (), 432),
    "4x1024 fp8 delayed": (_four_by_1024(fp8_recipe="delayed"), (), 400),
    "4x1024 fp8 tensorwise": (_four_by_1024(fp8_recipe="tensorwise"), (), 380),
    "4x1024 fp8 delayed attn": (_four_by_1024(fp8_recipe="delayed"), ("attn",), 200),
    "4x1024 fp8 tensorwise attn": (_four_by_1024(fp8_recipe="tensorwise"), ("attn",), 180),
    "4x1024 fp8 attention (non-deterministic)": (
        _four_by_1024(fp8_recipe="delayed", fp8_attention=True, deterministic=False),
        (),
        318,
    ),
    "tiny_gpt_fp8_delayed": ([tiny(fp8_recipe="delayed")] * 3, (), 34),
    "tiny_gpt_fp8_tensorwise": ([tiny(), tiny(fp8_recipe="tensorwise"), tiny(fp8_recipe="tensorwise"), tiny()], (), 38),
    "tiny_gpt_fp8_attention_user_script": (_tiny_attention(fp8_recipe="delayed", fp8_attention=True), (), 12),
}


@pytest.mark.parametrize("name", sorted(MEASURED_TE_FP8_POOLS))
def test_te_graph_pools_under_fp8_are_predicted_within_5_percent(name):
    """Within 5% (all but one exact), where the bf16 programs gave 1.11-1.33 on five of them."""
    layers, modules, measured = MEASURED_TE_FP8_POOLS[name]
    assert abs(plan_graph_memory(layers, modules).pool_bytes / (measured * MiB) - 1) <= 0.05


def test_the_te_programs_keep_what_the_slot_arenas_count_as_fp8_saves():
    """Both paths read one rule (fp8_quantized_saves for the arenas, the programs' column-wise copies
    for TE's pool): a GEMM input kept for backward, 1 byte an element."""
    from megatron_cg_plugin.planner.graph_memory import _graph, fp8_quantized_saves

    in_programs = {
        "ln1.out": "ln1.out.col",
        "proj.input": "o.in.col",
        "ln2.out": "ln2.out.col",
        "mlp.act": "mlp.act.in.col",
    }
    for recipe in ("delayed", "tensorwise"):
        shape = tiny(fp8_recipe=recipe)
        parts = scope_parts(())
        fwd, _ = _graph(shape, parts, "")
        kept = {}
        for action, name, nbytes in fwd.ops:
            if action == "alloc":
                kept[name] = nbytes
            else:
                kept.pop(name, None)
        columnwise = {name: nbytes for name, nbytes in kept.items() if name.endswith(".col")}
        assert columnwise == {
            in_programs[name]: shape.tokens * width for name, width in fp8_quantized_saves(shape, parts).items()
        }


def test_moe_layers_with_fp8_attention_are_planned_with_bf16_experts():
    moe = tiny(
        gated=True,
        bias=False,
        fp8_recipe="delayed",
        fp8_attention=True,
        heads=2,
        query_groups=2,
        head_dim=128,
        moe=MoeShape(experts=4, topk=2, ffn=512, rows=4 * 384, shared_ffn=256),
    )
    assert plan_graph_memory([moe] * 2, ["attn", "moe"]).pool_bytes > 0
    facts = RunSettings(
        cuda_graph_impl="transformer_engine",
        num_layers=2,
        modules=("attn", "moe"),
        num_experts=4,
        capacity_factor=None,
        fp8=True,
        fp8_recipe="delayed",
    )
    left_out = plan_of(
        megatron_args(fp8="hybrid", fp8_recipe="delayed"), facts, config=DEFAULTS, deterministic=True
    ).unpredicted
    assert "FP8 MoE experts, routed and shared (modelled as bf16 in TE's graph pool)" in left_out


def test_fp8_quantize_buffers_change_tes_pool():
    """Written as bf16 (the model before the FP8 traces), the FP8-attention farm case came out at 16 MiB against 12."""
    layers, modules, measured = MEASURED_TE_FP8_POOLS["tiny_gpt_fp8_attention_user_script"]
    assert plan_graph_memory(_tiny_attention(), modules).pool_bytes == 16 * MiB
    assert plan_graph_memory(layers, modules).pool_bytes == measured * MiB


@pytest.mark.parametrize("window, measured", [(1, 1512579072), (3, 1613242368)])  # measured on the GPU
def test_the_staging_ring_is_window_plus_one_buffers_of_a_layers_offload(window, measured):
    """The 1B, every attention group offloaded, copies between
    replays: the GPU arenas (saves that stay plus the ring) as measured."""
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory
    from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy

    policy = OffloadPolicy.from_flags(EVERY_ATTENTION_GROUP, min_tensor_elements=1024 * 1024)
    plan = plan_slot_memory([dense_1b()] * 16, ("attn", "mlp"), policy, staging_depth=window + 1)
    assert plan.arena_bytes == measured


def test_a_larger_layer_than_its_ring_buffer_gets_a_buffer_of_its_own():
    from megatron_cg_plugin.planner.graph_memory import staging_ring_bytes

    assert staging_ring_bytes([10, 10, 10, 10], 2) == 20
    # Position 0: sized 10 by the first layer, so the third's 30 gets a buffer of its own; position 1: the fourth's 10.
    assert staging_ring_bytes([10, 0, 30, 10], 2) == 10 + 30 + 10
    assert staging_ring_bytes([0, 0], 2) == 0


def test_fp8_attention_keeps_quantized_q_k_v_and_output_and_the_s_scale_snapshot():
    from megatron_cg_plugin.planner.graph_memory import fp8_attention_saves, plan_slot_memory
    from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy

    fp8 = tiny(heads=2, query_groups=2, head_dim=128, fp8_recipe="delayed")
    tokens, width = 512, 256
    # bf16 q, k, v and output (4 storages) go; one FP8 qkv, one FP8 output, two scale inverses and the S scale come.
    saved = 4 * tokens * width * 2 - (tokens * 3 * width + tokens * width + 3 * 256)
    with_attention = plan_slot_memory([dataclasses.replace(fp8, fp8_attention=True)], ()).arena_bytes
    assert plan_slot_memory([fp8], ()).arena_bytes - with_attention == saved
    assert sum(fp8_attention_saves(fp8).values()) == tokens * 4 * width + 3 * 4
    # GQA: the FP8 storage holds q and the narrower k and v.
    assert fp8_attention_saves(tiny(query_groups=2, fp8_recipe="delayed"))["attn.qkv.fp8"] == tokens * (256 + 2 * 128)
    # Offloading core_attn moves the FP8 storages and their scale inverses (aligned), softmax statistics and RNG state.
    core = OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=1)
    host = first_layer_host_bytes(dataclasses.replace(fp8, fp8_attention=True), ["attn"], core)
    assert host == tokens * 3 * width + tokens * width + 2 * 256 + 2 * 2 * 256 * 4 + 256
    with pytest.raises(ValueError, match="fp8-recipe delayed"):
        tiny(fp8_recipe="tensorwise", fp8_attention=True)


def test_fp8_attention_from_the_flags_or_from_the_model_config_a_script_set_it_on():
    from megatron_cg_plugin.planner.prediction import model_config_adds, repredict_graph_memory

    facts = RunSettings(cuda_graph_impl="transformer_engine", num_layers=2, modules=(), slot_capture=True, fp8=True)
    args = megatron_args(num_layers=2, fp8="hybrid", fp8_recipe="delayed", first_last_layers_bf16=False)
    bf16_attention = plan_of(args, facts, config=DEFAULTS, deterministic=True).arena_bytes
    flagged = plan_of(
        megatron_args(**{**vars(args), "fp8_dot_product_attention": True}), facts, config=DEFAULTS, deterministic=True
    ).arena_bytes
    assert flagged < bf16_attention
    settings = run_settings(args, facts)
    config = types.SimpleNamespace(fp8_dot_product_attention=True)
    assert repredict_graph_memory(settings, DEFAULTS, config).arena_bytes == flagged
    assert not settings.fp8_dot_product_attention  # the flags' settings are left as they were
    # Nothing beyond the flags (the field at its default, or as the flags said it): nothing to redo.
    assert model_config_adds(settings, config)
    assert not model_config_adds(settings, types.SimpleNamespace(fp8_dot_product_attention=False))
    assert not model_config_adds(
        run_settings(megatron_args(**{**vars(args), "fp8_dot_product_attention": True}), facts), config
    )
    assert not model_config_adds(settings, object())
    # Under current scaling the planner does not model FP8 attention (--cg-slot-capture refuses it).
    tensorwise = megatron_args(**{**vars(args), "fp8_recipe": "tensorwise", "fp8_dot_product_attention": True})
    assert (
        plan_of(tensorwise, facts, config=DEFAULTS, deterministic=True).arena_bytes
        == plan_of(
            megatron_args(**{**vars(args), "fp8_recipe": "tensorwise"}), facts, config=DEFAULTS, deterministic=True
        ).arena_bytes
    )


def test_an_installed_run_redoes_its_prediction_from_the_model_config_before_capture(monkeypatch):
    from megatron_cg_plugin import rules
    from megatron_cg_plugin.session import RunSession

    facts = RunSettings(cuda_graph_impl="transformer_engine", num_layers=2, modules=(), slot_capture=True, fp8=True)
    args = megatron_args(num_layers=2, fp8="hybrid", fp8_recipe="delayed", first_last_layers_bf16=False)
    monkeypatch.setattr(rules, "check_run", lambda *a, **k: (run_settings(args, facts), None))  # the rules passed
    session = RunSession()
    session.check_flags(args, environ={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"})
    flags_plan = session.prediction.graph_memory
    session.model_config_seen(types.SimpleNamespace(fp8_dot_product_attention=False))
    assert session.prediction.graph_memory is flags_plan  # nothing beyond the flags
    session.model_config_seen(types.SimpleNamespace(fp8_dot_product_attention=True))
    assert session.prediction.graph_memory.arena_bytes < flags_plan.arena_bytes


# The realistic MoE (allocator traces and farm cases): 8 layers x 2048, GQA 16/4, 16 experts top-2, expert ffn
# 1408, SwiGLU, no biases, RoPE, seq 2048, micro-batch 1, alltoall; TE's pool measured 1468 MiB drop-and-pad
# (attn moe) and 720 MiB dropless (attn moe_router moe_preprocess); slot capture's arenas 947 MiB (attn moe).
REALISTIC = LayerShape(
    seq=2048,
    micro_batch=1,
    hidden=2048,
    ffn=8192,
    heads=16,
    query_groups=4,
    head_dim=128,
    gated=True,
    bias=False,
    rope=True,
)


def realistic_moe(rows: int) -> LayerShape:
    return dataclasses.replace(REALISTIC, moe=MoeShape(experts=16, topk=2, ffn=1408, rows=rows, router_experts=16))


@pytest.mark.parametrize(
    "modules, rows, measured",
    [(["attn", "moe"], 16 * 256, 1539309568), (["attn", "moe_router", "moe_preprocess"], 2048 * 2, 754974720)],
)
def test_the_realistic_moe_pool_is_predicted_within_two_percent(modules, rows, measured):
    """Every expert's weight gradients (one grouped GEMM writes them), the second expert GEMM's output kept for
    backward and the preprocess graph's permuted tokens: without them 0.76x and 0.82x."""
    predicted = plan_graph_memory([realistic_moe(rows)] * 8, modules).pool_bytes
    assert abs(predicted / measured - 1) <= 0.02, predicted / measured


def test_the_realistic_moe_slot_arenas_hold_the_second_expert_gemms_output():
    from megatron_cg_plugin.planner.graph_memory import plan_slot_memory

    plan = plan_slot_memory([realistic_moe(16 * 256)] * 8, ("attn", "moe"))
    # measured 992808960; 320 KiB more predicted (small routing saves), 0.03%; 0.86x without the kept output
    assert abs(plan.arena_bytes / 992808960 - 1) <= 0.001


@pytest.mark.parametrize(
    "name,measured_mib",
    [
        ("gpt_4x2048_docmask_layer_megatron_lm", 17564),
        ("gpt_4x2048_docmask_attn_megatron_lm", 16792),
        ("gpt_4x2048_sft_layer_megatron_lm", 33948),
        ("gpt_4x2048_sft_attn_megatron_lm", 33176),
    ],
)
def test_the_packed_cases_pools_are_predicted_from_their_flags_within_2_percent(tmp_path, name, measured_mib):
    """Deterministic packed graphs' pools (the four packed farm cases on the GPU) are mostly cuDNN's THD
    backward workspace, next_pow2(--cg-thd-max-seqs) x heads x tokens^2 bf16 (16 / 32 GiB). The planner
    predicted 1682 and 888 MiB (the unpacked s x s term) and named nothing it left out."""
    from megatron_cg_plugin.farm import runner
    from megatron_cg_plugin.launch import dry_run
    from megatron_cg_plugin.planner.prediction import predict_graph_memory

    case, _ = runner.prepare_case(runner.case_folder(name), out_dir=tmp_path)
    env = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", **dict(case.env)}
    args, facts, config = dry_run.validated_args(
        case.checked_flags(graphed=True, out_dir=tmp_path), nproc=1, env=env, launcher=False
    )  # Megatron-LM's pretrain_gpt.py, as the farm runs it
    plan = predict_graph_memory(facts, config)
    assert facts.packed_graphs and not plan.unpredicted
    assert abs(plan.pool_bytes / (measured_mib * MiB) - 1) <= 0.02, plan.pool_bytes / MiB


def test_a_packed_layers_deterministic_workspace_rounds_its_sequences_up_to_a_power_of_two():
    packed = dataclasses.replace(big(), thd_sequences=21)
    assert (
        attention_workspace(packed) - attention_workspace(dataclasses.replace(packed, deterministic=False))
        == 32 * packed.heads * packed.tokens**2 * 2
    )
    assert attention_workspace(dataclasses.replace(packed, thd_sequences=32)) == attention_workspace(packed)
    assert attention_workspace(dataclasses.replace(packed, thd_sequences=33)) > attention_workspace(packed)
    with pytest.raises(ValueError, match="thd_sequences"):
        dataclasses.replace(packed, thd_sequences=0)
