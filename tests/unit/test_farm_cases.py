"""The farm's cases as data: every folder under tests/functional/test_cases loads, renders the
command line the farm runs, and finds its golden file; bad CG_FARM blocks are refused."""

from __future__ import annotations

import pytest

from megatron_cg_plugin.farm import runner
from megatron_cg_plugin.farm.cases import CaseError, load_case

# Cases written before their first GPU run: their golden files come from that run (MEGATRON_CG_UPDATE_GOLDEN=1); a
# case leaves this set with the file it gets.
AWAITING_FIRST_RUN = {
    "gpt_4x2048_docmask_cp2_layer_megatron_lm",  # 2 GPUs
    "tiny_gpt_hybrid_cp_banks_eval_resume",  # 2 GPUs
}


def _golden_files(case: runner.FarmCase) -> list[str]:
    """The case's golden files, one per GPU it ran on (Megatron's golden_values_dev_dgx_<gpu>.json)."""
    return sorted(path.name for path in case.golden_folder.glob(runner.golden_file("*")))


def test_every_case_folder_is_a_farm_case_with_its_golden_file():
    names = [case.name for case in runner.CASES]
    assert len(names) == len(set(names)) and len(names) == len(runner.case_folders())
    for case in runner.CASES:
        assert case.nproc >= 1 and case.steps >= 20
        if case.name in AWAITING_FIRST_RUN:
            assert case.check_golden and not _golden_files(case), (
                f"{case.name} has its golden file: drop it from AWAITING_FIRST_RUN"
            )
            continue
        assert bool(_golden_files(case)) == case.check_golden, case.name  # eager-only cases keep no file


def test_a_case_is_held_to_the_golden_file_of_its_gpu():
    (h100,) = [c for c in runner.load_cases(platform="h100") if c.name == "tiny_gpt_layer"]
    assert h100.golden_path.name == "golden_values_dev_dgx_h100.json" and h100.golden_path.exists()
    (h200,) = [c for c in runner.load_cases() if c.name == "tiny_gpt_layer"]
    assert h200.golden_path.name == "golden_values_dev_dgx_h200.json"  # where the GPU is not known


def test_a_case_renders_the_launcher_command_line(tmp_path):
    (case,) = [c for c in runner.CASES if c.name == "tiny_moe_droppad"]
    assert case.argv(graphed=True, out_dir=tmp_path) == [
        "-m",
        "megatron_cg_plugin.pretrain_gpt",
        "--cg-preset",
        "tiny-moe",
        "--cuda-graph-modules",
        "attn",
        "moe",
        "--moe-expert-capacity-factor",
        "1.5",
        "--moe-pad-expert-input-to-capacity",
        "--cg-moe-drop-stats",  # a MoE case: the routers' drops beside the capacity plan
        "--cuda-graph-impl",
        "transformer_engine",
        "--deterministic-mode",
        "--train-iters",
        "24",
        "--cg-metrics-out",
        str(tmp_path / "tiny_moe_droppad.graphed.metrics.json"),
        "--cg-report-out",
        str(tmp_path / "tiny_moe_droppad.graphed.report.json"),
    ]
    eager = case.argv(graphed=False, out_dir=tmp_path)
    assert eager[eager.index("--cuda-graph-impl") + 1] == "none"
    # What megatron-cg plan takes: the same flags without the farm's steps and output files.
    assert case.run_flags(graphed=True, out_dir=tmp_path) == case.argv(graphed=True, out_dir=tmp_path)[2:-6]


def test_farm_settings_reach_the_case(tmp_path):
    by_name = {case.name: case for case in runner.CASES}
    failure = by_name["tiny_gpt_layer_capture_failure"]
    assert failure.expect_capture_failure and failure.compared_metrics == ("lm loss",)
    assert failure.golden_path == by_name["tiny_gpt_layer"].golden_path  # held to another case's file
    offload = by_name["tiny_moe_hybrid_cp_banks_attn_offload"]
    assert (offload.nproc, offload.steps, dict(offload.env)) == (2, 30, {"NVTE_CPU_OFFLOAD_V1": "1"})
    assert by_name["gpt_12x1024_attn_user_script"].argv(graphed=True, out_dir=tmp_path)[:3] == [
        "-m",
        "megatron_cg_plugin.cli",
        "run",
    ]
    assert (
        by_name["tiny_moe_real_data_spm"].data == "sentencepiece" and not by_name["tiny_moe_real_data_spm"].check_golden
    )
    # FP8 attention runs on this host only with non-deterministic algorithms, which --deterministic-mode refuses.
    fp8_attention = by_name["tiny_gpt_slot_fp8_attention_user_script"]
    assert not fp8_attention.deterministic_mode and "--deterministic-mode" not in fp8_attention.argv(
        graphed=True, out_dir=tmp_path
    )
    assert "--deterministic-mode" in failure.argv(graphed=True, out_dir=tmp_path)
    # A case whose eager reference trains without Megatron's offload keeps it in the graphed run only.
    staged = by_name["gpt_6p7b_slot_offload_staged_user_script"]
    eager, graphed = (staged.argv(graphed=g, out_dir=tmp_path) for g in (False, True))
    assert "--fine-grained-activation-offloading" in graphed and "--offload-modules" in graphed
    assert not {"--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "mlp_norm"} & set(eager)
    assert [f for f in runner.without_graph_only_flags(graphed) if f not in eager][:7] == [
        "--fine-grained-activation-offloading",
        "--offload-modules",
        "attn_norm",
        "qkv_linear",
        "core_attn",
        "attn_proj",
        "mlp_norm",
    ]
    assert "--cg-offload-copies" in graphed and "--cg-offload-copies" not in eager  # graphs only: not eager


def test_dropping_the_offload_flags_takes_each_option_with_its_values():
    from megatron_cg_plugin.farm.runner import without_offload_flags

    assert without_offload_flags(
        [
            "--num-layers",
            "2",
            "--fine-grained-activation-offloading",
            "--offload-modules",
            "core_attn",
            "attn_proj",
            "--activation-offload-fraction",
            "0.5",
            "--delay-offload-until-cuda-graph",
            "--min-offloaded-tensor-size",
            "16",
            "--bf16",
            "--cg-slot-capture",
        ]
    ) == ("--num-layers", "2", "--bf16", "--cg-slot-capture")
    assert without_offload_flags(
        ["--offload-modules=core_attn", "--bf16", "--fine-grained-offloading-max-inflight-offloads", "2", "--seed", "1"]
    ) == ("--bf16", "--seed", "1")


@pytest.mark.parametrize(
    "block, message",
    [
        ("steps: 0", "CG_FARM steps 0 must be an integer >= 1"),
        ("data: imagenet", "CG_FARM data 'imagenet' is unknown; use one of synthetic, sentencepiece"),
        ("expect_capture_failure: maybe", "expect_capture_failure must be true or false"),
        ("deterministic_mode: 'no'", "deterministic_mode must be true or false"),
        ("eager_offload: 0", "eager_offload must be true or false"),
        ("ranks: 2", r"CG_FARM has unknown key\(s\) \['ranks'\]"),
    ],
)
def test_bad_farm_blocks_are_refused_naming_the_key(tmp_path, block, message):
    (tmp_path / "model_config.yaml").write_text(f"MODEL_ARGS:\n  --num-layers: 2\nCG_FARM:\n  {block}\n")
    with pytest.raises(CaseError, match=message):
        load_case(tmp_path)


def test_a_golden_case_must_name_exactly_one_case(tmp_path):
    for name in ("a", "b"):
        folder = tmp_path / "gpt" / name
        folder.mkdir(parents=True)
        (folder / "model_config.yaml").write_text("MODEL_ARGS:\n  --num-layers: 2\nCG_FARM:\n  golden_case: missing\n")
    (case, _) = runner.load_cases(tmp_path)
    with pytest.raises(CaseError, match="golden_case 'missing' names 0 case folders"):
        _ = case.golden_path


def test_the_tiny_moe_cases_keep_their_own_graph_scope_over_the_presets():
    """Their golden values were recorded before tiny-moe named a scope: each case names its own, which
    replaces the preset's (presets.REPLACED_BY), so what they train is unchanged."""
    from megatron_cg_plugin.launch.presets import DROPLESS_MOE_SCOPE, expand_preset

    moe = [case for case in runner.CASES if "tiny-moe" in case.flags]
    assert len(moe) >= 5
    for case in moe:
        expanded = expand_preset(list(case.flags))
        assert expanded.count("--cuda-graph-modules") == 1, case.name
        assert (
            expanded[expanded.index("--cuda-graph-modules") :][:4] != list(DROPLESS_MOE_SCOPE)
            or case.name in ("tiny_moe_router", "tiny_moe_router_eval_resume")  # the preset's own scope
        ), case.name
