"""Tests for the ``megatron-cg`` CLI, run in-process: the CPU dry-run ``check`` (which goes through
Megatron's real parser and validate_args) and the ``golden`` commands."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_cg_plugin import __version__, cli, golden
from megatron_cg_plugin.config import FLAG_GROUPS, PLUGIN_FLAGS
from megatron_cg_plugin.golden import GoldenValues, MetricSeries
from megatron_cg_plugin.launch.presets import MOE_FLAGS

TE = ["--cuda-graph-impl", "transformer_engine"]
GPT = ["--cg-preset", "tiny-gpt"]
MOE = ["--cg-preset", "tiny-moe"]
MOE_LAYERS = [*GPT, *MOE_FLAGS]  # tiny-moe's experts without its graph scope: whole layers
DROP_PAD = ["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"]
ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in (*ENV_KEYS, "PYTORCH_CUDA_ALLOC_CONF", "NCCL_GRAPH_REGISTER"):
        monkeypatch.delenv(key, raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    yield
    assert not torch.are_deterministic_algorithms_enabled()


def run(capsys, *argv):
    code = cli.main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- check: accepted flags --------------------------------------------------------------------------


def test_check_tiny_gpt_whole_layer(capsys):
    code, out, err = run(capsys, *GPT, *TE)
    assert code == cli.EXIT_OK, err
    assert out.startswith("flags OK\n")
    assert "scope: layer" in out
    assert "graphed layers (global numbers): 1, 2" in out
    assert "microbatches per step: 4; captured per layer: 1" in out  # 8 / (2 x 1)
    assert "megatron-cg" not in err


def test_check_tiny_moe_attn_router(capsys):
    code, out, err = run(
        capsys,
        *MOE,
        *TE,
        "--cuda-graph-modules",
        "attn",
        "moe_router",
        "moe_preprocess",
        "--num-layers",
        "4",
        "--moe-layer-freq",
        "2",
    )
    assert code == 0, err
    assert "scope: attn+moe_router+moe_preprocess" in out
    assert "graphed layers (global numbers): 1-4" in out


def test_check_tiny_moe_drop_and_pad_moe_scope(capsys):
    code, out, err = run(
        capsys,
        *MOE,
        *TE,
        *DROP_PAD,
        "--cuda-graph-modules",
        "moe",
        "--num-layers",
        "4",
        "--moe-layer-freq",
        "[1,0,0,1]",
    )
    assert code == 0, err
    assert "scope: moe" in out
    assert "graphed layers (global numbers): 1, 4" in out


def test_check_data_parallel_from_nproc(capsys):
    code, out, err = run(capsys, "--nproc", "2", *GPT, *TE)
    assert code == 0, err
    assert "microbatches per step: 2; captured per layer: 1" in out  # 8 / (2 x 2)


def test_check_pipeline_parallel_captures_every_microbatch(capsys):
    code, out, err = run(capsys, "--nproc", "2", *GPT, *TE, "--pipeline-model-parallel-size", "2", "--num-layers", "4")
    assert code == 0, err
    assert "layers per pipeline stage: 2" in out
    assert "microbatches per step: 4; captured per layer: 4" in out
    assert "graphs per rank on the first pipeline stage: 8" in out


def test_check_without_graphs_is_an_eager_run(capsys):
    code, out, err = run(capsys, *GPT)
    assert code == 0, err
    assert "flags OK" in out and "eager run" in out


# -- check: rejected flags --------------------------------------------------------------------------


def test_check_reports_both_broken_moe_rules(capsys):
    code, out, err = run(capsys, *MOE, *TE, "--cuda-graph-modules", "attn", "moe", "moe_router")
    assert code == cli.EXIT_BAD_INPUT
    assert out == ""
    assert "[moe-xor-router]" in err
    assert "[moe-scope-needs-drop-and-pad]" in err
    assert "--moe-pad-expert-input-to-capacity" in err


def test_check_whole_layer_dropless_moe(capsys):
    code, _, err = run(capsys, *MOE_LAYERS, *TE)
    assert code == 2
    assert "[whole-layer-moe-needs-drop-and-pad]" in err


def test_check_full_recompute(capsys):
    code, _, err = run(capsys, *GPT, *TE, "--recompute-granularity", "full", "--recompute-method", "uniform")
    assert code == 2
    assert "[full-recompute]" in err and "full_iteration" in err


def test_check_full_recompute_without_graphs_is_fine(capsys):
    code, _, err = run(
        capsys, *GPT, "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"
    )
    assert code == 0, err


def test_check_expandable_segments_env(capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    code, _, err = run(capsys, *GPT, *TE)
    assert code == 2 and "NCCL_GRAPH_REGISTER=0" in err
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    code, _, err = run(capsys, *GPT, *TE)
    assert code == 0, err


@pytest.mark.parametrize(
    "flags, detail",
    [
        (["--fp16"], "assert not args.bf16"),  # beside the preset's --bf16; Megatron asserts without a message
        (["--nproc", "2", "--eval-global-batch-size", "3"], "divisible"),
    ],
)
def test_check_megatron_only_violations(capsys, flags, detail):
    code, out, err = run(capsys, *GPT, *TE, *flags)
    assert code == 2
    assert out == ""
    first, *others = err.splitlines()
    assert first.startswith("megatron-cg check: [megatron] ") and detail in first
    assert others == ["  (1 rule broken: see docs/troubleshooting.md)"]  # not one of our rules


def test_check_parallel_sizes_rule(capsys):
    code, _, err = run(capsys, "--nproc", "3", *GPT, "--tensor-model-parallel-size", "2")
    assert code == 2
    # Megatron's validate_args runs first (it normalizes flags) and already names the sizes.
    assert err.startswith("megatron-cg check: [megatron] world size (3) is not divisible")


@pytest.mark.parametrize("nproc", ["0", "-1"])
def test_check_bad_nproc(capsys, nproc):
    code, out, err = run(capsys, "--nproc", nproc, *GPT, *TE)
    assert code == 2
    assert out == ""
    assert "--nproc must be >= 1" in err


def test_check_bad_preset(capsys):
    code, _, err = run(capsys, "--cg-preset", "huge")
    assert code == 2
    assert "tiny-gpt" in err and "tiny-moe" in err


# -- check leaves the process as it found it --------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        [*GPT, *TE],  # accepted
        [*MOE, *TE, "--cuda-graph-modules", "moe"],  # our rules reject
        [*GPT, *TE, "--num-attention-heads", "3"],  # Megatron rejects inside the stand-ins
    ],
)
@pytest.mark.parametrize("preset_env", [False, True])
def test_check_restores_process_state(capsys, monkeypatch, flags, preset_env):
    if preset_env:
        monkeypatch.setenv("WORLD_SIZE", "16")
        monkeypatch.setenv("RANK", "5")
    before_env = {key: os.environ.get(key) for key in ENV_KEYS}
    capability = torch.cuda.get_device_capability
    cli.main(["check", "--nproc", "2", *flags])
    capsys.readouterr()
    assert torch.cuda.get_device_capability is capability
    assert {key: os.environ.get(key) for key in ENV_KEYS} == before_env


def test_check_uses_nproc_not_the_callers_world_size(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # would fit PP 2, but check plans for --nproc (default 1)
    pp2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    code, _, err = run(capsys, *GPT, *TE, *pp2)
    assert code == 2 and "not divisible" in err
    code, out, err = run(capsys, "--nproc", "2", *GPT, *TE, *pp2)
    assert code == 0, err
    assert "microbatches per step: 4" in out  # DP 1


# -- check: bugs ------------------------------------------------------------------------------------


def test_check_deprecated_full_scope_is_whole_layer(capsys):
    code, out, err = run(capsys, *MOE, *TE, "--cuda-graph-modules", "full")
    assert code == 2, out
    assert "[whole-layer-moe-needs-drop-and-pad]" in err


def test_check_deprecated_scope_flag(capsys):
    code, out, err = run(capsys, *MOE, *TE, "--cuda-graph-scope", "attn", "moe_router")
    assert code == 0, err
    assert "scope: attn+moe_router" in out


def test_check_virtual_pipeline_chunks(capsys):
    code, out, err = run(
        capsys,
        "--nproc",
        "2",
        *GPT,
        *TE,
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "8",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
    )
    assert code == 0, err
    assert "in 2 model chunk(s)" in out


def test_check_short_moe_layer_freq_list(capsys):
    code, _, err = run(
        capsys,
        *MOE,
        *TE,
        *DROP_PAD,
        "--num-layers",
        "4",
        "--moe-layer-freq",
        "[1,1]",
        "--cuda-graph-modules",
        "attn",
        "mlp",
    )
    assert code == 2
    assert "--moe-layer-freq" in err


@pytest.mark.parametrize("split", [["--tensor-model-parallel-size", "2"], ["--context-parallel-size", "2"]])
def test_check_model_parallel_on_cpu(capsys, monkeypatch, split):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron requires it for TP/CP on Hopper
    code, out, err = run(capsys, "--nproc", "2", *GPT, *TE, *split)
    assert code == 0, err
    assert "flags OK" in out


# -- usage ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_help_lists_the_commands_and_every_plugin_flag_grouped(capsys, argv):
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "``" not in out  # plain text, not the module's RST
    for command in ("run", "check", "plan", "bench", "farm", "golden"):
        assert f"megatron-cg {command} " in out
    for group in FLAG_GROUPS:
        assert f"megatron-cg-plugin: {group}:" in out
    for flag in PLUGIN_FLAGS:
        assert flag.flag in out
        assert " ".join(flag.help.split()[:4]) in " ".join(out.split()), flag.flag  # its help, rewrapped
    assert "MEGATRON_CG_SLOT_DEBUG" in out


def test_version_names_the_plugin_and_the_stack_without_importing_te(capsys):
    assert cli.main(["--version"]) == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"megatron-cg-plugin {__version__}"
    assert [line.split()[0] for line in lines[1:]] == ["torch", "megatron-core", "transformer-engine"]
    assert lines[2] == "megatron-core 0.19.2"
    assert "transformer_engine" not in sys.modules


def test_help_and_golden_start_without_torch(tmp_path):
    # The commands that need torch import it themselves (cli.py's "# deferred:" imports): --help and
    # golden answer in a fraction of a second.
    golden_file = tmp_path / "golden.json"
    golden_file.write_text('{"lm loss": {"start_step": 1, "end_step": 1, "step_interval": 1, "values": {"1": 2.0}}}')
    code = (
        "import sys\nfrom megatron_cg_plugin import cli\n"
        f"cli.main(['--help'])\ncli.main(['golden', 'compare', {str(golden_file)!r}, {str(golden_file)!r}])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]


@pytest.mark.parametrize("typo, meant", [("chek", "check"), ("farmm", "farm"), ("gloden", "golden")])
def test_an_unknown_command_says_which_it_may_mean(capsys, typo, meant):
    assert cli.main([typo, "--cg-preset", "tiny-gpt"]) == cli.EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert f"unknown command {typo!r}, did you mean {meant!r}?" in err


def test_an_unknown_command_far_from_any_lists_them(capsys):
    assert cli.main(["bogus"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "unknown command 'bogus'" in err and "did you mean" not in err and "check, farm" in err


# -- golden -----------------------------------------------------------------------------------------


def values(lm=(10.0, 9.5, 9.0), zeros=(100.0, 100.0, 100.0)) -> GoldenValues:
    return GoldenValues(
        {
            "lm loss": MetricSeries({i + 1: v for i, v in enumerate(lm)}),
            "num-zeros": MetricSeries({i + 1: v for i, v in enumerate(zeros)}),
        }
    )


@pytest.fixture
def files(tmp_path):
    def write(name, gv):
        path = tmp_path / name
        gv.save(path)
        return str(path)

    return write


def golden_cmd(capsys, *argv):
    code = cli.main(["golden", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_golden_compare_identical(capsys, files):
    a, b = files("a.json", values()), files("b.json", values())
    code, out, err = golden_cmd(capsys, "compare", a, b)
    assert code == cli.EXIT_OK, err
    assert "golden values match" in out


def test_golden_compare_lm_loss_differs(capsys, files):
    expected = files("expected.json", values())
    actual = files("actual.json", values(lm=(10.0, 11.0, 9.0)))
    code, out, _ = golden_cmd(capsys, "compare", expected, actual)
    assert code == cli.EXIT_MISMATCH
    assert "1 golden value mismatch" in out
    assert "lm loss step 2" in out
    assert "expected 9.5" in out and "actual 11.0" in out
    assert "step 1" not in out and "step 3" not in out


def test_golden_compare_deterministic_is_exact(capsys, files):
    expected = files("expected.json", values())
    actual = files("actual.json", values(lm=(10.0, 9.5, 9.0001)))
    assert golden_cmd(capsys, "compare", expected, actual)[0] == 0  # within 5%
    code, out, _ = golden_cmd(capsys, "compare", expected, actual, "--deterministic")
    assert code == 1 and "lm loss step 3" in out and "exact" in out


def test_golden_compare_metric_subset(capsys, files):
    expected = files("expected.json", values())
    actual = files("actual.json", values(zeros=(100.0, 500.0, 100.0)))
    assert golden_cmd(capsys, "compare", expected, actual)[0] == 1
    assert golden_cmd(capsys, "compare", expected, actual, "--metrics", "lm loss")[0] == 0
    code, _, err = golden_cmd(capsys, "compare", expected, actual, "--metrics", "no-such-metric")
    assert code == 2 and "no-such-metric" in err


def test_golden_update_writes_file(capsys, files, tmp_path):
    actual = files("actual.json", values(lm=(3.0, 2.0, 1.0)))
    target = tmp_path / "goldens" / "golden_values_x.json"
    code, out, err = golden_cmd(capsys, "update", actual, str(target))
    assert code == 0, err
    assert str(target) in out
    assert GoldenValues.load(target) == GoldenValues.load(actual)
    assert json.loads(target.read_text())["lm loss"]["values"] == {"1": 3.0, "2": 2.0, "3": 1.0}
    assert golden_cmd(capsys, "compare", str(target), actual)[0] == 0


def test_golden_update_replaces_existing(capsys, files):
    old = files("golden.json", values())
    new = files("actual.json", values(lm=(1.0, 1.0, 1.0)))
    assert golden_cmd(capsys, "update", new, old)[0] == 0
    assert golden.GoldenValues.load(old).metrics["lm loss"].values[2] == 1.0


@pytest.mark.parametrize("which", ["expected", "actual"])
def test_golden_compare_missing_file(capsys, files, tmp_path, which):
    present = files("present.json", values())
    missing = str(tmp_path / "missing.json")
    argv = [missing, present] if which == "expected" else [present, missing]
    code, out, err = golden_cmd(capsys, "compare", *argv)
    assert code == cli.EXIT_BAD_INPUT
    assert out == ""
    assert err.startswith("megatron-cg golden:") and "missing.json" in err


def test_golden_update_missing_actual(capsys, tmp_path):
    target = tmp_path / "golden.json"
    code, _, _ = golden_cmd(capsys, "update", str(tmp_path / "nope.json"), str(target))
    assert code == 2
    assert not target.exists()


def test_golden_compare_malformed_file(capsys, files, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"lm loss": {"start_step": 1}}')
    code, _, err = golden_cmd(capsys, "compare", files("ok.json", values()), str(bad))
    assert code == 2 and "lm loss" in err
    bad.write_text("not json")
    assert golden_cmd(capsys, "compare", files("ok.json", values()), str(bad))[0] == 2


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_check_help_does_not_reach_megatrons_broken_help(capsys, flag):
    code, out, _ = run(capsys, flag)
    assert code == cli.EXIT_OK
    assert "usage: megatron-cg check [--nproc N]" in out and "tiny-gpt-hybrid-cp" in out
    assert all(flag.flag in out for flag in PLUGIN_FLAGS)  # the flags check takes, not only the presets


def test_check_hybrid_cp_with_graph_banks(capsys):
    hybrid = ("--nproc", "2", "--cg-preset", "tiny-gpt-hybrid-cp", "--cuda-graph-impl", "transformer_engine")
    code, out, err = run(capsys, *hybrid, "--cg-graph-banks")
    assert code == cli.EXIT_OK, err
    assert "graph banks for CP sizes 1, 2" in out and "graphs per rank on the first pipeline stage: 4" in out
    code, _, err = run(capsys, *hybrid)
    assert code == cli.EXIT_BAD_INPUT and "[hybrid-cp]" in err


# ---------------------------------------------------------------- megatron-cg plan


def test_plan_prints_the_moe_capacity_plan(capsys):
    from megatron_cg_plugin.moe.capacity import MoeCapacityPlan

    code = cli.main(
        [
            "plan",
            "--cg-preset",
            "tiny-moe",
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-modules",
            "attn",
            "moe",
            "--moe-expert-capacity-factor",
            "1.5",
            "--moe-pad-expert-input-to-capacity",
            "--router-load",
            "4,1,1,1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    expected = MoeCapacityPlan(tokens_per_rank=512, topk=2, num_experts=4, capacity_factor=1.5)
    assert f"capacity: {expected.capacity} slots per expert per source rank;" in out
    assert "fc1 (384, 256, 1024), fc2 (384, 512, 256)" in out  # SwiGLU doubles fc1's output
    # By hand: expert 0 would get 4/7 of 1024 but takes each of its 512 tokens once, keeps 384 of them.
    assert "dropped tokens for a 4,1,1,1 router: 12.5%" in out
    assert "scope:" in out and "graph pool (predicted): " in out


def test_plan_dense_and_dropless_models(capsys):
    assert cli.main(["plan", "--cg-preset", "tiny-gpt"]) == 0
    assert "MoE: none (a dense model)." in capsys.readouterr().out
    assert cli.main(["plan", "--cg-preset", "tiny-moe"]) == 0
    assert "dropless (no --moe-expert-capacity-factor)" in capsys.readouterr().out


def test_plan_refuses_what_check_refuses_and_a_bad_router_load(capsys):
    assert cli.main(["plan", *MOE_LAYERS, "--cuda-graph-impl", "transformer_engine"]) == 2
    assert "[whole-layer-moe-needs-drop-and-pad]" in capsys.readouterr().err
    assert (
        cli.main(["plan", "--cg-preset", "tiny-moe", "--moe-expert-capacity-factor", "1.0", "--router-load", "1,2"])
        == 2
    )
    assert "2 shares for 4 experts" in capsys.readouterr().err


def test_plan_says_when_the_capacity_exceeds_the_tokens(capsys):
    # An allgather dispatcher pads each expert to the tokens (the alltoall one is refused by a rule).
    assert (
        cli.main(
            [
                "plan",
                "--cg-preset",
                "tiny-moe",
                "--moe-token-dispatcher-type",
                "allgather",
                "--moe-expert-capacity-factor",
                "3",
                "--moe-pad-expert-input-to-capacity",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "capacity: 768 slots" in out and "512 rows" in out and "at most 2" in out
    assert (
        cli.main(
            [
                "plan",
                "--cg-preset",
                "tiny-moe",
                "--moe-expert-capacity-factor",
                "3",
                "--moe-pad-expert-input-to-capacity",
            ]
        )
        == 2
    )
    assert "[moe-capacity-over-tokens]" in capsys.readouterr().err


# -- inputs that were taken silently or with a misleading message -----------------------------------


def test_check_with_no_flags_says_what_it_takes(capsys):
    code, out, err = run(capsys)
    assert (code, out) == (cli.EXIT_BAD_INPUT, "")
    assert "no flags given" in err and "--cg-preset tiny-gpt" in err and "(no message)" not in err


def test_check_names_every_flag_megatron_requires_at_once(capsys):
    code, _, err = run(capsys, "--num-layers", "2")
    assert code == cli.EXIT_BAD_INPUT and len(err.splitlines()) == 1
    assert "Megatron needs --micro-batch-size, --hidden-size, --num-attention-heads, --max-position-embeddings" in err
    assert "--cg-preset tiny-gpt" in err


@pytest.mark.parametrize("layers", ["-2", "0"])
def test_check_refuses_a_layer_count_below_one_naming_the_flag(capsys, layers):
    code, _, err = run(capsys, *GPT, "--num-layers", layers)
    assert code == cli.EXIT_BAD_INPUT
    assert "[model-sizes]" in err and f"--num-layers {layers} (1 to 10000)" in err and "math domain error [" not in err


def test_check_reports_the_plugins_rule_beside_megatrons_world_size_refusal(capsys):
    code, _, err = run(capsys, *GPT, *TE, "--cg-slot-capture", "--pipeline-model-parallel-size", "2")
    assert code == cli.EXIT_BAD_INPUT
    lines = err.splitlines()
    assert lines[0].startswith("megatron-cg check: [slot-capture-pipeline] ")
    assert lines[1].startswith("  [megatron] world size (1) is not divisible")
    assert lines[2:] == ["  (2 rules broken: see docs/troubleshooting.md)"]


@pytest.mark.parametrize("impl", ["none", "local"])
@pytest.mark.parametrize(
    "flags, named",
    [
        (["--cg-slot-capture"], "--cg-slot-capture"),
        (["--cg-slot-capture", "--cg-offload-copies", "between-replays"], "--cg-offload-copies between-replays"),
        (["--cg-graph-banks"], "--cg-graph-banks"),
        (["--cg-contract-check", "off"], "--cg-contract-check off"),
    ],
)
def test_check_refuses_graph_only_cg_flags_without_te_graphs(capsys, impl, flags, named):
    code, _, err = run(capsys, *GPT, "--cuda-graph-impl", impl, *flags)
    assert code == cli.EXIT_BAD_INPUT and len(err.splitlines()) == 2
    assert "[cg-flags-need-te-graphs]" in err and named in err and "--cuda-graph-impl transformer_engine" in err


def test_check_takes_cg_flags_that_work_without_graphs(capsys):
    code, _, err = run(capsys, *GPT, "--cg-moe-drop-stats", "--cg-no-report", "--cg-thd-max-seqs", "4")
    assert code == cli.EXIT_OK, err


def test_plan_checks_the_router_load_whatever_the_model(capsys):
    assert cli.main(["plan", *GPT, "--router-load", "zipf:abc"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--router-load zipf:abc" in err and "dense" in err and "drop --router-load" in err
    assert cli.main(["plan", *MOE, "--router-load", "zipf:abc"]) == cli.EXIT_BAD_INPUT  # dropless: still read
    assert "write zipf:S with S >= 0" in capsys.readouterr().err
    assert cli.main(["plan", *GPT]) == cli.EXIT_OK  # no load given: nothing to refuse


def test_golden_compare_names_the_metrics_the_file_has(capsys, files):
    expected, actual = files("expected.json", values()), files("actual.json", values())
    code, out, err = golden_cmd(capsys, "compare", expected, actual, "--metrics", "lm-loss")
    assert (code, out) == (cli.EXIT_BAD_INPUT, "") and len(err.splitlines()) == 1
    assert err.startswith("megatron-cg golden compare --metrics: unknown metric 'lm-loss' (did you mean 'lm loss'?)")
    assert "the expected file has 'lm loss', 'num-zeros'" in err and "tolerances={" not in err


# -- presets pass check as given --------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-moe"])
def test_a_preset_passes_check_as_given_with_graphs_on(capsys, preset):
    code, out, err = run(capsys, "--cg-preset", preset, *TE)
    assert code == cli.EXIT_OK, err
    if preset == "tiny-moe":
        assert "scope: attn+moe_router+moe_preprocess" in out


def test_tiny_moe_takes_the_whole_moe_block_with_drop_and_pad(capsys):
    code, out, err = run(capsys, *MOE, *TE, *DROP_PAD, "--cuda-graph-modules", "attn", "moe")
    assert code == cli.EXIT_OK, err
    assert "scope: attn+moe" in out


def test_hybrid_cp_is_refused_on_one_rank_and_passes_on_two(capsys):
    hybrid = ["--cg-preset", "tiny-gpt-hybrid-cp"]
    code, _, err = run(capsys, *hybrid)
    assert code == cli.EXIT_BAD_INPUT and "[hybrid-cp-ranks]" in err and "--nproc-per-node 2" in err
    assert "(DP x CP 1: 1 rank(s), TP 1, PP 1)" in err
    assert run(capsys, "--nproc", "2", *hybrid)[0] == cli.EXIT_OK
    assert run(capsys, "--nproc", "2", *hybrid, *TE, "--cg-graph-banks")[0] == cli.EXIT_OK


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_golden_update_writes_a_file_that_honours_the_umask(capsys, files, tmp_path, umask, mode):
    actual = files("actual.json", values())
    target = tmp_path / "golden_values_x.json"
    saved = os.umask(umask)
    try:
        assert golden_cmd(capsys, "update", actual, str(target))[0] == cli.EXIT_OK
    finally:
        os.umask(saved)
    assert target.stat().st_mode & 0o777 == mode
