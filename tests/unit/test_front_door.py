"""Every subcommand's front door: bad input ends in one first line naming the flag to change, exit 2 and no
traceback, before any optional extra (matplotlib, a GPU, Megatron-LM's checkout) is asked for; anything else a
command raises is reported as the plugin's own bug, with its traceback and exit 3."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_cg_plugin import cli, console

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

SCRIPT = "tests/functional/_scripts/user_pretrain_gpt.py"  # exists; never runs in these tests


def refused_first(capsys, argv: list[str]) -> list[str]:
    """``megatron-cg ARGV`` as a user types it: exit code 2 (a parser's SystemExit counts), no traceback, and
    stderr's lines, whose first must name the cause (no usage block, heading or host complaint before it)."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse's exit, as the console script would see it
        code = stop.code
    out, err = capsys.readouterr()
    assert code == console.EXIT_BAD_INPUT, (code, out, err)
    assert "Traceback" not in err + out
    lines = err.splitlines()
    assert lines, out
    assert not lines[0].startswith("usage:") and "usage:" not in lines[0]
    return lines


@pytest.mark.parametrize(
    "argv, first",
    [
        (["run", SCRIPT, "--cg-preset", "tiny-gtp"], "megatron-cg run: --cg-preset 'tiny-gtp' is unknown"),
        (
            ["bench", "--bench-no-plot", "--cg-preset", "tiny-gtp"],
            "megatron-cg bench: --cg-preset 'tiny-gtp' is unknown",
        ),
        (
            ["bench", "--bench-arms-typo", "x", "--cg-preset", "tiny-gpt"],
            "megatron-cg bench: unknown bench flag --bench-arms-typo",
        ),
        (
            ["bench", "missing.py", "--cg-preset", "tiny-gpt"],
            "megatron-cg bench: the training script missing.py does not exist",
        ),
        (
            ["check", "--cg-preset", "tiny-gpt", "--num-attention-heads", "0"],
            "megatron-cg check: [model-sizes] a size is 0",
        ),
        (
            ["check", "--cg-preset", "tiny-gpt", "--num-layers", "99999999999999999999"],
            "--num-layers 99999999999999999999",
        ),
        (["check", "--cg-preset", "tiny-gpt", "--hidden-size", "0"], "--hidden-size 0"),
        (["check", "--cg-preset", "tiny-moe", "--moe-router-topk", "5"], "--moe-router-topk 5, --num-experts 4"),
        (["check", "--cg-preset", "tiny-gpt", "--tokenizer-type", "SentencePieceTokenizer"], "add --tokenizer-model"),
        (["plan", "--cg-preset", "tiny-gpt", "--num-attention-heads", "0"], "megatron-cg plan: [model-sizes]"),
        (
            ["check", "--cg-preset", "tiny-moe", "--cuda-graph-modules", "attn", "attn"],
            "--cuda-graph-modules attn attn",
        ),
        (["check", "--cg-preset", "tiny-gpt", "--cg-report-out", ""], "--cg-report-out is empty"),
        (["check", "--cg-preset", "tiny-gpt", "--cg-metrics-out", "README.md/m.json"], "lies under README.md"),
        # Megatron's refusals: "[megatron] <its message>" first, the batch sizes named by their flags.
        (
            ["check", "--nproc", "3", "--cg-preset", "tiny-gpt", "--tensor-model-parallel-size", "2"],
            "megatron-cg check: [megatron] world size (3) is not divisible",
        ),
        (
            ["check", "--cg-preset", "tiny-gpt", "--global-batch-size", "3", "--micro-batch-size", "2"],
            "megatron-cg check: [global-batch-size]",
        ),
        # Parse errors: the command and the flag first, Megatron's parser's included (not "pretrain_gpt").
        (["check", "--cg-preset", "tiny-gpt", "--cg-bogus", "3"], "megatron-cg check: error: unknown flag --cg-bogus"),
        (["plan", "--cg-preset", "tiny-gpt", "--cuda-graph-modules", "atn"], "megatron-cg plan: error: argument"),
        (["check", "--nproc", "x"], "megatron-cg check: error: argument --nproc: invalid int value: 'x'"),
        (["plan", "--router-load"], "megatron-cg plan: error: argument --router-load: expected one argument"),
        (["golden", "compare"], "megatron-cg golden compare: error: the following arguments are required"),
        (["golden", "bogus"], "megatron-cg golden: error: argument action: invalid choice: 'bogus'"),
        (["farm"], "megatron-cg farm: error: the following arguments are required: cases"),
        (["farm", "--steps", "x", "c"], "megatron-cg farm: error: argument --steps: invalid int value: 'x'"),
        (["matrix", "bogus"], "megatron-cg matrix: error: argument action: invalid choice: 'bogus'"),
        (["matrix", "run"], "megatron-cg matrix run: error: the following arguments are required: cells"),
        (["matrix", "bench", "c.json"], "megatron-cg matrix bench: error: the following arguments are required: --out"),
        (["run"], "megatron-cg run: error: the following arguments are required: script"),
        (["run", "--nproc-per-node", "x", SCRIPT], "megatron-cg run: error: argument --nproc-per-node"),
        (["run", SCRIPT, "--cg-preset", "tiny-gpt", "--cg-bogus"], "megatron-cg run: error: unknown flag --cg-bogus"),
        (["bench", "--bench-rounds", "x"], "megatron-cg bench: error: argument --bench-rounds: invalid int value"),
        # The runtime refusal (install()'s validate-args hook) in run and bench: the rule first, no GPU asked for.
        (["run", SCRIPT, "--cg-preset", "tiny-gpt", "--num-attention-heads", "0"], "megatron-cg-plugin: [model-sizes]"),
        (
            [
                "run",
                SCRIPT,
                "--cg-preset",
                "tiny-moe",
                "--cuda-graph-impl",
                "transformer_engine",
                "--cg-thd-max-seqlen",
                "5",
            ],
            "megatron-cg-plugin: [thd-max-seqlen-without-packed-graphs]",
        ),
        (
            [
                "bench",
                "--bench-no-plot",
                "--cg-preset",
                "tiny-gpt",
                "--global-batch-size",
                "3",
                "--micro-batch-size",
                "2",
            ],
            "megatron-cg-plugin: [global-batch-size]",
        ),
        # The bench's own checks of the flags, before the host (no GPU here, or no TE) is asked for.
        (
            [
                "bench",
                "--cg-preset",
                "tiny-gpt",
                "--cuda-graph-impl",
                "transformer_engine",
                "--cuda-graph-warmup-steps",
                "0",
            ],
            "megatron-cg bench: --cuda-graph-warmup-steps 0",
        ),
        # A farm case's own flags before the host's GPU; then the host, once a case's flags pass.
        (["farm", "{tmp}/cases/gpt/bad", "--out", "{tmp}/out"], "megatron-cg farm: bad: [model-sizes]"),
        (["farm", "tests/functional/test_cases/gpt/tiny_gpt_layer"], "needs 1 CUDA GPU(s), found 0"),
        (["matrix", "run", "benchmarks/support_matrix/cells.json", "--out", "{tmp}"], "MEGATRON_LM_DIR=(unset)"),
        (
            ["matrix", "run", "benchmarks/support_matrix/cells.json", "--only", "nope", "--out", "{tmp}"],
            "megatron-cg matrix: --only names cells not in",
        ),
    ],
)
def test_bad_input_is_named_first_in_one_refusal_without_a_traceback(capsys, monkeypatch, tmp_path, argv, first):
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    monkeypatch.setattr("megatron_cg_plugin.farm.distributed.gpus_available", lambda: 0)  # as on a CPU host
    monkeypatch.setattr("megatron_cg_plugin.host_stand_ins.gpu_missing", lambda: True)
    bad_case = tmp_path / "cases" / "gpt" / "bad"
    bad_case.mkdir(parents=True)
    (bad_case / "model_config.yaml").write_text(
        "ENV_VARS: {}\nMODEL_ARGS:\n  --cg-preset: tiny-gpt\n  --num-attention-heads: 0\nCG_FARM:\n  nproc: 1\n"
    )
    lines = refused_first(capsys, [arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    assert first in lines[0], lines
    assert len(lines) <= 4, lines  # the cause, the other rules, a pointer: a few lines, not a usage block
    assert "matplotlib" not in "\n".join(lines)  # an optional extra is never asked for before the input's own error


def test_several_broken_rules_the_first_first_then_one_a_line_then_a_pointer(capsys):
    lines = refused_first(
        capsys,
        [
            "check",
            "--cg-preset",
            "tiny-gpt",
            "--cuda-graph-impl",
            "transformer_engine",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--cg-graph-banks",
        ],
    )
    assert lines[0].startswith("megatron-cg check: [full-recompute] --recompute-granularity full ")
    assert lines[1].startswith("  [banks-need-hybrid-cp] --cg-graph-banks ")
    assert lines[2:] == ["  (2 rules broken: see docs/troubleshooting.md)"]


def test_a_farm_whose_every_case_is_refused_names_the_first_cause_on_stderr(capsys, tmp_path):
    case = tmp_path / "gpt" / "bad"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        "ENV_VARS: {}\nMODEL_ARGS:\n  --cg-preset: tiny-gpt\n  --num-attention-heads: 0\nCG_FARM:\n  nproc: 1\n"
    )
    lines = refused_first(capsys, ["farm", str(case), "--out", str(tmp_path / "out"), "--dry-run"])
    assert lines[0].startswith("megatron-cg farm: bad: [model-sizes] ") and "--num-attention-heads 0" in lines[0]


def test_a_refused_multi_rank_run_exits_2_and_its_cause_comes_first(monkeypatch, capsys):
    """torchrun reports a refusing rank's exit code 2 as a failure: the run says refused, exit 2."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from megatron_cg_plugin.launch import run_script

    def refuses(_args):
        print("megatron-cg-plugin: [model-sizes] ...", file=sys.stderr)
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file="")
        raise ChildFailedError("user_pretrain_gpt.py", {1: failure})

    monkeypatch.setattr(torchrun, "run", refuses)
    for name in ("OMP_NUM_THREADS", "NCCL_NVLS_ENABLE"):  # run sets them for its ranks: put back after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    lines = refused_first(capsys, ["run", "--nproc-per-node", "2", SCRIPT, "--cg-preset", "tiny-gpt"])
    assert lines[0] == "megatron-cg-plugin: [model-sizes] ..."
    assert lines[-1] == f"megatron-cg run: {SCRIPT} was refused on rank 1 (exit code 2); the cause is above."
    assert os.environ["OMP_NUM_THREADS"] == "1"  # torchrun's banner about it would come first
    assert run_script.EXIT_BAD_INPUT == console.EXIT_BAD_INPUT


@pytest.mark.parametrize(
    "name", ["NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "NCCL_GRAPH_REGISTER"]
)
def test_an_environment_switch_with_a_value_other_than_0_or_1_is_named(capsys, monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    assert cli.main(["check", "--cg-preset", "tiny-gpt"]) == console.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "[environment-switches]" in err and f"{name}=maybe" in err and "Traceback" not in err


def test_input_the_plugin_refuses_inside_a_command_is_one_line(monkeypatch, capsys):
    def refuses(argv):
        raise ValueError("--thing 3 is not a thing: give 2.")

    monkeypatch.setattr(cli, "_golden", refuses)
    assert cli.main(["golden", "compare", "a", "b"]) == console.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "megatron-cg golden: --thing 3 is not a thing: give 2.\n"


def test_anything_else_is_the_plugins_bug_with_its_traceback(monkeypatch, capsys):
    def breaks(argv):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_golden", breaks)
    assert cli.main(["golden", "compare", "a", "b"]) == console.EXIT_BUG
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err
    assert err.rstrip().endswith(
        "is a bug of megatron-cg-plugin, not of your input: please report it with the command line."
    )


@pytest.mark.parametrize(
    "preset, extra",
    [("tiny-gpt", []), ("tiny-moe", []), ("tiny-gpt-hybrid-cp", ["--nproc", "2", "--cg-graph-banks"])],
)
def test_each_preset_passes_check_on_the_ranks_and_flags_the_readme_names(capsys, preset, extra):
    """The README's presets line: what each preset needs beyond itself to pass check with graphs on."""
    nproc = extra[:2]
    code = cli.main(["check", *nproc, "--cg-preset", preset, "--cuda-graph-impl", "transformer_engine", *extra[2:]])
    assert code == console.EXIT_OK, capsys.readouterr().err
    assert f"`{preset}`" in README


def test_the_hybrid_cp_preset_alone_is_refused_on_one_rank_as_the_readme_says(capsys):
    code = cli.main(["check", "--cg-preset", "tiny-gpt-hybrid-cp", "--cuda-graph-impl", "transformer_engine"])
    assert code == console.EXIT_BAD_INPUT and "[hybrid-cp-ranks]" in capsys.readouterr().err
    assert "`tiny-gpt-hybrid-cp` needs 2 or more ranks" in README


def test_two_presets_get_a_note_naming_the_one_that_applies(capsys):
    assert cli.main(["check", "--cg-preset", "tiny-gpt", "--cg-preset=tiny-moe"]) == console.EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("flags OK") and out.rstrip().endswith(
        "note: --cg-preset is given 2 times (tiny-gpt, tiny-moe); only the last, tiny-moe, applies."
    )


def test_a_router_load_a_dropless_model_ignores_gets_a_note(capsys):
    assert cli.main(["plan", "--cg-preset", "tiny-moe", "--router-load", "zipf:1.2"]) == console.EXIT_OK
    assert "note: --router-load zipf:1.2 is not used: a dropless router drops no token" in capsys.readouterr().out


def test_tensorboard_logging_without_a_tensorboard_dir_is_refused_from_the_flags(capsys):
    """The rule reads the flag as parsed: it once read a setting the flags never reached, and never fired."""
    assert cli.main(["check", "--cg-preset", "tiny-gpt", "--cg-log-to-tensorboard"]) == console.EXIT_BAD_INPUT
    assert "[tensorboard-needs-dir]" in capsys.readouterr().err
    assert cli.main(["check", "--cg-preset", "tiny-gpt", "--cg-log-to-tensorboard", "--tensorboard-dir", "tb"]) == 0


def test_the_launcher_names_a_misspelt_preset_without_a_traceback(capsys):
    from megatron_cg_plugin.launch import pretrain_gpt

    assert pretrain_gpt.main(["--cg-preset", "tiny-gtp"]) == console.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert (
        err.startswith("megatron_cg_plugin.pretrain_gpt: --cg-preset 'tiny-gtp' is unknown") and "Traceback" not in err
    )


def test_a_size_that_does_not_split_over_tp_is_named_before_megatrons_environment_assertion(capsys, monkeypatch):
    """validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for TP > 1 before it looks at the sizes: the sizes are
    the flags' own mistake, named first whatever the shell that runs check exports."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    argv = ["check", "--nproc", "3", "--cg-preset", "tiny-gpt", "--tensor-model-parallel-size", "3"]
    lines = refused_first(capsys, argv)
    assert lines[0].startswith("megatron-cg check: [tensor-parallel-split]")
    assert "--num-attention-heads 4 over --tensor-model-parallel-size 3" in lines[0]
