"""Real multi-rank CPU (gloo) tests of megatron_cg_plugin.farm.distributed.launch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_cg_plugin.config import PLUGIN_FLAGS
from megatron_cg_plugin.farm.distributed import LaunchResult, MultiRankError, gpus_available, launch, require_gpus

SCRIPTS = Path(__file__).parent / "_rank_scripts"


def _live_pids_with(var: str, value: str) -> list[int]:
    """Live processes (zombies have an empty environ) carrying var=value."""
    needle = f"{var}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _check_allreduce(res: LaunchResult, nproc: int, tag: str) -> None:
    assert isinstance(res, LaunchResult)
    assert res.nproc == nproc
    assert sorted(res.stdout) == sorted(res.stderr) == list(range(nproc))
    total = nproc * (nproc + 1) // 2
    for rank in range(nproc):
        line = f"rank={rank} world={nproc} sum={total} NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=1 MCG_TEST_VAR={tag}"
        assert line in res.stdout[rank], res.stdout[rank]
    assert res.wall_s > 0


@pytest.mark.multirank
def test_two_ranks_allreduce_and_env(tmp_path):
    tag = uuid.uuid4().hex
    # The caller cannot turn NVLink multicast back on.
    res = launch(
        [str(SCRIPTS / "allreduce_rank.py")],
        nproc=2,
        log_dir=tmp_path,
        timeout_s=120,
        env={"MCG_TEST_VAR": tag, "NCCL_NVLS_ENABLE": "1"},
    )
    _check_allreduce(res, 2, tag)
    logs = sorted(p.relative_to(tmp_path).parts[-2:] for p in tmp_path.rglob("std*.log"))
    assert logs == [("0", "stderr.log"), ("0", "stdout.log"), ("1", "stderr.log"), ("1", "stdout.log")]


@pytest.mark.multirank
def test_module_form():
    tag = uuid.uuid4().hex
    pythonpath = os.pathsep.join(p for p in (str(SCRIPTS), os.environ.get("PYTHONPATH")) if p)
    res = launch(["-m", "allreduce_rank"], nproc=2, timeout_s=120, env={"MCG_TEST_VAR": tag, "PYTHONPATH": pythonpath})
    _check_allreduce(res, 2, tag)


@pytest.mark.multirank
def test_failing_rank_reports_traceback():
    with pytest.raises(MultiRankError) as info:
        launch([str(SCRIPTS / "failing_rank.py")], nproc=2, timeout_s=120)
    msg = str(info.value)
    assert "rank 1" in msg and "boom from rank 1" in msg
    assert "Traceback (most recent call last)" in msg and "fail_on_rank_one" in msg
    assert "ValueError" in msg
    # Rank 1 is the root cause; rank 0, torn down by the agent, is listed after it.
    assert [f.rank for f in info.value.failures if not f.terminated] == [1]
    assert {f.rank for f in info.value.failures} <= {0, 1}
    failure = info.value.failures[0]
    assert failure.rank == 1 and not failure.terminated
    assert failure.exitcode == 1 and "boom from rank 1" in failure.stderr_tail
    assert "rank 1 starting" in failure.stdout_tail
    assert not info.value.timed_out


@pytest.mark.multirank
def test_timeout_kills_every_rank():
    tag = uuid.uuid4().hex
    start = time.monotonic()
    with pytest.raises(MultiRankError, match="timed out after 5 s") as info:
        launch([str(SCRIPTS / "sleeping_rank.py"), "300"], nproc=2, timeout_s=5, env={"MCG_TEST_TIMEOUT": tag})
    assert info.value.timed_out
    assert time.monotonic() - start < 40
    assert _live_pids_with("MCG_TEST_TIMEOUT", tag) == []


def test_bad_arguments():
    with pytest.raises(ValueError):
        launch([], nproc=2)
    with pytest.raises(ValueError):
        launch(["-m"], nproc=2)
    with pytest.raises(ValueError):
        launch(["x.py"], nproc=0)


def test_gpu_helpers_on_any_machine():
    k = gpus_available()
    assert isinstance(k, int) and k >= 0
    mark = require_gpus(k + 1)
    assert mark.args == (True,)
    assert mark.kwargs["reason"] == f"needs {k + 1} CUDA GPUs, found {k}"
    assert require_gpus(0).args == (False,)


def test_gpu_stack_missing_names_what_is_missing(monkeypatch):
    from megatron_cg_plugin.farm import distributed

    monkeypatch.setattr(distributed, "gpus_available", lambda: 1)
    assert distributed.gpu_stack_missing(2) == "needs 2 CUDA GPU(s), found 1"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "Transformer Engine" in distributed.gpu_stack_missing(1)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert distributed.gpu_stack_missing(1) is None


def test_the_launchers_help_prints_the_plugins_flags_and_megatrons_without_a_traceback():
    """megatron-core 0.19.2's own --help raises (a bare '%' in one help string); the launcher's does not."""
    result = subprocess.run(
        [sys.executable, "-m", "megatron_cg_plugin.pretrain_gpt", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("usage: python -m megatron_cg_plugin.pretrain_gpt")
    assert all(flag.flag in result.stdout for flag in PLUGIN_FLAGS)
    assert "--moe-paged-stash-buffer-size-factor-cuda" in result.stdout and "--num-layers" in result.stdout
