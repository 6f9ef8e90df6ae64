"""Every subcommand's front door: bad input ends in one first line naming the flag to change, exit 2 and no
traceback, before any optional extra (matplotlib, a GPU, Megatron-LM's checkout) is asked for; anything else a
command raises is reported as the plugin's own bug, with its traceback and exit 3."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_cg_plugin import cli, console

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

SCRIPT = "tests/functional/_scripts/user_pretrain_gpt.py"  # exists; never runs in these tests


@pytest.mark.parametrize(
    "argv, named",
    [
        (["run", SCRIPT, "--cg-preset", "tiny-gtp"], "--cg-preset 'tiny-gtp' is unknown"),
        (["bench", "--bench-no-plot", "--cg-preset", "tiny-gtp"], "--cg-preset 'tiny-gtp' is unknown"),
        (["bench", "--bench-arms-typo", "x", "--cg-preset", "tiny-gpt"], "unknown bench flag --bench-arms-typo"),
        (["bench", "missing.py", "--cg-preset", "tiny-gpt"], "no such script missing.py"),
        (["check", "--cg-preset", "tiny-gpt", "--num-attention-heads", "0"], "--num-attention-heads 0 (1 to 65536)"),
        (
            ["check", "--cg-preset", "tiny-gpt", "--num-layers", "99999999999999999999"],
            "--num-layers 99999999999999999999",
        ),
        (["check", "--cg-preset", "tiny-gpt", "--hidden-size", "0"], "--hidden-size 0"),
        (["check", "--cg-preset", "tiny-moe", "--moe-router-topk", "5"], "--moe-router-topk 5, --num-experts 4"),
        (["check", "--cg-preset", "tiny-gpt", "--tokenizer-type", "SentencePieceTokenizer"], "add --tokenizer-model"),
        (["plan", "--cg-preset", "tiny-gpt", "--num-attention-heads", "0"], "--num-attention-heads 0"),
        (
            ["check", "--cg-preset", "tiny-moe", "--cuda-graph-modules", "attn", "attn"],
            "--cuda-graph-modules attn attn",
        ),
        (["check", "--cg-preset", "tiny-gpt", "--cg-report-out", ""], "--cg-report-out is empty"),
        (["check", "--cg-preset", "tiny-gpt", "--cg-metrics-out", "README.md/m.json"], "lies under README.md"),
        # What a command's work needs of the host is said once, first, before any rank or cell starts.
        (["farm", "tests/functional/test_cases/gpt/tiny_gpt_layer"], "needs 1 CUDA GPU(s), found 0"),
        (["matrix", "run", "benchmarks/support_matrix/cells.json", "--out", "{tmp}"], "MEGATRON_LM_DIR=(unset)"),
    ],
)
def test_bad_input_is_named_first_in_one_refusal_without_a_traceback(capsys, monkeypatch, tmp_path, argv, named):
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    monkeypatch.setattr("megatron_cg_plugin.farm.distributed.gpus_available", lambda: 0)  # as on a CPU host
    code = cli.main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    out, err = capsys.readouterr()
    assert code == console.EXIT_BAD_INPUT, (out, err)
    assert named in err and "Traceback" not in err + out
    assert "matplotlib" not in err  # an optional extra is never asked for before the input's own error


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
