"""Tests for megatron_cg_plugin.rules: every rule fires on its own, reports its fix, and the facts
read from a real Megatron namespace are the ones the rules need."""

import dataclasses
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.rules import HOST_RULES, RULES, RuleViolation, validate, violations
from megatron_cg_plugin.settings import RunSettings, read_settings

TE = "transformer_engine"
# A valid run with TE graphs on: the starting point every violating example changes.
BASELINE = RunSettings(cuda_graph_impl=TE)
MOE_DROP_PAD = dict(num_experts=4, capacity_factor=1.5, pad_to_capacity=True)
# Hybrid CP with what Megatron's hybrid-CP loader needs.
HYBRID = dict(hybrid_context_parallel=True, inter_document_masking=True, max_seqlen_per_dp_cp_rank=256)

# rule name -> (facts that break exactly that rule, a flag/env the message must tell the user to change)
VIOLATING: dict[str, tuple[RunSettings, str]] = {
    "model-sizes": (RunSettings(cuda_graph_impl=TE, num_layers=-2), "--num-layers -2 (1 to 10000)"),
    "moe-topk-over-experts": (RunSettings(num_experts=4, moe_topk=5), "--moe-router-topk 5, --num-experts 4"),
    "tokenizer-files": (RunSettings(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
    "tokenizer-build": (
        RunSettings(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/t", tokenizer_problem="cannot parse"),
        "cannot parse (--tokenizer-type SentencePieceTokenizer, --tokenizer-model /t)",
    ),
    "heads-divide-hidden": (
        RunSettings(hidden_size=250, num_attention_heads=4),
        "(--hidden-size 250, --num-attention-heads 4)",
    ),
    "global-batch-size": (
        RunSettings(micro_batch_size=2, global_batch_size=8, world_size=3),
        "(--global-batch-size 8, --micro-batch-size 2, data-parallel size 3",
    ),
    "loop-intervals": (RunSettings(log_interval=0), "--log-interval 0"),
    "query-groups-divide-heads": (
        RunSettings(group_query_attention=True, num_attention_heads=4, num_query_groups=3),
        "(--num-attention-heads 4, --num-query-groups 3)",
    ),
    "tensor-parallel-split": (
        RunSettings(ffn_hidden_size=1022, tensor_parallel=4, world_size=4),
        "--ffn-hidden-size 1022 over --tensor-model-parallel-size 4",
    ),
    "sequence-parallel-seq-length": (
        RunSettings(sequence_parallel=True, tensor_parallel=2, world_size=2, seq_length=255),
        "--seq-length 255 / --context-parallel-size 1 = 255 positions per rank",
    ),
    "expert-parallel-sizes": (
        RunSettings(num_experts=4, moe_topk=2, expert_parallel=2, world_size=1),
        "(world size 1, ETP x EP x PP = 2)",
    ),
    "optimizer-setup": (RunSettings(optimizer_problem="assert self.lr_decay_steps > 0"), "--train-iters N"),
    "random-seed": (RunSettings(seed=0), 'Megatron: "Seed (0) should be a positive integer."'),
    "sample-counts": (
        RunSettings(train_iters=1 << 40, global_batch_size=8, eval_iters=0),
        f"--train-iters x --global-batch-size (or --train-samples) = {8 << 40}",
    ),
    "data-source": (RunSettings(launcher=True, data_sources=()), "add --mock-data, or --data-path PREFIX"),
    "data-blend-split": (RunSettings(dataset_problem="--split 0,0,0 gives every split a weight of 0"), "--split 0,0,0"),
    "cuda-graph-modules-twice": (RunSettings(modules=("attn", "attn")), "--cuda-graph-modules attn attn"),
    "environment-switches": (RunSettings(unreadable_switches=("NCCL_GRAPH_REGISTER=yes",)), "NCCL_GRAPH_REGISTER=yes"),
    "environment-values": (RunSettings(unusable_environment=("WORLD_SIZE='abc' (give ...)",)), "WORLD_SIZE='abc'"),
    "run-folders": (RunSettings(save="", save_interval=100), "--save is empty"),
    "inject-capture-failure-layer": (
        RunSettings(cuda_graph_impl=TE, inject_capture_failure=3),
        "--cg-inject-capture-failure 3; a first-stage rank graphs 2 layer(s)",
    ),
    "hybrid-cp-ranks": (RunSettings(**HYBRID), "--nproc-per-node 2"),
    "tensorboard-needs-dir": (RunSettings(log_to_tensorboard=True), "--tensorboard-dir"),
    "rerun-mode-report-stats": (RunSettings(rerun_mode="report_stats"), "--rerun-mode validate_results"),
    "fp8-delayed-resume-pickle": (
        RunSettings(fp8=True, fp8_recipe="delayed", resumes_checkpoint=True, load="/ckpt"),
        "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1",
    ),
    "cg-flags-need-te-graphs": (
        RunSettings(graph_only_flags=("--cg-slot-capture",)),
        "--cuda-graph-impl transformer_engine",
    ),
    "te-installed": (RunSettings(cuda_graph_impl=TE, te_available=False), "--cuda-graph-impl none"),
    "te-layers": (RunSettings(cuda_graph_impl=TE, transformer_impl="local"), "--transformer-impl transformer_engine"),
    "moe-xor-router": (
        RunSettings(cuda_graph_impl=TE, modules=("moe", "moe_router"), **MOE_DROP_PAD),
        "--cuda-graph-modules",
    ),
    "preprocess-needs-router": (
        RunSettings(cuda_graph_impl=TE, modules=("attn", "moe_preprocess"), num_experts=4),
        "moe_router",
    ),
    "moe-scope-needs-moe": (RunSettings(cuda_graph_impl=TE, modules=("attn", "moe_router")), "--num-experts"),
    "mlp-scope-needs-dense": (
        RunSettings(cuda_graph_impl=TE, modules=("mlp",), num_experts=4, num_layers=4),
        "--moe-layer-freq",
    ),
    "moe-scope-needs-drop-and-pad": (
        RunSettings(cuda_graph_impl=TE, modules=("attn", "moe"), num_experts=4, capacity_factor=1.5),
        "--moe-pad-expert-input-to-capacity",
    ),
    "preprocess-no-host-sync": (
        RunSettings(
            cuda_graph_impl=TE,
            modules=("moe_router", "moe_preprocess"),
            num_experts=4,
            dispatcher="alltoall",
            capacity_factor=1.5,
        ),
        "--moe-pad-expert-input-to-capacity",
    ),
    "whole-layer-moe-needs-drop-and-pad": (
        RunSettings(cuda_graph_impl=TE, num_experts=4, dispatcher="alltoall"),
        "--moe-expert-capacity-factor",
    ),
    "full-recompute": (
        RunSettings(cuda_graph_impl=TE, recompute_granularity="full"),
        "--recompute-granularity selective",
    ),
    "moe-recompute-vs-router": (
        RunSettings(
            cuda_graph_impl=TE,
            modules=("attn", "moe_router"),
            num_experts=4,
            recompute_granularity="selective",
            recompute_modules=("moe",),
        ),
        "--recompute-modules moe",
    ),
    "cpu-offloading": (RunSettings(cuda_graph_impl=TE, cpu_offloading=True), "--cpu-offloading"),
    "hybrid-cp": (RunSettings(cuda_graph_impl=TE, **HYBRID, world_size=2), "--hybrid-context-parallel"),
    "gradient-accumulation-fusion": (
        RunSettings(cuda_graph_impl=TE, gradient_accumulation_fusion=True),
        "--no-gradient-accumulation-fusion",
    ),
    "expandable-segments": (RunSettings(cuda_graph_impl=TE, expandable_segments=True), "NCCL_GRAPH_REGISTER=0"),
    "warmup-steps": (RunSettings(cuda_graph_impl=TE, warmup_steps=-1), "--cuda-graph-warmup-steps"),
    "hybrid-cp-pipeline": (
        RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, world_size=4, pipeline_parallel=2),
        "--pipeline-model-parallel-size 1",
    ),
    "hybrid-cp-power-of-two": (
        RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, world_size=6),
        "power of two",
    ),
    "hybrid-cp-delayed-wgrad": (
        RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, delay_wgrad_compute=True, world_size=2),
        "--delay-wgrad-compute",
    ),
    "hybrid-cp-ep-overlap": (
        RunSettings(
            cuda_graph_impl=TE, **HYBRID, graph_banks=True, overlap_moe_expert_parallel_comm=True, world_size=2
        ),
        "--overlap-moe-expert-parallel-comm",
    ),
    "hybrid-cp-mamba-scope": (
        RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, world_size=2, modules=("attn", "mamba")),
        "drop mamba",
    ),
    "banks-need-hybrid-cp": (RunSettings(cuda_graph_impl=TE, graph_banks=True), "add --hybrid-context-parallel"),
    "banks-rope-type": (
        RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, position_embedding_type="yarn", world_size=2),
        "--position-embedding-type rope",
    ),
    "banks-rope-fusion": (
        RunSettings(
            cuda_graph_impl=TE,
            **HYBRID,
            graph_banks=True,
            position_embedding_type="rope",
            apply_rope_fusion=False,
            world_size=2,
        ),
        "--no-rope-fusion",
    ),
    "hybrid-cp-rope-static-cp": (
        RunSettings(**HYBRID, position_embedding_type="rope", context_parallel=2, world_size=2),
        "--context-parallel-size 1",
    ),
    "banks-scope": (
        RunSettings(
            cuda_graph_impl=TE, **HYBRID, graph_banks=True, modules=("attn", "moe_router"), **MOE_DROP_PAD, world_size=2
        ),
        "--cuda-graph-modules attn moe",
    ),
    "offload-in-graph-warmup": (
        RunSettings(
            cuda_graph_impl=TE,
            modules=("attn",),
            activation_offloading=True,
            position_embedding_type="rope",
            offload_modules=("core_attn",),
            warmup_steps=0,
        ),
        "--cuda-graph-warmup-steps 1",
    ),
    "whole-layer-offload-unjoined": (
        RunSettings(
            cuda_graph_impl=TE,
            activation_offloading=True,
            position_embedding_type="rope",
            offload_modules=("core_attn",),
        ),
        "--cuda-graph-modules attn mlp",
    ),
    "offload-moe-scope": (
        RunSettings(
            cuda_graph_impl=TE,
            modules=("attn", "moe"),
            **MOE_DROP_PAD,
            activation_offloading=True,
            offload_modules=("core_attn",),
            position_embedding_type="rope",
        ),
        "drop --fine-grained-activation-offloading",
    ),
    "offload-recompute-in-graphs": (
        RunSettings(
            cuda_graph_impl=TE,
            modules=("attn",),
            activation_offloading=True,
            offload_modules=("core_attn",),
            recompute_granularity="selective",
            recompute_modules=("layernorm",),
            position_embedding_type="rope",
        ),
        "(--offload-modules core_attn inside the graphs, --recompute-modules layernorm)",
    ),
    "offload-learned-positions": (
        RunSettings(
            activation_offloading=True, offload_modules=("core_attn",), position_embedding_type="learned_absolute"
        ),
        "--position-embedding-type rope",
    ),
    "slot-capture-pipeline": (
        RunSettings(cuda_graph_impl=TE, slot_capture=True, pipeline_parallel=2, world_size=2),
        "--pipeline-model-parallel-size 1",
    ),
    "slot-capture-fp8": (
        RunSettings(cuda_graph_impl=TE, slot_capture=True, fp8=True, fp8_recipe="mxfp8"),
        "--fp8-recipe delayed or tensorwise",
    ),
    "slot-capture-fp8-op-fuser": (
        RunSettings(cuda_graph_impl=TE, slot_capture=True, fp8=True, te_op_fuser=True),
        "drop --use-transformer-engine-op-fuser",
    ),
    "slot-capture-scope": (
        RunSettings(cuda_graph_impl=TE, slot_capture=True, modules=("attn", "moe_router"), **MOE_DROP_PAD),
        "--cuda-graph-modules attn moe",
    ),
    "slot-capture-delayed-wgrad": (
        RunSettings(cuda_graph_impl=TE, slot_capture=True, delay_wgrad_compute=True),
        "--delay-wgrad-compute",
    ),
    "banks-param-gather-overlap": (
        RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, overlap_param_gather=True, world_size=2),
        "--overlap-param-gather",
    ),
    "moe-layer-freq": (
        RunSettings(
            cuda_graph_impl=TE,
            modules=("attn",),
            num_experts=4,
            num_layers=4,
            moe_layer_freq=(1, 1),
            capacity_factor=1.5,
            pad_to_capacity=True,
        ),
        "--moe-layer-freq",
    ),
    "parallel-sizes": (
        RunSettings(cuda_graph_impl=TE, world_size=6, tensor_parallel=4),
        "--tensor-model-parallel-size",
    ),
    "hybrid-cp-rerun-mode": (
        RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, rerun_mode="validate_results", world_size=2),
        "--rerun-mode disabled",
    ),
    "hybrid-cp-document-masking": (
        RunSettings(cuda_graph_impl=TE, **dict(HYBRID, inter_document_masking=False), graph_banks=True, world_size=2),
        "--dataloader-inter-document-masking",
    ),
    "packed-sequences-te-graphs": (
        RunSettings(cuda_graph_impl=TE, inter_document_masking=True),
        "add --cg-thd-max-seqs N",
    ),
    "thd-max-seqs-without-packed-data": (RunSettings(cuda_graph_impl=TE, thd_max_seqs=8), "drop --cg-thd-max-seqs"),
    "thd-max-seqlen-without-packed-graphs": (
        RunSettings(cuda_graph_impl=TE, thd_max_seqlen=1024),
        "add --cg-thd-max-seqs N",
    ),
    "thd-max-seqlen-bound": (
        RunSettings(
            cuda_graph_impl=TE, inter_document_masking=True, thd_max_seqs=8, seq_length=256, thd_max_seqlen=512
        ),
        "(--cg-thd-max-seqlen 512, --seq-length 256)",
    ),
    "packed-graphs-deterministic-attention": (
        RunSettings(
            cuda_graph_impl=TE,
            inter_document_masking=True,
            thd_max_seqs=32,
            seq_length=4096,
            num_attention_heads=16,
            deterministic=True,
        ),
        "set --cg-thd-max-seqlen to the longest document",
    ),
    "packed-graphs-capacity": (
        RunSettings(cuda_graph_impl=TE, sft=True, thd_max_seqs=2, micro_batch_size=4, global_batch_size=4),
        "raise --cg-thd-max-seqs",
    ),
    "packed-graphs-moe": (
        RunSettings(
            cuda_graph_impl=TE,
            inter_document_masking=True,
            thd_max_seqs=8,
            num_experts=4,
            capacity_factor=1.0,
            pad_to_capacity=True,
        ),
        "dense layers",
    ),
    "packed-graphs-slot-capture": (
        RunSettings(cuda_graph_impl=TE, inter_document_masking=True, thd_max_seqs=8, slot_capture=True),
        "drop --cg-slot-capture",
    ),
    "packed-graphs-offload": (
        RunSettings(
            cuda_graph_impl=TE,
            inter_document_masking=True,
            thd_max_seqs=8,
            modules=("attn",),
            activation_offloading=True,
            offload_modules=("core_attn",),
            position_embedding_type="rope",
            warmup_steps=3,
        ),
        "outside --cuda-graph-modules",
    ),
    "packed-graphs-rope": (
        RunSettings(
            cuda_graph_impl=TE,
            inter_document_masking=True,
            thd_max_seqs=8,
            position_embedding_type="rope",
            apply_rope_fusion=False,
        ),
        "drop --no-rope-fusion",
    ),
    "packed-launcher-sft": (RunSettings(launcher=True, sft=True), "megatron-cg run PATH/pretrain_gpt.py"),
    "packed-launcher-pipeline": (
        RunSettings(launcher=True, inter_document_masking=True, pipeline_parallel=2, world_size=2),
        "--pipeline-model-parallel-size 1",
    ),
    "hybrid-cp-seqlen-per-rank": (
        RunSettings(cuda_graph_impl=TE, **dict(HYBRID, max_seqlen_per_dp_cp_rank=None), graph_banks=True, world_size=2),
        "--max-seqlen-per-dp-cp-rank",
    ),
    "hybrid-cp-launcher-tp": (
        RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, launcher=True, world_size=4, tensor_parallel=2),
        "--tensor-model-parallel-size 1",
    ),
    "banks-fp8": (RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, fp8=True, world_size=2), "--fp8-format"),
    "fp8-recipe-device": (
        RunSettings(cuda_graph_impl=TE, fp8=True, fp8_recipe="mxfp8", device_capability=(9, 0), cuda_version=(13, 0)),
        "(--fp8-recipe mxfp8, compute capability 9.0, CUDA 13.0)",
    ),
    "fp4-device": (RunSettings(cuda_graph_impl=TE, fp4=True, device_capability=(9, 0)), "(compute capability 9.0)"),
    "cg-flags": (
        RunSettings(cuda_graph_impl=TE, config_problems=("--cg-thd-max-seqs 0 must be >= 1.",)),
        "--cg-thd-max-seqs 0 must be >= 1.",
    ),
    "data-files": (
        RunSettings(cuda_graph_impl=TE, missing_files=("/data/a.bin", "/data/a.idx")),
        "/data/a.bin, /data/a.idx",
    ),
    "moe-capacity-over-tokens": (
        RunSettings(
            cuda_graph_impl=TE,
            modules=("attn", "moe"),
            num_experts=4,
            capacity_factor=3.0,
            pad_to_capacity=True,
            dispatcher="alltoall",
            moe_topk=2,
        ),
        "num-experts / topk",
    ),
    "moe-tp-needs-sequence-parallel": (
        RunSettings(cuda_graph_impl=TE, modules=("attn", "moe_router"), num_experts=4, tensor_parallel=2, world_size=2),
        "--sequence-parallel",
    ),
}
# Rules that hold whatever --cuda-graph-impl is (everything else only matters with TE graphs on).
ALWAYS_ON = {
    "gradient-accumulation-fusion",
    "parallel-sizes",
    "moe-layer-freq",
    "hybrid-cp-rope-static-cp",
    "hybrid-cp-rerun-mode",
    "hybrid-cp-document-masking",
    "hybrid-cp-seqlen-per-rank",
    "hybrid-cp-launcher-tp",
    "cg-flags",
    "tensorboard-needs-dir",
    "rerun-mode-report-stats",
    "fp8-delayed-resume-pickle",
    "data-files",
    "moe-capacity-over-tokens",
    "moe-tp-needs-sequence-parallel",
    "model-sizes",
    "moe-topk-over-experts",
    "tokenizer-files",
    "tokenizer-build",
    "heads-divide-hidden",
    "global-batch-size",
    "loop-intervals",
    "query-groups-divide-heads",
    "tensor-parallel-split",
    "sequence-parallel-seq-length",
    "expert-parallel-sizes",
    "optimizer-setup",
    "random-seed",
    "sample-counts",
    "data-source",
    "data-blend-split",
    "cuda-graph-modules-twice",
    "environment-switches",
    "environment-values",
    "run-folders",
    "cg-flags-need-te-graphs",
    "hybrid-cp-ranks",
    "offload-learned-positions",
    "packed-launcher-sft",
    "packed-launcher-pipeline",
    "thd-max-seqlen-without-packed-graphs",
    "thd-max-seqlen-bound",
    "packed-graphs-deterministic-attention",
}


def names(facts: RunSettings) -> list[str]:
    return [name for name, _ in violations(facts)]


def test_rule_names_are_unique():
    assert len({r.name for r in RULES}) == len(RULES)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_every_rule_has_a_violating_example(rule):
    assert rule.name in VIOLATING, f"add a RunSettings that breaks {rule.name!r} to VIOLATING"
    assert rule.source in ("megatron", "plugin")


def test_slot_fp8_is_refused_where_layers_hold_te_norm_modules():
    """An MoE layer's pre-MLP norm (and q/k or MLA norms) is a TE norm module built from te.ops, which the
    slot backend refuses under FP8 at capture (seen on the GPU); the rule says so before any GPU work."""
    facts = RunSettings(cuda_graph_impl=TE, slot_capture=True, fp8=True, te_op_norms=True)
    assert [name for name, _ in violations(facts)] == ["slot-capture-fp8-op-fuser"]
    assert "(TE norm modules in the layers)" in violations(facts)[0][1]
    assert not violations(dataclasses.replace(facts, fp8=False))


def test_no_stale_examples():
    assert set(VIOLATING) <= {r.name for r in RULES}


def test_baseline_passes():
    assert BASELINE.te_graphs
    assert violations(BASELINE) == []
    validate(BASELINE)  # does not raise


@pytest.mark.parametrize(
    "valid",
    [
        RunSettings(
            cuda_graph_impl=TE, modules=("attn", "moe_router", "moe_preprocess"), num_experts=8, dispatcher="alltoall"
        ),
        RunSettings(cuda_graph_impl=TE, modules=("attn", "moe"), **MOE_DROP_PAD),
        RunSettings(cuda_graph_impl=TE, **MOE_DROP_PAD),  # whole layer with drop-and-pad
        RunSettings(cuda_graph_impl=TE, modules=("mlp", "moe_router"), num_experts=4, num_layers=4, moe_layer_freq=2),
        RunSettings(cuda_graph_impl=TE, modules=("attn", "mlp")),
        RunSettings(cuda_graph_impl=TE, gradient_accumulation_fusion=True, apex_fused_wgrad=True),
        RunSettings(cuda_graph_impl=TE, expandable_segments=True, nccl_graph_register_off=True),
        RunSettings(cuda_graph_impl=TE, recompute_granularity="selective", recompute_modules=("core_attn",)),
        RunSettings(cuda_graph_impl=TE, world_size=8, tensor_parallel=2, pipeline_parallel=2, context_parallel=2),
        RunSettings(cuda_graph_impl=TE, warmup_steps=0),
        # FP8 recipes the GPU has: blockwise on sm_90 with CUDA 12.9+, MXFP8 on sm_100, any recipe where the GPU
        # is unknown.
        RunSettings(
            cuda_graph_impl=TE, fp8=True, fp8_recipe="blockwise", device_capability=(9, 0), cuda_version=(12, 9)
        ),
        RunSettings(cuda_graph_impl=TE, fp8=True, fp8_recipe="mxfp8", device_capability=(10, 0), cuda_version=(13, 0)),
        RunSettings(cuda_graph_impl=TE, fp8=True, fp8_recipe="tensorwise", device_capability=(9, 0)),
        RunSettings(cuda_graph_impl=TE, fp8=True, fp8_recipe="mxfp8"),
        RunSettings(cuda_graph_impl=TE, fp4=True, device_capability=(10, 0)),
        # Graph banks: RoPE (fused), the attn / mlp / moe scopes, offloading outside the graphed scope.
        RunSettings(
            cuda_graph_impl=TE,
            **HYBRID,
            graph_banks=True,
            world_size=2,
            position_embedding_type="rope",
            modules=("attn",),
        ),
        RunSettings(
            cuda_graph_impl=TE,
            **HYBRID,
            graph_banks=True,
            world_size=2,
            modules=("mlp",),
            activation_offloading=True,
            position_embedding_type="rope",
            offload_modules=("core_attn", "attn_proj"),
        ),
        RunSettings(
            cuda_graph_impl=TE,
            **HYBRID,
            graph_banks=True,
            world_size=2,
            modules=("attn",),
            activation_offloading=True,
            position_embedding_type="rope",
            offload_modules=("expert_fc1", "moe_act"),
            **MOE_DROP_PAD,
        ),
        # Offload inside the graphed scope: banks and --cg-slot-capture protect it.
        RunSettings(
            cuda_graph_impl=TE,
            **HYBRID,
            graph_banks=True,
            world_size=2,
            modules=("attn",),
            activation_offloading=True,
            position_embedding_type="rope",
            offload_modules=("core_attn", "attn_proj"),
        ),
        RunSettings(
            cuda_graph_impl=TE,
            slot_capture=True,
            activation_offloading=True,
            position_embedding_type="rope",
            offload_modules=("attn_norm", "core_attn", "mlp_norm"),
        ),
        # Megatron joins its offload stream into graphs that name attn / mlp: the same whole dense layer.
        RunSettings(
            cuda_graph_impl=TE,
            modules=("attn", "mlp"),
            activation_offloading=True,
            position_embedding_type="rope",
            offload_modules=("qkv_linear", "core_attn", "attn_proj", "mlp_norm"),
        ),
        # The MoE block graphed (whole layer: Megatron refuses offload with the moe scope, rule offload-moe-scope).
        RunSettings(
            cuda_graph_impl=TE,
            slot_capture=True,
            activation_offloading=True,
            position_embedding_type="rope",
            offload_modules=("core_attn", "expert_fc1"),
            **MOE_DROP_PAD,
        ),
    ],
    ids=lambda f: f"{'+'.join(f.modules) or 'layer'}",
)
def test_valid_combinations_pass(valid):
    assert violations(valid) == []


@pytest.mark.parametrize("name", sorted(VIOLATING))
def test_each_rule_fires_alone_with_its_fix(name):
    facts, flag = VIOLATING[name]
    with pytest.raises(RuleViolation) as info:
        validate(facts)
    fired = [n for n, _ in info.value.violations]
    assert fired == [name], fired
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert f"[{name}]" in message
    assert flag in message


@pytest.mark.parametrize("name", sorted(VIOLATING))
def test_graph_only_rules_are_silent_without_graphs(name):
    facts, _ = VIOLATING[name]
    eager = dataclasses.replace(facts, cuda_graph_impl="none")
    if name in ALWAYS_ON:
        assert names(eager) == [name]
    else:
        assert names(eager) == []


def test_all_broken_rules_reported_at_once():
    facts = RunSettings(
        cuda_graph_impl=TE,
        modules=("moe", "moe_router"),
        num_experts=4,
        recompute_granularity="full",
        cpu_offloading=True,
        gradient_accumulation_fusion=True,
        world_size=3,
        tensor_parallel=2,
    )
    with pytest.raises(RuleViolation) as info:
        validate(facts)
    reported = [n for n, _ in info.value.violations]
    assert set(reported) == {
        "moe-xor-router",
        "moe-scope-needs-drop-and-pad",
        "full-recompute",
        "cpu-offloading",
        "gradient-accumulation-fusion",
        "parallel-sizes",
        "moe-tp-needs-sequence-parallel",
    }
    # reported in RULES order, the host's own rules (here APEX's) after the flags' ones, one line each: the first
    # broken rule is the message's first line, and one line pointing to the docs ends it
    order = [r.name for r in RULES]
    flags = [name for name in reported if name != "gradient-accumulation-fusion"]
    assert reported == [*sorted(flags, key=order.index), "gradient-accumulation-fusion"]
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"[{reported[0]}] ")
    assert [line.split("]")[0] for line in lines[1:-1]] == [f"  [{name}" for name in reported[1:]]
    assert lines[-1] == f"  ({len(reported)} rules broken: see docs/troubleshooting.md)"


def test_the_host_rules_are_rules_and_come_after_the_flags_ones():
    """What the host lacks is asked once the flags' own rules passed: each host rule is a rule (a misspelt name
    would silently leave it among the flags' rules)."""
    assert {rule.name for rule in HOST_RULES} == {
        "te-installed",
        "gradient-accumulation-fusion",
        "fp8-recipe-device",
        "fp4-device",
    }
    facts = RunSettings(cuda_graph_impl=TE, te_available=False, recompute_granularity="full")
    assert [name for name, _ in violations(facts)] == ["full-recompute", "te-installed"]
    assert [rule.name for rule in RULES].index("te-installed") < [rule.name for rule in RULES].index("full-recompute")


def test_validate_accepts_a_custom_rule_set():
    facts, _ = VIOLATING["cpu-offloading"]
    only_warmup = tuple(r for r in RULES if r.name == "warmup-steps")
    validate(facts, only_warmup)
    assert violations(VIOLATING["warmup-steps"][0], only_warmup) == [("warmup-steps", only_warmup[0].fix)]


def test_a_rule_with_detail_names_what_the_facts_hold():
    facts, _ = VIOLATING["data-files"]
    ((name, message),) = violations(facts)
    rule = next(r for r in RULES if r.name == name)
    assert message == f"{rule.fix} /data/a.bin, /data/a.idx"
    assert "/data/a.bin" not in rule.fix  # the docs table shows the fix, the run the files


def test_the_launcher_tp_rule_is_the_launchers_own():
    facts, _ = VIOLATING["hybrid-cp-launcher-tp"]
    assert names(dataclasses.replace(facts, launcher=False)) == []  # a user's own data path may broadcast


@pytest.mark.parametrize("num_experts, is_moe", [(None, False), (0, False), (1, False), (2, True), (8, True)])
def test_moe_scope_needs_more_than_one_expert(num_experts, is_moe):
    # mirrors TransformerConfig: "moe cuda graph is only supported for MoE" when num_moe_experts <= 1
    facts = RunSettings(cuda_graph_impl=TE, modules=("attn", "moe_router"), num_experts=num_experts, moe_topk=1)
    assert facts.moe is is_moe
    expected = [] if is_moe else ["moe-scope-needs-moe"]
    assert [name for name in names(facts) if name not in ("model-sizes", "moe-topk-over-experts")] == expected


def test_drop_and_pad_needs_both_flags():
    assert not RunSettings(capacity_factor=1.5).drop_and_pad
    assert not RunSettings(pad_to_capacity=True).drop_and_pad
    assert RunSettings(capacity_factor=1.5, pad_to_capacity=True).drop_and_pad


# -- is_moe_layer -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "freq, expected",
    [
        (1, [True] * 6),
        (2, [True, False, True, False, True, False]),
        (3, [True, False, False, True, False, False]),
        ((0, 1, 1, 0, 1, 0), [False, True, True, False, True, False]),
        ((1, 1, 1, 1, 1, 1), [True] * 6),
    ],
)
def test_is_moe_layer(freq, expected):
    facts = RunSettings(num_layers=6, num_experts=4, moe_layer_freq=freq)
    assert [facts.is_moe_layer(i) for i in range(6)] == expected
    assert facts.all_layers_moe == all(expected)


@pytest.mark.parametrize("freq", [1, 2, (1, 0)])
def test_dense_model_has_no_moe_layers(freq):
    facts = RunSettings(num_layers=2, num_experts=None, moe_layer_freq=freq)
    assert not facts.moe
    assert not any(facts.is_moe_layer(i) for i in range(2))
    assert not facts.all_layers_moe


def test_mlp_scope_allowed_when_some_layer_is_dense():
    all_moe = RunSettings(cuda_graph_impl=TE, modules=("mlp",), num_experts=4, num_layers=2, moe_layer_freq=(1, 1))
    assert names(all_moe) == ["mlp-scope-needs-dense"]
    assert names(dataclasses.replace(all_moe, moe_layer_freq=(1, 0))) == []
    assert names(dataclasses.replace(all_moe, moe_layer_freq=2)) == []


def test_short_moe_layer_freq_list_is_a_rule_violation():
    facts = RunSettings(cuda_graph_impl=TE, modules=("attn", "mlp"), num_experts=4, num_layers=4, moe_layer_freq=(1, 1))
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        validate(facts)


# -- read_settings on Megatron's real parser --------------------------------------------------------


def settings_of(args, **probed):
    return read_settings(args, **probed)[0]


@pytest.fixture
def parse(monkeypatch):
    from megatron_cg_plugin.launch.pretrain_gpt import parse_megatron_args

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    return lambda *argv: parse_megatron_args(list(argv), validate=False)


def test_facts_from_parsed_moe_namespace(parse):
    args = parse("--cg-preset", "tiny-moe", "--cuda-graph-impl", TE, "--cuda-graph-modules", "attn", "moe_router")
    facts = settings_of(args, te_available=True, apex_fused_wgrad=False, env={})
    assert facts.te_graphs
    assert facts.modules == ("attn", "moe_router")
    assert facts.num_experts == 4 and facts.moe
    assert facts.capacity_factor is None and not facts.pad_to_capacity and not facts.drop_and_pad
    assert facts.dispatcher == "alltoall"
    assert facts.num_layers == 2 and facts.micro_batch_size == 2 and facts.global_batch_size == 8
    assert facts.transformer_impl == TE
    assert facts.gradient_accumulation_fusion is False  # the preset passes --no-gradient-accumulation-fusion
    assert facts.world_size == 1
    assert facts.expandable_segments is False and facts.nccl_graph_register_off is False
    validate(facts)


def test_facts_from_parsed_drop_and_pad_namespace(parse):
    args = parse(
        "--cg-preset",
        "tiny-moe",
        "--cuda-graph-impl",
        TE,
        "--cuda-graph-modules",
        "attn",
        "moe",
        "--moe-expert-capacity-factor",
        "1.5",
        "--moe-pad-expert-input-to-capacity",
        "--moe-layer-freq",
        "[1,0]",
        "--cuda-graph-warmup-steps",
        "5",
    )
    facts = settings_of(args, te_available=False, apex_fused_wgrad=False)
    assert facts.modules == ("attn", "moe")
    assert facts.capacity_factor == 1.5 and facts.pad_to_capacity and facts.drop_and_pad
    assert facts.moe_layer_freq == (1, 0)
    assert [facts.is_moe_layer(i) for i in range(2)] == [True, False]
    assert facts.warmup_steps == 5
    assert names(facts) == ["te-installed"]


def test_facts_from_parsed_dense_namespace(parse):
    # no preset: Megatron's own default keeps gradient-accumulation fusion on
    args = parse(
        "--num-layers",
        "2",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "4",
        "--micro-batch-size",
        "1",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
    )
    facts = settings_of(args, te_available=True, apex_fused_wgrad=False, env={})
    assert facts.cuda_graph_impl == "none" and not facts.te_graphs
    assert facts.modules == ()
    assert facts.num_experts is None and not facts.moe
    assert facts.recompute_granularity == "full"
    assert facts.gradient_accumulation_fusion is True
    assert facts.input_norm_fused  # standard attention: the input norm is in TE's QKV linear
    mla = settings_of(
        types.SimpleNamespace(**(vars(args) | {"multi_latent_attention": True})),
        te_available=True,
        apex_fused_wgrad=False,
        env={},
    )
    assert not mla.input_norm_fused
    assert settings_of(
        types.SimpleNamespace(**(vars(args) | {"multi_latent_attention": True, "mla_down_proj_fusion": True})),
        te_available=True,
        apex_fused_wgrad=False,
        env={},
    ).input_norm_fused
    # full recompute is graph-only; the missing APEX kernel is not
    assert names(facts) == ["gradient-accumulation-fusion"]


@pytest.mark.parametrize(
    "env, expandable, register_off, broken",
    [
        ({}, False, False, []),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True, False, ["expandable-segments"]),
        (
            {
                "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True",
                "NCCL_GRAPH_REGISTER": "0",
            },
            True,
            True,
            [],
        ),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False, False, []),
        ({"NCCL_GRAPH_REGISTER": "1"}, False, False, []),
    ],
)
def test_facts_read_the_environment(parse, env, expandable, register_off, broken):
    args = parse("--cg-preset", "tiny-gpt", "--cuda-graph-impl", TE)
    facts = settings_of(args, te_available=True, apex_fused_wgrad=False, env=env)
    assert facts.expandable_segments is expandable
    assert facts.nccl_graph_register_off is register_off
    assert names(facts) == broken


def test_facts_world_size_from_env(parse, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    args = parse("--cg-preset", "tiny-gpt", "--tensor-model-parallel-size", "4")
    facts = settings_of(args, te_available=True, apex_fused_wgrad=False)
    assert facts.world_size == 6 and facts.tensor_parallel == 4
    assert names(facts) == ["parallel-sizes"]


def test_facts_from_minimal_namespace_use_defaults():
    import argparse

    facts = settings_of(
        argparse.Namespace(num_layers=3, micro_batch_size=1, cuda_graph_modules="attn mlp"),
        te_available=True,
        apex_fused_wgrad=True,
    )
    assert facts.cuda_graph_impl == "none"
    assert facts.modules == ("attn", "mlp")
    assert facts.num_layers == 3 and facts.world_size == 1 and facts.recompute_modules == ()


# -- property ---------------------------------------------------------------------------------------

SCOPES = ["attn", "mlp", "moe", "moe_router", "moe_preprocess"]

facts_strategy = st.builds(
    RunSettings,
    cuda_graph_impl=st.sampled_from([TE, "none"]),
    modules=st.lists(st.sampled_from(SCOPES), unique=True, max_size=5).map(tuple),
    num_layers=st.integers(1, 4),
    num_experts=st.sampled_from([None, 1, 2, 8]),
    moe_layer_freq=st.sampled_from([1, 2]),
    capacity_factor=st.sampled_from([None, 1.5]),
    pad_to_capacity=st.booleans(),
    dispatcher=st.sampled_from(["allgather", "alltoall", "flex"]),
    router_padding_for_fp8=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(facts_strategy)
def test_validate_raises_iff_violations(facts):
    broken = violations(facts)
    if broken:
        with pytest.raises(RuleViolation) as info:
            validate(facts)
        assert info.value.violations == broken
    else:
        validate(facts)
    if facts.te_graphs and {"moe", "moe_router"} <= set(facts.modules):
        assert "moe-xor-router" in [n for n, _ in broken]
    if not facts.te_graphs:  # of the always-on rules, only the MoE size ones are in this strategy's reach
        assert {name for name, _ in broken} <= {"moe-capacity-over-tokens", "moe-topk-over-experts"}, broken


@pytest.mark.parametrize(
    "modules, refused",
    [
        ((), False),
        (("attn", "moe"), False),
        (("moe",), False),
        (("attn",), False),  # MoE block whole or eager
        (("attn", "moe_router"), True),
        (("attn", "moe_router", "moe_preprocess"), True),
        (("moe_router",), True),
    ],
)
def test_banks_graph_the_moe_block_whole_or_not_at_all(modules, refused):
    facts = RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, world_size=2, modules=modules, **MOE_DROP_PAD)
    assert ("banks-scope" in names(facts)) == refused
    assert "banks-scope" not in names(dataclasses.replace(facts, num_experts=None, modules=("attn",)))


@pytest.mark.parametrize(
    "offloaded, moe, fires",
    [
        (("core_attn",), False, True),  # seen failing on an H200
        (("attn_norm", "mlp_norm"), False, False),  # a dense TE layer's norms are fused: nothing is offloaded
        (("mlp_norm",), True, True),  # an MoE layer's pre-MLP norm is a module of its own
        (("expert_fc1", "moe_act"), True, True),
    ],
)
def test_whole_layer_offload_rule_fires_for_what_megatron_offloads_inside_the_graph(offloaded, moe, fires):
    facts = RunSettings(
        cuda_graph_impl=TE,
        activation_offloading=True,
        position_embedding_type="rope",
        offload_modules=offloaded,
        **(MOE_DROP_PAD if moe else {}),
    )
    assert ("whole-layer-offload-unjoined" in names(facts)) == fires
    assert "whole-layer-offload-unjoined" not in names(dataclasses.replace(facts, modules=("attn", "mlp")))
    assert "whole-layer-offload-unjoined" not in names(dataclasses.replace(facts, slot_capture=True))

    # Multi-latent attention without the fused down-projection keeps a real input norm: attn_norm offloads it.
    unfused = RunSettings(
        cuda_graph_impl=TE,
        activation_offloading=True,
        position_embedding_type="rope",
        offload_modules=("attn_norm",),
        input_norm_fused=False,
    )
    assert "whole-layer-offload-unjoined" in names(unfused)


@pytest.mark.parametrize(
    "modules, offloaded, inside",
    [
        ((), ("core_attn", "expert_fc1"), {"core_attn", "expert_fc1"}),  # whole layer: everything is inside
        (
            ("attn",),
            ("attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1"),
            {"attn_norm", "core_attn", "attn_proj"},
        ),
        (("mlp",), ("core_attn", "mlp_norm"), {"mlp_norm"}),
        (("moe",), ("qkv_linear", "expert_fc1", "moe_act", "mlp_norm"), {"expert_fc1", "moe_act", "mlp_norm"}),
        (("attn", "moe"), ("qkv_linear", "moe_act"), {"qkv_linear", "moe_act"}),
    ],
)
def test_offloaded_modules_inside_the_graphed_scope(modules, offloaded, inside):
    facts = RunSettings(
        cuda_graph_impl=TE,
        modules=modules,
        activation_offloading=True,
        position_embedding_type="rope",
        offload_modules=offloaded,
    )
    assert facts.offloaded_in_graphs == inside
    assert dataclasses.replace(facts, activation_offloading=False).offloaded_in_graphs == frozenset()


def test_sft_data_carries_document_boundaries_for_hybrid_cp():
    facts = RunSettings(**dict(HYBRID, inter_document_masking=False), sft=True, world_size=2)
    assert names(facts) == []
    assert names(dataclasses.replace(facts, sft=False)) == ["hybrid-cp-document-masking"]


def test_blockwise_fp8_needs_a_cuda_12_9_build_on_sm_90():
    facts = RunSettings(
        cuda_graph_impl=TE, fp8=True, fp8_recipe="blockwise", device_capability=(9, 0), cuda_version=(12, 8)
    )
    assert names(facts) == ["fp8-recipe-device"]
    assert names(dataclasses.replace(facts, cuda_graph_impl="none")) == []  # eager runs are TE's to refuse


@pytest.mark.parametrize(
    "change, detail",
    [
        (dict(fp8_recipe="mxfp8"), "(--fp8-recipe mxfp8)"),
        (dict(fp8_recipe="blockwise"), "(--fp8-recipe blockwise)"),
        (dict(fp8_attention=True), "(FP8 attention with --fp8-recipe tensorwise)"),
        (dict(fp8_recipe="delayed", fp8_attention=True, fp8_multi_head_attention=True), "(fp8_multi_head_attention)"),
        (dict(fp8_recipe="delayed", fp8_multi_head_attention=True), "(fp8_multi_head_attention)"),
        (dict(fp8=False, fp4=True), "(--fp4-format)"),
    ],
)
def test_slot_capture_refuses_the_fp8_it_cannot_serve_naming_it(change, detail):
    facts = dataclasses.replace(
        RunSettings(cuda_graph_impl=TE, slot_capture=True, fp8=True, fp8_recipe="tensorwise"), **change
    )
    (message,) = [message for name, message in violations(facts) if name == "slot-capture-fp8"]
    assert detail in message and "drop --cg-slot-capture" in message


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_slot_capture_takes_delayed_and_current_scaling(recipe):
    facts = RunSettings(cuda_graph_impl=TE, slot_capture=True, fp8=True, fp8_recipe=recipe)
    assert "slot-capture-fp8" not in names(facts)
    # FP8 dot-product attention: under delayed scaling only; FP8 multi-head attention under neither.
    attention = dataclasses.replace(facts, fp8_attention=True)
    assert ("slot-capture-fp8" in names(attention)) == (recipe != "delayed")
    assert "slot-capture-fp8" in names(dataclasses.replace(attention, fp8_multi_head_attention=True))


def test_packed_data_graphs_with_a_capacity():
    """Whole layer and attn died at the first graphed step on packed data; --cg-thd-max-seqs lays the
    batches out for the graphs, and the scopes that leave attention eager at micro-batch size 1 are Megatron's."""
    packed = RunSettings(cuda_graph_impl=TE, inter_document_masking=True, position_embedding_type="rope")
    for modules in ((), ("attn",)):
        assert names(dataclasses.replace(packed, modules=modules)) == ["packed-sequences-te-graphs"]
        assert names(dataclasses.replace(packed, modules=modules, thd_max_seqs=32)) == []
        assert (
            names(dataclasses.replace(packed, modules=modules, thd_max_seqs=32, sft=True, inter_document_masking=False))
            == []
        )
    assert names(dataclasses.replace(packed, modules=("mlp",))) == []  # attention eager with the params
    several = dataclasses.replace(packed, modules=("mlp",), micro_batch_size=2, global_batch_size=2)
    assert names(several) == ["packed-sequences-te-graphs"]  # the flattened stream misses the sampled shape
    assert names(dataclasses.replace(several, thd_max_seqs=2)) == []
    assert names(dataclasses.replace(packed, thd_max_seqs=32, cuda_graph_impl="none")) == []  # eager: laid out too
    hybrid = RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, world_size=2, thd_max_seqs=4)
    assert names(hybrid) == []  # hybrid CP's packs: graph banks


# -- the packed layout's max_seqlen -----------------------------------------------------------------

DETERMINISTIC_PACKED = RunSettings(
    cuda_graph_impl=TE,
    inter_document_masking=True,
    seq_length=4096,
    num_attention_heads=16,
    deterministic=True,
    position_embedding_type="rope",
)


@pytest.mark.parametrize(
    "max_seqs, heads, tp, max_seqlen, fires",
    [
        (32, 16, 1, 1448, False),  # 32 x 16 x 1448^2 = 1073512448: the largest L under 2^30
        (32, 16, 1, 1449, True),  # 1074995712
        (16, 16, 1, 2048, True),  # exactly 2^30: TE disables at >=
        (16, 16, 1, 2047, False),
        (16, 32, 2, 2048, True),  # heads per tensor-parallel rank
        (16, 32, 4, 2048, False),
        (32, 15, 2, 2048, True),  # 8 heads per rank (ceil 7.5): exactly 2^30
        (32, 14, 2, 2048, False),  # 7 per rank
    ],
)
def test_deterministic_packed_attention_is_refused_from_2_to_the_30(max_seqs, heads, tp, max_seqlen, fires):
    facts = dataclasses.replace(
        DETERMINISTIC_PACKED,
        thd_max_seqs=max_seqs,
        num_attention_heads=heads,
        tensor_parallel=tp,
        world_size=tp,
        thd_max_seqlen=max_seqlen,
    )
    assert ("packed-graphs-deterministic-attention" in names(facts)) == fires
    # --seq-length is the bound without the flag
    default = dataclasses.replace(facts, thd_max_seqlen=None, seq_length=max_seqlen)
    assert ("packed-graphs-deterministic-attention" in names(default)) == fires


def test_the_deterministic_attention_rule_names_the_product_and_the_longest_bound_that_fits():
    facts = dataclasses.replace(DETERMINISTIC_PACKED, thd_max_seqs=32)
    (message,) = [m for n, m in violations(facts) if n == "packed-graphs-deterministic-attention"]
    assert (
        "(--cg-thd-max-seqs 32 x 16 heads per rank x 4096^2 = 8589934592 >= 2^30; the largest "
        "--cg-thd-max-seqlen that fits: 1448, and the capacity needs at least 128)" in message
    )
    assert "train without --deterministic-mode" in message and "unfused attention" in message
    assert "drop --cg-thd-max-seqs" in message and "--sft" in message
    # the bound TE allows can be below what the capacity needs (rule packed-graphs-capacity): no L fits then
    (crowded,) = [
        m
        for n, m in violations(
            dataclasses.replace(facts, thd_max_seqs=4, num_attention_heads=64, seq_length=16384, thd_max_seqlen=None)
        )
        if n == "packed-graphs-deterministic-attention"
    ]
    assert "no --cg-thd-max-seqlen fits at this --cg-thd-max-seqs: at most 2047 for TE, at least 4096" in crowded
    assert "raise --cg-thd-max-seqs" in crowded  # 17 documents: at most 993 for TE, at least 964 for the capacity
    roomy = dataclasses.replace(facts, thd_max_seqs=17, num_attention_heads=64, seq_length=16384, thd_max_seqlen=964)
    assert "packed-graphs-deterministic-attention" not in names(roomy) and "packed-graphs-capacity" not in names(roomy)
    assert names(dataclasses.replace(facts, thd_max_seqlen=1448)) == []
    # TE keeps fused attention without deterministic mode, and off Hopper this limitation is not TE's
    assert names(dataclasses.replace(facts, deterministic=False)) == []
    assert names(dataclasses.replace(facts, device_capability=(10, 0))) == []
    assert names(dataclasses.replace(facts, device_capability=(9, 0))) == ["packed-graphs-deterministic-attention"]
    # the plugin lays eager steps out too; unpacked data and hybrid CP's packs are not its layout
    assert names(dataclasses.replace(facts, cuda_graph_impl="none")) == ["packed-graphs-deterministic-attention"]
    assert names(dataclasses.replace(facts, thd_max_seqs=None, modules=("mlp",))) == []


@pytest.mark.parametrize("max_seqlen, refused", [(4096, False), (4097, True), (1, False)])
def test_the_packed_max_seqlen_is_at_most_the_sequence_length(max_seqlen, refused):
    facts = RunSettings(
        cuda_graph_impl=TE, inter_document_masking=True, thd_max_seqs=4096, seq_length=4096, thd_max_seqlen=max_seqlen
    )
    assert names(facts) == (["thd-max-seqlen-bound"] if refused else [])


def test_the_packed_max_seqlen_needs_the_packed_layout():
    assert names(RunSettings(thd_max_seqlen=64)) == ["thd-max-seqlen-without-packed-graphs"]
    hybrid = RunSettings(cuda_graph_impl=TE, **HYBRID, graph_banks=True, world_size=2, thd_max_seqs=4)
    assert names(dataclasses.replace(hybrid, thd_max_seqlen=64)) == ["thd-max-seqlen-without-packed-graphs"]
    assert names(RunSettings(inter_document_masking=True, thd_max_seqs=8, thd_max_seqlen=64)) == []


@pytest.mark.parametrize("mbs, max_seqlen, least", [(2, None, 2), (2, 4096, 2), (1, 1000, 5), (2, 1024, 8)])
def test_packed_graphs_hold_at_least_the_documents_that_cover_every_token(mbs, max_seqlen, least):
    facts = RunSettings(
        cuda_graph_impl=TE,
        sft=True,
        seq_length=4096,
        thd_max_seqlen=max_seqlen,
        micro_batch_size=mbs,
        global_batch_size=mbs,
        thd_max_seqs=least,
    )
    assert facts.packed_min_seqs == least and names(facts) == []
    (message,) = [
        m for n, m in violations(dataclasses.replace(facts, thd_max_seqs=least - 1)) if n == "packed-graphs-capacity"
    ]
    assert f"at least {least})" in message and "raise --cg-thd-max-seqs" in message


def test_facts_read_the_packed_bound_and_deterministic_mode(parse):
    args = parse(
        "--cg-preset",
        "tiny-gpt",
        "--cuda-graph-impl",
        TE,
        "--dataloader-inter-document-masking",
        "--cg-thd-max-seqs",
        "16",
        "--cg-thd-max-seqlen",
        "128",
        "--deterministic-mode",
    )
    facts = settings_of(args, te_available=True, apex_fused_wgrad=False, env={})
    assert (facts.thd_max_seqs, facts.thd_max_seqlen, facts.seq_length, facts.num_attention_heads) == (16, 128, 256, 4)
    assert facts.deterministic and facts.packed_max_seqlen == 128
    plain = parse("--cg-preset", "tiny-gpt")
    assert not settings_of(plain, te_available=True, apex_fused_wgrad=False, env={}).deterministic
    assert settings_of(
        plain, te_available=True, apex_fused_wgrad=False, env={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    ).deterministic  # what TE reads


def _fp8_resume(parse, load: str, recipe: str, env: dict[str, str] | None = None):
    from megatron_cg_plugin.rules import check_run

    args = parse("--cg-preset", "tiny-gpt", "--fp8-format", "hybrid", "--fp8-recipe", recipe, "--load", load)
    return check_run(args, env=env or {}, te_present=True)


def test_resuming_fp8_delayed_scaling_needs_the_trusted_pickle_setting(parse, tmp_path):
    """TE 2.20 refuses the pickled delayed-scaling metadata of a checkpoint unless told the checkpoint is trusted:
    refused where --load holds Megatron's tracker file; a fresh start from an empty --load is not a resume."""
    _fp8_resume(parse, str(tmp_path), "delayed")  # nothing to resume from yet
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12\n")
    with pytest.raises(RuleViolation, match=r"\[fp8-delayed-resume-pickle\].*--load " + str(tmp_path)):
        _fp8_resume(parse, str(tmp_path), "delayed")
    _fp8_resume(parse, str(tmp_path), "tensorwise")  # no pickle: resumed fine on a GPU
    _fp8_resume(parse, str(tmp_path), "delayed", env={"NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1"})


@pytest.mark.parametrize(
    "tokenizer, given, missing",
    [
        ("GPT2BPETokenizer", {"vocab_file": "v.json"}, "--merge-file"),
        ("GPT2BPETokenizer", {}, "--vocab-file and --merge-file"),
        ("BertWordPieceCase", {}, "--vocab-file"),
        ("HuggingFaceTokenizer", {}, "--tokenizer-model"),
        ("NullTokenizer", {}, "--vocab-size"),
        ("NullTokenizer", {"vocab_size": 1024}, None),
        ("SentencePieceTokenizer", {"tokenizer_model": "spm.model"}, None),
    ],
)
def test_a_tokenizer_needs_the_files_its_type_is_built_from(tokenizer, given, missing):
    broken = dict(violations(RunSettings(tokenizer_type=tokenizer, **given)))
    if missing is None:
        assert "tokenizer-files" not in broken
    else:
        assert broken["tokenizer-files"].endswith(f"add {missing} (--tokenizer-type {tokenizer}).")
