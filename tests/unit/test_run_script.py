"""Tests for ``megatron-cg run`` (megatron_cg_plugin.launch.run_script): a script runs as
``python SCRIPT ARGS`` would run it, with the plugin installed; one process in-process, several
through ``torch.distributed.run`` (gloo on CPU here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from megatron_cg_plugin import cli, installation
from megatron_cg_plugin.launch import run_script
from megatron_cg_plugin.launch.rendezvous import RENDEZVOUS_VARS

REPO = Path(__file__).resolve().parents[2]

RECORDER = textwrap.dedent("""\
    import json, os, sys

    import {sibling}
    from megatron_cg_plugin import installation

    out = sys.argv[sys.argv.index("--out") + 1]
    record = {{
        "name": __name__,
        "argv": list(sys.argv),
        "path0": sys.path[0],
        "sibling": {sibling}.VALUE,
        "installed": installation.active_session() is not None,
        "env": {{key: os.environ.get(key) for key in
                ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "NCCL_NVLS_ENABLE")}},
    }}
    if int(os.environ["WORLD_SIZE"]) > 1:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            value = torch.tensor([int(os.environ["RANK"]) + 1])
            dist.all_reduce(value)
            record["sum"] = value.item()
            record["dist_world"] = dist.get_world_size()
        finally:
            dist.destroy_process_group()
    with open(f"{{out}}.{{os.environ['RANK']}}.json", "w") as handle:
        json.dump(record, handle)
    if "--exit" in sys.argv:
        raise SystemExit(int(sys.argv[sys.argv.index("--exit") + 1]))
""")


@pytest.fixture(autouse=True)
def clean_process(monkeypatch):
    for key in (*RENDEZVOUS_VARS, "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(key, raising=False)
    installation.uninstall()
    yield
    installation.uninstall()


@pytest.fixture
def recorder(tmp_path) -> Path:
    """The recording script, and a sibling module (uniquely named) that only its folder provides."""
    sibling = f"cg_sibling_{uuid.uuid4().hex}"
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / f"{sibling}.py").write_text(f"VALUE = {sibling!r}\n")
    script = folder / "record.py"
    script.write_text(RECORDER.format(sibling=sibling))
    yield script
    sys.modules.pop(sibling, None)


def load(out: Path, rank: int = 0) -> dict:
    return json.loads(Path(f"{out}.{rank}.json").read_text())


# -- one process, in this process ------------------------------------------------------------------


def test_in_process_runs_the_script_as_main_with_the_plugin(recorder, tmp_path):
    out = tmp_path / "record"
    argv_before, path_before = list(sys.argv), list(sys.path)
    code = run_script.main([str(recorder), "--out", str(out), "--num-layers", "2"])
    assert code == 0
    record = load(out)
    assert record["name"] == "__main__"
    assert record["argv"] == [str(recorder), "--out", str(out), "--num-layers", "2"]
    assert record["path0"] == str(recorder.parent.resolve())
    assert record["sibling"].startswith("cg_sibling_")  # imported from the script's folder
    assert record["installed"] is True
    env = record["env"]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "0", "1", "1")
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert "sum" not in record  # one rank: no collective
    # Afterwards: nothing left behind.
    assert installation.active_session() is None
    assert all(key not in os.environ for key in RENDEZVOUS_VARS)
    assert sys.argv == argv_before and sys.path == path_before


def test_in_process_keeps_rendezvous_values_a_launcher_set(recorder, tmp_path, monkeypatch):
    out = tmp_path / "record"
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "launcher-host")
    assert run_script.main([str(recorder), "--out", str(out)]) == 0
    env = load(out)["env"]
    assert env["MASTER_ADDR"] == "launcher-host"  # not overwritten
    assert env["MASTER_PORT"] is None  # WORLD_SIZE set: the launcher owns the rendezvous
    assert os.environ["MASTER_ADDR"] == "launcher-host"


@pytest.mark.parametrize("exit_with, expected", [("3", 3), ("0", 0)])
def test_in_process_returns_the_scripts_exit_code(recorder, tmp_path, exit_with, expected):
    out = tmp_path / "record"
    assert run_script.main([str(recorder), "--out", str(out), "--exit", exit_with]) == expected
    assert load(out)["installed"] is True  # it ran to its exit
    assert installation.active_session() is None
    assert all(key not in os.environ for key in RENDEZVOUS_VARS)


def test_in_process_exit_with_a_message_prints_it_and_returns_1(tmp_path, capsys):
    script = tmp_path / "bye.py"
    script.write_text("raise SystemExit('cannot train: no data')\n")
    assert run_script.main([str(script)]) == 1
    assert "cannot train: no data" in capsys.readouterr().err


def test_in_process_exception_propagates_and_uninstalls(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise ValueError('boom from the script')\n")
    with pytest.raises(ValueError, match="boom from the script"):
        run_script.main([str(script)])
    assert installation.active_session() is None
    assert all(key not in os.environ for key in RENDEZVOUS_VARS)


def test_cli_run_dispatches_to_run_script(recorder, tmp_path):
    out = tmp_path / "record"
    assert cli.main(["run", str(recorder), "--out", str(out), "--exit", "5"]) == 5
    assert load(out)["name"] == "__main__"


MEGATRON_SCRIPT = textwrap.dedent("""\
    import json, sys

    from megatron.training.arguments import parse_args

    args = parse_args()  # no extra_args_provider: the plugin's --cg-* flags come from install()
    with open({out!r}, "w") as handle:
        json.dump({{"cg_no_report": args.cg_no_report, "contract": args.cg_contract_check,
                   "num_layers": args.num_layers}}, handle)
""")


def test_megatron_script_accepts_cg_flags_under_run(tmp_path):
    out = tmp_path / "args.json"
    script = tmp_path / "pretrain_like.py"
    script.write_text(MEGATRON_SCRIPT.format(out=str(out)))
    code = run_script.main(
        [
            str(script),
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--micro-batch-size",
            "1",
            "--cg-no-report",
            "--cg-contract-check",
            "off",
        ]
    )
    assert code == 0
    assert json.loads(out.read_text()) == {"cg_no_report": True, "contract": "off", "num_layers": 2}


def test_megatron_script_without_run_rejects_cg_flags(tmp_path, capsys):
    """The same script run without the plugin: Megatron's parser has no --cg-* flags."""
    out = tmp_path / "args.json"
    script = tmp_path / "pretrain_like.py"
    script.write_text(MEGATRON_SCRIPT.format(out=str(out)))
    saved = sys.argv
    sys.argv = [
        str(script),
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--micro-batch-size",
        "1",
        "--cg-no-report",
    ]
    try:
        import runpy

        with pytest.raises(SystemExit) as info:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    assert info.value.code == 2
    assert "--cg-no-report" in capsys.readouterr().err
    assert not out.exists()


# -- bad input -------------------------------------------------------------------------------------


def test_missing_script_is_bad_input_naming_it(tmp_path, capsys):
    missing = tmp_path / "no_such_script.py"
    assert run_script.main([str(missing), "--out", "x"]) == run_script.EXIT_BAD_INPUT == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err
    assert installation.active_session() is None


def test_directory_is_not_a_script(tmp_path, capsys):
    assert run_script.main([str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("nproc", ["0", "-2"])
def test_bad_nproc_is_bad_input(recorder, tmp_path, capsys, nproc):
    out = tmp_path / "record"
    assert run_script.main(["--nproc-per-node", nproc, str(recorder), "--out", str(out)]) == 2
    assert "--nproc-per-node must be >= 1" in capsys.readouterr().err
    assert not Path(f"{out}.0.json").exists()  # the script never ran


def test_flags_after_the_script_are_the_scripts():
    options = run_script.parser().parse_args(["s.py", "--nproc-per-node", "4", "-h"])
    assert options.nproc_per_node == 1
    assert options.script == "s.py" and options.args == ["--nproc-per-node", "4", "-h"]


# -- several ranks ---------------------------------------------------------------------------------


@pytest.mark.multirank
def test_two_ranks_through_the_cli(recorder, tmp_path):
    out = tmp_path / "record"
    env = {key: value for key, value in os.environ.items() if key not in (*RENDEZVOUS_VARS, "NCCL_NVLS_ENABLE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env["TMPDIR"] = str(tmp_path)  # torch.distributed.run's torchelastic_* log folder lands here, not in /tmp
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_cg_plugin.cli",
            "run",
            "--nproc-per-node",
            "2",
            str(recorder),
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = [load(out, rank) for rank in (0, 1)]
    for rank, record in enumerate(records):
        assert record["name"] == "__main__"
        assert record["argv"] == [str(recorder), "--out", str(out)]
        assert record["path0"] == str(recorder.parent.resolve())
        assert record["installed"] is True, rank
        assert record["env"]["RANK"] == record["env"]["LOCAL_RANK"] == str(rank)
        assert record["env"]["WORLD_SIZE"] == "2"
        assert record["env"]["NCCL_NVLS_ENABLE"] == "0"
        assert record["dist_world"] == 2
        assert record["sum"] == 3  # 1 + 2 over gloo
    assert records[0]["env"]["MASTER_PORT"] == records[1]["env"]["MASTER_PORT"]
    assert list(tmp_path.glob("torchelastic_*"))  # torchrun's log folder went to TMPDIR (tmp_path), not /tmp


@pytest.mark.multirank
def test_a_failing_rank_fails_the_run(tmp_path):
    script = tmp_path / "fail_on_one.py"
    script.write_text("import os, sys\nsys.exit(7 if os.environ['RANK'] == '1' else 0)\n")
    env = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env["TMPDIR"] = str(tmp_path)  # as above
    result = subprocess.run(
        [sys.executable, "-m", "megatron_cg_plugin.cli", "run", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1
    assert "rank 1 (exit code 7)" in result.stderr


def test_an_unsupported_stack_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from megatron_cg_plugin import compat

    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('the script must not run')\n")

    def refuse(*_args, **_kwargs):
        raise compat.UnsupportedVersionError("megatron-core 0.18.0 is not supported: install megatron-core>=0.19.2")

    monkeypatch.setattr(compat, "check_versions", refuse)
    assert run_script.main([str(script)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "megatron-cg run: megatron-core 0.18.0 is not supported: install megatron-core>=0.19.2"
