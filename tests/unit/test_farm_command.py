"""megatron-cg farm on CPU: Megatron-style cases mapped to what the farm has (checkpoints,
TensorBoard, data), fitted to the GPUs at hand, compared eager vs graphed only where the golden
file is not this run's; --dry-run prints what would run."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from megatron_cg_plugin import cli
from megatron_cg_plugin.farm.case_adapt import adapt_case_args
from megatron_cg_plugin.farm.runner import prepare_case

MEGATRON_LM = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")

# Shaped like Megatron-LM's test_cases/*/model_config.yaml (written here, not copied from it).
MEGATRON_STYLE = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
MODEL_ARGS:
  --num-layers: 4
  --hidden-size: 256
  --num-attention-heads: 4
  --seq-length: 256
  --max-position-embeddings: 256
  --tensor-model-parallel-size: 2
  --pipeline-model-parallel-size: 2
  --pipeline-model-parallel-layout: Et|(tt|)*2L
  --sequence-parallel: true
  --micro-batch-size: 2
  --global-batch-size: 16
  --train-iters: 100
  --lr: 1.0e-4
  --data-path: ${DATA_PATH}/text/my-gpt3_00_text_document
  --vocab-file: ${DATA_PATH}/text/bpe/vocab.json
  --data-cache-path: ${DATA_CACHE_PATH}
  --save: ${CHECKPOINT_SAVE_PATH}
  --load: ${CHECKPOINT_LOAD_PATH}
  --save-interval: 50
  --tensorboard-dir: ${TENSORBOARD_PATH}
  --log-memory-to-tensorboard: true
  --cuda-graph-impl: transformer_engine
  --cuda-graph-modules: "[attn mlp]"
TEST_TYPE: ckpt-resume
METRICS:
  - "lm loss"
"""


def write_case(root: Path, text: str, name: str = "gpt3_style_case") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model_config.yaml").write_text(text)
    (folder / "golden_values_dev_dgx_h100.json").write_text("{}")
    return folder


def test_infrastructure_flags_are_dropped_and_mock_data_takes_the_datasets_place(tmp_path):
    args, placeholders, changes = adapt_case_args(
        {
            "--save": "${CHECKPOINT_SAVE_PATH}",
            "--tensorboard-dir": "x",
            "--log-timers-to-tensorboard": True,
            "--wandb-project": "p",
            "--data-path": "${DATA_PATH}/d",
            "--vocab-file": "v",
            "--train-iters": 9,
            "--num-layers": 2,
            "--vocab-size": 1024,
            "--no-load-optim": False,
        },
        data_path=None,
        out_dir=tmp_path,
        apex_wgrad=True,
    )
    assert args == {
        "--num-layers": 2,
        "--vocab-size": 1024,
        "--no-load-optim": False,
        "--mock-data": True,
        "--tokenizer-type": "NullTokenizer",
    }
    assert placeholders == {"DATA_CACHE_PATH": str(tmp_path / "data_cache")}
    assert "--save dropped: the farm keeps no checkpoint" in changes
    assert "--log-timers-to-tensorboard dropped: metrics come from --cg-metrics-out, not TensorBoard or W&B" in changes
    assert "--train-iters dropped: the farm sets the steps and runs eager and graphed" in changes


def test_a_data_path_stands_for_the_cases_data_root(tmp_path):
    args, placeholders, changes = adapt_case_args(
        {"--data-path": "${DATA_PATH}/d", "--tokenizer-type": "GPT2BPETokenizer"},
        data_path="/datasets",
        out_dir=tmp_path,
        apex_wgrad=True,
    )
    assert args == {"--data-path": "${DATA_PATH}/d", "--tokenizer-type": "GPT2BPETokenizer"}
    assert placeholders["DATA_PATH"] == "/datasets" and changes == []


@pytest.mark.parametrize("case_flag", [None, False, True])
def test_without_apex_gradient_accumulation_fusion_is_turned_off_and_said_so(tmp_path, case_flag):
    model_args = {"--num-layers": 2} | ({} if case_flag is None else {"--no-gradient-accumulation-fusion": case_flag})
    args, _, changes = adapt_case_args(model_args, data_path="/d", out_dir=tmp_path, apex_wgrad=False)
    assert args["--no-gradient-accumulation-fusion"] is True
    assert any(c.startswith("--no-gradient-accumulation-fusion added: APEX") for c in changes) == (
        case_flag is not True
    )
    args, _, changes = adapt_case_args(model_args, data_path="/d", out_dir=tmp_path, apex_wgrad=True)
    assert args == model_args and changes == []


def test_a_megatron_case_is_fitted_mapped_and_compared_eager_vs_graphed_only(tmp_path):
    case, notes = prepare_case(write_case(tmp_path, MEGATRON_STYLE), out_dir=tmp_path / "out", gpus=1)
    flags = list(case.flags)
    assert "${" not in " ".join(flags) and "--save" not in flags and "--tensorboard-dir" not in flags
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "1"
    assert "--pipeline-model-parallel-layout" not in flags and "--sequence-parallel" not in flags
    assert flags[flags.index("--global-batch-size") + 1] == "8"  # 2 DP ranks -> 1, microbatches kept
    assert "--mock-data" in flags and case.nproc == 1 and not case.check_golden
    assert any("golden_values_dev_dgx_h100.json" in note and "eager vs graphed only" in note for note in notes)
    argv = case.argv(graphed=False, out_dir=tmp_path)
    assert argv[argv.index("--cuda-graph-impl") + 1] == "none"  # the farm's, not the case's
    # ckpt-resume: both halves run; the case's own folders and save step give way to the farm's.
    assert case.resumes and "--load" not in flags and "--save-interval" not in flags
    assert any(note.startswith("--save dropped: the farm gives each run its folders") for note in notes)
    own = str(case.checkpoint(tmp_path, graphed=False))
    assert argv[argv.index("--save") + 1] == own == argv[argv.index("--load") + 1]
    assert argv[argv.index("--save-interval") + 1] == str(case.steps // 2)


def test_cli_dry_run_prints_every_change_and_the_command(tmp_path, capsys):
    folder = write_case(tmp_path, MEGATRON_STYLE)
    assert cli.main(["farm", str(folder), "--fit-gpus", "1", "--dry-run", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "== gpt3_style_case: 1 rank(s), 24 steps, eager vs graphed" in out
    assert "--tensor-model-parallel-size 2 -> 1" in out and "--save dropped" in out
    assert "python -m megatron_cg_plugin.pretrain_gpt --num-layers 4" in out
    assert "   check: OK (Megatron's validation and every rule, eager and graphed)" in out
    # ckpt-resume: the second half's command too, loading the eager run's checkpoint
    (second,) = [line for line in out.splitlines() if line.startswith("   then python ")]
    assert f"--load {tmp_path / 'o' / 'gpt3_style_case.eager.checkpoints'}" in second


def test_cli_refuses_a_megatron_case_without_fit_gpus(tmp_path, capsys):
    folder = write_case(tmp_path, MEGATRON_STYLE)
    assert cli.main(["farm", str(folder), "--dry-run"]) == cli.EXIT_BAD_INPUT
    assert "a Megatron case is written for 8 GPUs; pass --fit-gpus N" in capsys.readouterr().err


def test_the_farms_own_case_keeps_its_golden_file(tmp_path):
    root = Path(__file__).resolve().parents[1] / "functional" / "test_cases"
    case, notes = prepare_case(root / "gpt" / "tiny_gpt_layer", out_dir=tmp_path)
    assert case.check_golden and notes == []
    fitted, notes = prepare_case(root / "gpt" / "tiny_gpt_layer_dp2", out_dir=tmp_path, gpus=1)
    assert not fitted.check_golden and any("eager vs graphed only" in note for note in notes)


@pytest.mark.skipif(not MEGATRON_LM.is_dir(), reason="needs the Megatron-LM mirror (fetched for reading, not vendored)")
@pytest.mark.parametrize(
    "name",
    [
        "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph",
        "gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph",
    ],
)
def test_megatron_lms_graph_cases_fit_one_gpu_on_mock_data(tmp_path, name):
    text = subprocess.run(
        [
            "git",
            "-C",
            str(MEGATRON_LM),
            "show",
            f"core_r0.19.0:tests/functional_tests/test_cases/moe/{name}/model_config.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    case, notes = prepare_case(write_case(tmp_path, text, name), out_dir=tmp_path / "out", gpus=1)
    flags = " ".join(case.flags)
    assert "${" not in flags and "--mock-data" in flags and "--load" not in case.flags
    for size in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size"):
        assert case.flags[case.flags.index(size) + 1] == "1", (size, notes)


def test_what_deterministic_mode_refuses_goes_with_a_note(tmp_path):
    from megatron_cg_plugin.farm.case_adapt import adapt_case_env

    args, _, changes = adapt_case_args(
        {"--cross-entropy-loss-fusion": True, "--tp-comm-overlap": True, "--train-samples": 1000, "--num-layers": 2},
        data_path="/d",
        out_dir=tmp_path,
        apex_wgrad=True,
    )
    assert args == {"--num-layers": 2}
    assert (
        "--cross-entropy-loss-fusion dropped: --deterministic-mode refuses it (eager == graphed is compared bit "
        "for bit)" in changes
    )
    env, notes = adapt_case_env({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "X": "y"})
    assert env == {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "X": "y"}
    assert notes == ["NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 -> 0: --deterministic-mode refuses it"]


def test_the_determinism_tables_are_megatrons():
    from megatron.training import determinism

    from megatron_cg_plugin.farm import case_adapt

    assert set(case_adapt.NONDETERMINISTIC_FLAGS.values()) == set(determinism.ARG_VALUES_REQUIRED_FOR_DETERMINISM)
    assert all(value is False for value in determinism.ARG_VALUES_REQUIRED_FOR_DETERMINISM.values())
    assert {k: set(v) for k, v in case_adapt.DETERMINISTIC_ENV.items()} == {
        k: set(v) for k, v in determinism.ACCEPTED_ENV_VAR_VALUES.items()
    }


def test_a_pipeline_layout_goes_whenever_the_stage_count_changes():
    from megatron_cg_plugin.farm.cases import fit_gpus

    args, changes = fit_gpus(
        {
            "--pipeline-model-parallel-size": 4,
            "--pipeline-model-parallel-layout": "Et|(tt|)*3L",
            "--num-virtual-stages-per-pipeline-rank": 2,
        },
        2,
    )
    assert args["--pipeline-model-parallel-size"] == 2
    assert "--pipeline-model-parallel-layout" not in args and "--num-virtual-stages-per-pipeline-rank" not in args
    assert "--pipeline-model-parallel-layout 'Et|(tt|)*3L' dropped (PP 4 -> 2)" in changes
    kept, _ = fit_gpus({"--pipeline-model-parallel-size": 2, "--pipeline-model-parallel-layout": "Et|tL"}, 2)
    assert kept["--pipeline-model-parallel-layout"] == "Et|tL"  # the stages the layout was written for


def test_metrics_megatron_checks_deterministically_are_compared_eager_vs_graphed(tmp_path):
    from megatron_cg_plugin.farm.runner import CaseResult, problems_of
    from megatron_cg_plugin.golden import GoldenValues, MetricSeries

    text = MEGATRON_STYLE.replace('  - "lm loss"\n', '  - "lm loss"\n  - "mtp_1 loss"\n  - "iteration-time"\n')
    case, _ = prepare_case(write_case(tmp_path, text), out_dir=tmp_path / "out", gpus=1)
    assert case.equal_metrics == ("lm loss", "mtp_1 loss")  # iteration time is measured, never compared

    def run(mtp):
        steps = range(1, 25)
        return GoldenValues({"lm loss": MetricSeries(dict.fromkeys(steps, 1.0)), "mtp_1 loss": MetricSeries(mtp)})

    report = {"scopes": [{"graphs_captured": 2, "replays": 40, "pool_bytes": 0, "capture_seconds": 1.0}]}
    same = CaseResult(case, run(dict.fromkeys(range(1, 25), 2.0)), run(dict.fromkeys(range(1, 25), 2.0)), report, "")
    assert problems_of(case, same) == []
    off = CaseResult(
        case, run(dict.fromkeys(range(1, 25), 2.0)), run({**dict.fromkeys(range(1, 25), 2.0), 9: 2.5}), report, ""
    )
    assert problems_of(case, off) == ["mtp_1 loss differs eager vs graphed (step: eager, graphed): {9: (2.0, 2.5)}"]
    # A difference by the last eager warmup step began before any graph ran, and the message says so.
    early = CaseResult(
        case, run(dict.fromkeys(range(1, 25), 2.0)), run({**dict.fromkeys(range(1, 25), 2.0), 3: 2.5}), report, ""
    )
    assert problems_of(case, early) == [
        "mtp_1 loss differs eager vs graphed (step: eager, graphed): {3: (2.0, 2.5)}; it differs from step 3, and "
        "steps 1-3 train eagerly in both runs (Megatron captures after --cuda-graph-warmup-steps 3): the difference "
        "began outside the graphs."
    ]
    offloaded = dataclasses.replace(
        case, flags=(*case.flags, "--fine-grained-activation-offloading", "--cuda-graph-warmup-steps", "4")
    )
    late = CaseResult(
        case, run(dict.fromkeys(range(1, 25), 2.0)), run({**dict.fromkeys(range(1, 25), 2.0), 4: 2.5}), report, ""
    )
    assert problems_of(offloaded, late)[0].endswith(
        "steps 1-4 train eagerly in both runs (Megatron captures after --cuda-graph-warmup-steps 4): the difference "
        "began outside the graphs. Megatron's eager fine-grained offload ran in those steps of the graphed run, and "
        "it is not reproducible on every model (docs/farm.md)."
    )
    assert problems_of(offloaded, off) == problems_of(case, off)  # step 9: graphed, no note
    assert dataclasses.replace(case, flags=(*case.flags, "--cuda-graph-warmup-steps=5")).eager_steps == 5
    short, _ = prepare_case(write_case(tmp_path / "short", text), out_dir=tmp_path / "out", gpus=1, steps=12)
    assert problems_of(short, same) == ["expected steps 1-12 logged, got 24 eager / 24 graphed"]


def test_moe_cases_measure_their_routers_drops_and_the_summary_sets_them_beside_the_plan(tmp_path):
    from megatron_cg_plugin.farm.runner import CASES_DIR, format_summary

    moe, _ = prepare_case(CASES_DIR / "moe" / "tiny_moe_droppad", out_dir=tmp_path)
    dense, _ = prepare_case(CASES_DIR / "gpt" / "tiny_gpt_layer", out_dir=tmp_path)
    assert "--cg-moe-drop-stats" in moe.argv(graphed=False, out_dir=tmp_path)  # the preset names the experts
    assert "--cg-moe-drop-stats" not in dense.argv(graphed=True, out_dir=tmp_path)
    row = dict(
        case="c",
        nproc=1,
        steps=24,
        losses_equal=True,
        eager_ms=1.0,
        graphed_ms=0.5,
        reduction=0.5,
        graphs=2,
        replays=8,
        pool_mib=28.0,
        capture_s=1.0,
        moe_dropped=0.0312,
        moe_capacity=384,
        moe_uniform_dropped=0.0,
    )
    assert "| 3.12% (plan: 384 slots, 0.0%) |" in format_summary([row])
    assert format_summary([row | {"moe_dropped": None}]).endswith("| - |")


def test_a_slot_offload_case_whose_graphs_moved_nothing_to_the_host_fails():
    import dataclasses

    from megatron_cg_plugin.farm.runner import CASES, CaseResult, problems_of
    from megatron_cg_plugin.golden import GoldenValues, MetricSeries

    case = dataclasses.replace(next(c for c in CASES if c.name == "tiny_gpt_slot_offload"), check_golden=False)
    run = GoldenValues(
        {
            "lm loss": MetricSeries(dict.fromkeys(range(1, case.steps + 1), 1.0)),
            "num-zeros": MetricSeries(dict.fromkeys(range(1, case.steps + 1), 0.0)),
        }
    )

    def report(offloaded):
        return {
            "scopes": [
                {
                    "scope": "layer (slot-shared)",
                    "graphs_captured": 2,
                    "replays": 40,
                    "pool_bytes": 0,
                    "capture_seconds": 1.0,
                    "offloaded_bytes": offloaded,
                }
            ]
        }

    assert problems_of(case, CaseResult(case, run, run, report(1 << 20), "")) == []
    assert "offloaded nothing inside the graphs" in problems_of(case, CaseResult(case, run, run, report(0), ""))[0]


@pytest.mark.parametrize("steps", ["-5", "0"])
def test_farm_refuses_a_step_count_below_one_and_says_the_default(tmp_path, capsys, steps):
    case = Path(__file__).resolve().parents[1] / "functional" / "test_cases" / "gpt" / "tiny_gpt_layer"
    assert cli.main(["farm", str(case), "--dry-run", "--steps", steps, "--out", str(tmp_path)]) == cli.EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert f"--steps {steps} must be >= 1" in err and "else 24" in err


def test_farm_refuses_a_data_path_that_does_not_exist(tmp_path, capsys):
    folder = write_case(tmp_path, MEGATRON_STYLE)
    missing = tmp_path / "nonexistent"
    assert cli.main(["farm", str(folder), "--fit-gpus", "1", "--dry-run", "--data-path", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"--data-path {missing} does not exist" in err


def test_the_eager_reference_leaves_out_the_flags_only_graphs_use(tmp_path):
    from megatron_cg_plugin.config import PLUGIN_FLAGS
    from megatron_cg_plugin.farm.runner import load_cases, without_graph_only_flags

    graph_only = {flag.flag for flag in PLUGIN_FLAGS if flag.graphs_only}
    assert without_graph_only_flags(
        ["--cg-slot-capture", "--cg-offload-window", "2", "--cg-contract-check=off", "--cg-thd-max-seqs", "4", "--bf16"]
    ) == ("--cg-thd-max-seqs", "4", "--bf16")
    for case in load_cases(megatron_lm_dir=str(tmp_path)):  # the Megatron-LM cases' script path resolves there
        eager = case.argv(graphed=False, out_dir=tmp_path)
        assert not graph_only & {flag.split("=")[0] for flag in eager}, case.name
        assert eager[eager.index("--cuda-graph-impl") + 1] == "none"


# -- --fit-gpus drops what the smaller run cannot take; the dry run checks every case -------------------

MEGATRON_CASES = Path(__file__).parent / "_cases"  # copied verbatim from Megatron-LM core_r0.19.0
OFFLOADING = MEGATRON_CASES / "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading"
FULL_RECOMPUTE = MEGATRON_CASES / "gpt3_mcore_te_tp1_pp1_uniform_full_recompute"


def with_model_args(tmp_path: Path, folder: Path, **extra) -> Path:
    import yaml

    data = yaml.safe_load((folder / "model_config.yaml").read_text())
    data["MODEL_ARGS"].update(extra)
    copy = tmp_path / folder.name
    copy.mkdir(parents=True)
    (copy / "model_config.yaml").write_text(yaml.safe_dump(data))
    return copy


def scoped_without_recompute(tmp_path: Path) -> Path:
    """Megatron's offloading case with attention graphed and no selective recompute: exact on one GPU."""
    import yaml

    folder = with_model_args(tmp_path / "scoped", OFFLOADING, **{"--cuda-graph-modules": "[attn]"})
    data = yaml.safe_load((folder / "model_config.yaml").read_text())
    del data["MODEL_ARGS"]["--recompute-granularity"], data["MODEL_ARGS"]["--recompute-modules"]
    (folder / "model_config.yaml").write_text(yaml.safe_dump(data))
    return folder


def test_fitting_megatrons_ep4_offloading_case_to_one_gpu_leaves_flags_megatron_takes(tmp_path):
    from megatron_cg_plugin.farm.runner import refusal_of

    case, notes = prepare_case(OFFLOADING, out_dir=tmp_path, gpus=1)
    assert (
        "--overlap-moe-expert-parallel-comm dropped (EP 4 -> 1: Megatron overlaps expert-parallel communication "
        "only with EP > 1)" in notes
    )
    assert "--overlap-moe-expert-parallel-comm" not in case.flags
    assert (
        "NCCL_GRAPH_REGISTER=0 added: PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which corrupts "
        "memory under CUDA graphs otherwise (rule expandable-segments)" in notes
    )
    # As written it graphs whole layers of a dropless MoE, which a plugin rule refuses; Megatron takes the flags.
    refusal = refusal_of(case, tmp_path)
    assert refusal is not None and {name for name, _ in refusal.violations} == {
        "whole-layer-moe-needs-drop-and-pad",
        "whole-layer-offload-unjoined",
        "offload-recompute-in-graphs",
    }  # no "megatron"
    scoped, _ = prepare_case(
        with_model_args(tmp_path, OFFLOADING, **{"--cuda-graph-modules": "[attn]"}), out_dir=tmp_path, gpus=1
    )
    # Attention graphed: trained differently with its offload and recompute together on one GPU, so refused.
    refusal = refusal_of(scoped, tmp_path)
    assert refusal is not None and {name for name, _ in refusal.violations} == {"offload-recompute-in-graphs"}
    exact, _ = prepare_case(scoped_without_recompute(tmp_path), out_dir=tmp_path, gpus=1)
    assert refusal_of(exact, tmp_path) is None  # Megatron's validation and every rule, eager and graphed


def test_the_dry_run_prints_each_fitted_cases_verdict(tmp_path, capsys):
    assert (
        cli.main(["farm", str(OFFLOADING), "--fit-gpus", "1", "--dry-run", "--out", str(tmp_path)])
        == cli.EXIT_BAD_INPUT
    )  # its one case is refused
    out = capsys.readouterr().out
    assert "   REFUSED [whole-layer-moe-needs-drop-and-pad] whole-layer capture" in out
    assert "REFUSED [megatron]" not in out and out.rstrip().splitlines()[-1].startswith("farm: 1 refused (refused:")
    scoped = scoped_without_recompute(tmp_path)
    assert cli.main(["farm", str(scoped), "--fit-gpus", "1", "--dry-run", "--out", str(tmp_path)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "   check: OK (Megatron's validation and every rule, eager and graphed)" in out
    assert out.rstrip().endswith("farm: 1 checked")


@pytest.mark.parametrize(
    "model_args, gpus, dropped, kept",
    [
        (
            {
                "--expert-model-parallel-size": 4,
                "--overlap-moe-expert-parallel-comm": True,
                "--delay-wgrad-compute": True,
                "--ep-overlap-early-attn-memory-release": True,
            },
            1,
            ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--ep-overlap-early-attn-memory-release"],
            [],
        ),
        (
            {"--expert-model-parallel-size": 4, "--overlap-moe-expert-parallel-comm": True},
            2,
            [],
            ["--overlap-moe-expert-parallel-comm"],
        ),  # EP 2 still overlaps
        (
            {
                "--context-parallel-size": 4,
                "--hierarchical-context-parallel-sizes": "[2 2]",
                "--cp-comm-type": "a2a+p2p",
            },
            2,
            ["--hierarchical-context-parallel-sizes", "--cp-comm-type"],
            [],
        ),
        (
            {
                "--pipeline-model-parallel-size": 4,
                "--num-layers-in-first-pipeline-stage": 3,
                "--microbatch-group-size-per-virtual-pipeline-stage": 2,
            },
            1,
            ["--num-layers-in-first-pipeline-stage", "--microbatch-group-size-per-virtual-pipeline-stage"],
            [],
        ),
        ({"--tensor-model-parallel-size": 2, "--sequence-parallel": True}, 2, [], ["--sequence-parallel"]),
    ],
)
def test_fit_gpus_drops_each_flag_the_smaller_run_cannot_take_and_says_why(model_args, gpus, dropped, kept):
    from megatron_cg_plugin.farm.cases import fit_gpus

    args, changes = fit_gpus(model_args, gpus)
    for flag in dropped:
        assert flag not in args and any(
            change.startswith(f"{flag}") and " dropped (" in change for change in changes
        ), (flag, changes)
    assert all(flag in args for flag in kept), changes


def test_fit_gpus_turns_the_flex_dispatcher_into_alltoall_without_tp_or_ep():
    from megatron_cg_plugin.farm.cases import fit_gpus

    flex = {
        "--expert-model-parallel-size": 8,
        "--moe-token-dispatcher-type": "flex",
        "--moe-flex-dispatcher-backend": "deepep",
    }
    args, changes = fit_gpus(flex, 1)
    assert args["--moe-token-dispatcher-type"] == "alltoall" and "--moe-flex-dispatcher-backend" not in args
    assert changes[-2:] == [
        "--moe-token-dispatcher-type flex -> alltoall (TP x EP 1: Megatron's DeepEP and NCCL EP "
        "dispatchers need TP x EP > 1)",
        "--moe-flex-dispatcher-backend 'deepep' dropped (the flex dispatcher's)",
    ]
    assert fit_gpus(flex, 2)[0]["--moe-token-dispatcher-type"] == "flex"  # EP 2


# -- a case a rule refuses is REFUSED, apart from failures, and never launched ---------------------------


def test_a_refused_case_is_reported_with_its_rule_and_never_launched(tmp_path, capsys, monkeypatch):
    from megatron_cg_plugin.farm import runner

    monkeypatch.setattr(runner, "run_case", lambda *a, **k: pytest.fail("a refused case must not launch"))
    monkeypatch.setattr(cli, "gpu_stack_missing", lambda n: None)  # a GPU host
    assert cli.main(["farm", str(FULL_RECOMPUTE), "--fit-gpus", "1", "--out", str(tmp_path)]) == cli.EXIT_BAD_INPUT
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert (
        "   REFUSED [full-recompute] --recompute-granularity full is only supported with --cuda-graph-impl "
        "full_iteration: use --recompute-granularity selective or turn graphs off." in lines
    )
    assert "FAIL" not in out and "python -m" not in out  # not a crash, no command line
    assert (
        lines[-1].startswith("farm: 1 refused (refused: Megatron or a plugin rule refuses the case's flags")
        and "no failure of the plugin" in lines[-1]
    )


def test_refused_cases_do_not_fail_a_farm_whose_other_cases_pass(tmp_path, capsys, monkeypatch):
    from megatron_cg_plugin.farm import runner
    from megatron_cg_plugin.golden import GoldenValues, MetricSeries

    monkeypatch.setattr(cli, "gpu_stack_missing", lambda n: None)  # a GPU host

    def passing_run(case, out_dir):
        run = GoldenValues({"lm loss": MetricSeries(dict.fromkeys(range(1, case.steps + 1), 1.0))})
        report = {"scopes": [{"graphs_captured": 2, "replays": 40, "pool_bytes": 0, "capture_seconds": 1.0}]}
        return runner.CaseResult(case, run, run, report, "")

    monkeypatch.setattr(runner, "run_case", passing_run)
    passing = write_case(tmp_path, MEGATRON_STYLE)
    code = cli.main(["farm", str(passing), str(FULL_RECOMPUTE), "--fit-gpus", "1", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK, out
    assert "   PASS" in out and "   REFUSED [full-recompute]" in out
    assert out.rstrip().splitlines()[-1].startswith("farm: 1 passed, 1 refused (refused:")


def test_farm_help_says_where_its_output_goes_and_what_the_exit_code_means(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["farm", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    assert "default: farm-out in the current folder" in out and "REFUSED" in out
    assert "2 on bad input or when every case was refused" in out


def test_a_megatron_lm_case_without_a_checkout_names_megatron_lm_dir(monkeypatch, capsys):
    from megatron_cg_plugin.cli import main

    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    folder = Path(__file__).resolve().parents[2] / "tests/functional/test_cases/moe/moe_8x2048_droppad_megatron_lm"
    assert main(["farm", str(folder), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "set MEGATRON_LM_DIR" in err and "Traceback" not in err and len(err.splitlines()) == 1
