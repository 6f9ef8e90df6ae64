"""The cause first: Megatron's import-time notes and its argument printout stay out of the way of the
line that says why a run stopped (megatron_cg_plugin.console), in the launcher, bench, run, the
datasets module and the farm."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from megatron_cg_plugin import cli, compat, console
from megatron_cg_plugin.farm.distributed import MultiRankError, RankFailure
from megatron_cg_plugin.farm.runner import CASES_DIR, FarmRunError

REPO = Path(__file__).resolve().parents[2]
# Refused on every host, before any GPU work: TE graphs do not take full recompute.
REFUSED = [
    "--cg-preset",
    "tiny-gpt",
    "--cuda-graph-impl",
    "transformer_engine",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
]


def run(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the printout's log lands here
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "entry", [["-m", "megatron_cg_plugin.pretrain_gpt"], ["-m", "megatron_cg_plugin.cli", "bench", "--bench-no-plot"]]
)
def test_a_refused_run_shows_its_cause_and_keeps_megatrons_printout_in_a_log(tmp_path, entry):
    result = run(*entry, *REFUSED, tmp_path=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""  # not the 850 lines of arguments
    lines = result.stderr.splitlines()
    assert len(lines) <= 4, result.stderr
    assert lines[0].startswith("megatron-cg-plugin: [full-recompute] --recompute-granularity full ")
    assert lines[1] == "  (1 rule broken: see docs/troubleshooting.md)"
    assert "Traceback" not in result.stderr and "Warning" not in result.stderr
    note = lines[-1]
    assert note.startswith("megatron-cg-plugin: Megatron's printout of the arguments and its warnings: ")
    log = Path(note.rsplit(" ", 1)[1])
    assert log.parent == tmp_path and "------------------------ arguments ------------------------" in log.read_text()


def test_the_launcher_names_the_plugins_rule_beside_megatrons_world_size_refusal(tmp_path):
    result = run(
        "-m",
        "megatron_cg_plugin.pretrain_gpt",
        "--cg-preset",
        "tiny-gpt",
        "--cuda-graph-impl",
        "transformer_engine",
        "--cg-slot-capture",
        "--pipeline-model-parallel-size",
        "2",
        tmp_path=tmp_path,
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) <= 5 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("megatron-cg-plugin: [slot-capture-pipeline] ")  # the cause first, then Megatron's
    assert lines[1].startswith("  [megatron] world size (1)")


def test_megatron_cg_run_and_the_datasets_module_print_no_megatron_import_notes(tmp_path):
    hello = tmp_path / "hello.py"
    hello.write_text("print('hello')\n")
    result = run("-m", "megatron_cg_plugin.cli", "run", str(hello), tmp_path=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "hello\n", "")
    result = run("-m", "megatron_cg_plugin.data.synthetic", str(tmp_path / "data"), tmp_path=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_a_refusal_in_training_is_the_commands_message_and_exit_code_2_without_a_traceback(tmp_path):
    """The memory guard's refusal comes from Megatron's loop: megatron-cg run prints it as its own message."""
    script = tmp_path / "train.py"
    script.write_text(
        "from megatron_cg_plugin.capture_lifecycle import CaptureWontFitError\n"
        "raise CaptureWontFitError('capture would not fit in memory\\n  --cuda-graph-modules attn  (0.41 GiB)')\n"
    )
    result = run("-m", "megatron_cg_plugin.cli", "run", str(script), tmp_path=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [
        "megatron-cg run: capture would not fit in memory",
        "  --cuda-graph-modules attn  (0.41 GiB)",
    ]


def test_only_optional_package_notes_are_hidden():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.hide_optional_package_warnings()
        for message in (
            "Apex is not installed. Falling back to Torch Norm",
            "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
            "Only transformer-engine>=1.7.0 supports MoE experts, but your version is 0.0.0.",
        ):
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module="megatron.core.x")
        warnings.warn_explicit(
            "--cuda-graph-modules 'full' is deprecated", UserWarning, "x.py", 1, module="megatron.training.arguments"
        )
        warnings.warn_explicit("Apex is not installed", UserWarning, "y.py", 1, module="my_script")
    assert [str(w.message) for w in caught] == ["--cuda-graph-modules 'full' is deprecated", "Apex is not installed"]


def test_a_nested_block_leaves_the_printout_to_the_outer_one(capsys, monkeypatch, tmp_path):
    """The launcher holds its own checks after Megatron's validation, which the validate-args hook holds too:
    one log, and the refusal the first line."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit), console.megatron_printout_held():
        with console.megatron_printout_held():
            print("------------------------ arguments ------------------------")
        print("megatron-cg-plugin: [rule] refused", file=sys.stderr)
        raise SystemExit(2)
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0] == "megatron-cg-plugin: [rule] refused"
    assert len(err.splitlines()) == 2 and len(list(tmp_path.iterdir())) == 1


def test_an_error_its_caller_reports_keeps_the_first_line_and_notes_the_log(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError) as info, console.megatron_printout_held():
        print("------------------------ arguments ------------------------")
        raise ValueError("--bench-arms x: no such arm")
    assert capsys.readouterr() == ("", "")  # the caller prints the error itself, first
    assert info.value.__notes__[0].startswith("megatron-cg-plugin: Megatron's printout of the arguments")


def test_megatrons_log_lines_are_held_too(capsys):
    """Megatron's training module logs its set-up through a handler on the stdout it found at import."""
    import logging

    handler = logging.StreamHandler(sys.stdout)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with pytest.raises(SystemExit), console.megatron_printout_held():
            root.warning("setting number of microbatches to constant 4")
            raise SystemExit(2)
    finally:
        root.removeHandler(handler)
    assert handler.stream is sys.stdout and "microbatches" not in capsys.readouterr().out


def test_the_printout_comes_out_as_usual_when_the_block_succeeds(capsys):
    with console.megatron_printout_held():
        print("------------------------ arguments ------------------------")
        print("why", file=sys.stderr)
    assert capsys.readouterr() == ("------------------------ arguments ------------------------\n", "why\n")


def test_the_cause_of_a_failed_rank():
    refusal = (
        "noise\nmegatron-cg-plugin: [full-recompute] use selective\n  [cpu-offloading] drop it\n"
        "  (2 rules broken: see docs/troubleshooting.md)\nmegatron-cg-plugin: Megatron's printout ...: /tmp/x.log\n"
    )
    assert console.failure_cause(refusal) == (
        "megatron-cg-plugin: [full-recompute] use selective\n  [cpu-offloading] drop it\n"
        "  (2 rules broken: see docs/troubleshooting.md)"
    )
    traceback = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: boom\n  warnings.warn(\n'
    assert console.failure_cause(traceback) == "ValueError: boom"
    assert (
        console.failure_cause("torch.OutOfMemoryError: CUDA out of memory")
        == "torch.OutOfMemoryError: CUDA out of memory"
    )
    assert console.failure_cause("killed\n") is None


def test_a_failed_farm_run_prints_its_cause_first_and_last(tmp_path):
    argv = ["-m", "megatron_cg_plugin.pretrain_gpt", *["--very-long-flag"] * 40]
    failures = [
        RankFailure(1, -15, "", "", terminated=True),
        RankFailure(0, 1, "a\nb\nTraceback (most recent call last):\nRuntimeError: CUDA error: bad\n", ""),
    ]
    error = FarmRunError(
        "graphed", tmp_path / "case.graphed.logs", MultiRankError(f"2 of 2 ranks failed running {argv}", failures)
    )
    assert error.cause == "the graphed run failed: rank 0 (exit code 1): RuntimeError: CUDA error: bad"
    lines = cli._run_failure(error).splitlines()
    assert lines[0] == lines[-1] == f"   FAIL: {error.cause}"
    assert f"   logs: {tmp_path / 'case.graphed.logs'}" in lines
    assert "--very-long-flag" not in "\n".join(lines)  # not the command line


@pytest.mark.skipif(compat.te_available(), reason="on a host with TE the case trains instead of failing")
def test_a_farm_on_a_host_without_a_gpu_says_so_first_and_starts_no_rank(tmp_path):
    result = run(
        "-m",
        "megatron_cg_plugin.cli",
        "farm",
        str(CASES_DIR / "gpt" / "tiny_gpt_layer"),
        "--out",
        str(tmp_path / "out"),
        tmp_path=tmp_path,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == (
        "megatron-cg farm: this host cannot run the cases: it needs 1 CUDA GPU(s), found 0; --dry-run checks "
        "their flags on CPU."
    )
    assert not list((tmp_path / "out").glob("*.logs"))  # no rank was started


def test_a_failing_block_prints_its_stderr_and_names_the_log(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit), console.megatron_printout_held():
        print("------------------------ arguments ------------------------")
        warnings.warn(
            "te_rng_tracker is not enabled", RuntimeWarning, stacklevel=1
        )  # UserWarning: ignored by pytest here
        print("megatron-cg-plugin: refused", file=sys.stderr)
        raise SystemExit(2)
    out, err = capsys.readouterr()
    assert out == ""
    cause, note = err.splitlines()
    assert cause == "megatron-cg-plugin: refused"
    log = Path(note.rsplit(" ", 1)[1])
    assert log.parent == tmp_path
    assert "arguments" in log.read_text() and "te_rng_tracker is not enabled" in log.read_text()
