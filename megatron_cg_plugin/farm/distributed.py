"""Launch N local ranks through ``torch.distributed.run`` for multi-rank tests.

``launch()`` starts a child Python (``python -m megatron_cg_plugin.farm.distributed``)
that drives torch.distributed.run programmatically, so elastic's signal handlers,
``os.environ`` edits and rendezvous state never touch the pytest process, and a
timeout can be enforced by killing that child and its ranks.

The child uses ``get_args_parser()`` + ``run(args)`` rather than building a
``LaunchConfig`` for ``elastic_launch`` directly: the parser is the torchrun CLI
surface, which stays stable, whereas ``LaunchConfig`` keeps growing fields
(numa options, signal lists, stdout filters, shutdown timeout...) across torch
releases. ``run`` still raises elastic's ``ChildFailedError``, whose
``failures`` map gives the failing global ranks and exit codes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RankFailure",
    "run_probe",
    "MultiRankError",
    "LaunchResult",
    "launch",
    "gpus_available",
    "gpu_name",
    "gpu_stack_missing",
    "require_gpus",
]

_MARKER = "MCG_LAUNCH_ID"  # set in every rank's env, so stray ranks can be found after a kill
_SHUTDOWN_S = 5  # elastic's SIGTERM -> SIGKILL grace for ranks
_TAIL_LINES = 60
_TAIL_CHARS = 6000


@dataclass(frozen=True)
class RankFailure:
    rank: int
    exitcode: int
    stderr_tail: str
    stdout_tail: str
    # True for ranks the agent killed (SIGTERM/SIGKILL) because another rank failed first.
    terminated: bool = False

    def __str__(self) -> str:
        how = "was terminated after another rank failed" if self.terminated else "failed"
        out = f"--- rank {self.rank} {how} (exit code {self.exitcode}) ---\n"
        out += f"[stderr tail]\n{self.stderr_tail.rstrip() or '<empty>'}\n"
        if self.stdout_tail.strip():
            out += f"[stdout tail]\n{self.stdout_tail.rstrip()}\n"
        return out


class MultiRankError(RuntimeError):
    """A rank failed, the launcher itself failed, or the launch timed out."""

    def __init__(self, message: str, failures: Sequence[RankFailure] = (), timed_out: bool = False):
        super().__init__(message)
        self.failures = tuple(failures)
        self.timed_out = timed_out


@dataclass(frozen=True)
class LaunchResult:
    nproc: int
    stdout: dict[int, str]  # rank -> that rank's whole stdout
    stderr: dict[int, str]
    wall_s: float


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-_TAIL_LINES:])[-_TAIL_CHARS:]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _free_port() -> int:
    # Small race between close and the agent's bind; acceptable for local tests.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_logs(log_dir: str, run_id: str, nproc: int) -> tuple[dict[int, str], dict[int, str]]:
    # DefaultLogsSpecs layout: <log_dir>/<run_id>_<rand>/attempt_0/<local_rank>/std{out,err}.log;
    # with one node the local rank is the global rank.
    runs = [d for d in os.listdir(log_dir) if d.startswith(f"{run_id}_")]
    base = os.path.join(log_dir, runs[0] if runs else "<missing>", "attempt_0")
    out = {r: _read(os.path.join(base, str(r), "stdout.log")) for r in range(nproc)}
    err = {r: _read(os.path.join(base, str(r), "stderr.log")) for r in range(nproc)}
    return out, err


def _marked_pids(launch_id: str) -> list[int]:
    """Live processes whose environment carries this launch's marker (Linux /proc)."""
    needle = f"{_MARKER}={launch_id}".encode()
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, zombie or not ours
            pass
    return pids


def _kill_all(proc: subprocess.Popen, launch_id: str) -> None:
    # SIGTERM first so elastic shuts its ranks down itself, then SIGKILL everything.
    for sig, wait_s in ((signal.SIGTERM, _SHUTDOWN_S + 5), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # Elastic starts each rank in its own session, so the child's process group
    # does not cover them: sweep by env marker until none is left.
    deadline = time.monotonic() + 10
    while (pids := _marked_pids(launch_id)) and time.monotonic() < deadline:
        for pid in pids:
            try:  # a rank leads its own group: take its helpers (e.g. data workers) too
                pgid = os.getpgid(pid)
                os.killpg(pgid, signal.SIGKILL) if pgid != os.getpgrp() else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _timed_out(
    argv: Sequence[str], nproc: int, timeout_s: float, root: str, launch_id: str, port: int, launcher_log: str
) -> MultiRankError:
    out, err = _rank_logs(root, launch_id, nproc)
    tails = "".join(
        f"--- rank {r} ---\n[stderr tail]\n{_tail(err[r])}\n[stdout tail]\n{_tail(out[r])}\n"
        for r in range(nproc)
        if out[r] or err[r]
    )
    tails = tails or f"no rank wrote output (rendezvous on 127.0.0.1:{port} never completed?)\n"
    return MultiRankError(
        f"multi-rank launch of {argv} timed out after {timeout_s:g} s (timeout); all {nproc} ranks "
        f"were killed. Output so far:\n{tails}--- launcher ---\n{_tail(_read(launcher_log))}\n",
        timed_out=True,
    )


def _ranks_failed(
    argv: Sequence[str], nproc: int, failed: dict[int, tuple[int, float]], out: dict[int, str], err: dict[int, str]
) -> MultiRankError:
    # Elastic also reports the siblings it tore down after the first failure;
    # list root causes (not killed by SIGTERM/SIGKILL, else the earliest) first.
    order = sorted(failed, key=lambda r: (failed[r][1], r))
    roots = [r for r in order if failed[r][0] not in (-signal.SIGTERM, -signal.SIGKILL)] or order[:1]
    failures = [
        RankFailure(r, failed[r][0], _tail(err.get(r, "")), _tail(out.get(r, "")), r not in roots)
        for r in roots + [r for r in order if r not in roots]
    ]
    names = ", ".join(f"rank {f.rank} (exit code {f.exitcode})" for f in failures if not f.terminated)
    killed = ", ".join(f"rank {f.rank} (exit code {f.exitcode})" for f in failures if f.terminated)
    msg = f"{len(roots)} of {nproc} ranks failed running {argv}: {names}"
    msg += f"; then terminated by the launcher: {killed}\n" if killed else "\n"
    return MultiRankError(msg + "".join(str(f) for f in failures if not f.terminated), failures=failures)


def launch(
    argv: Sequence[str],
    *,
    nproc: int,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600,
    log_dir: str | os.PathLike | None = None,
    master_port: int | None = None,
) -> LaunchResult:
    """Run ``python <argv>`` on ``nproc`` local ranks; raise MultiRankError on any failure."""
    argv = [str(a) for a in argv]
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise ValueError("argv must be ['-m', 'module', ...] or ['script.py', ...]")
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    tmp = None
    if log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="mcg_launch_")
        root = tmp.name
    else:
        root = os.fspath(log_dir)
    os.makedirs(root, exist_ok=True)
    launch_id = uuid.uuid4().hex
    spec: dict[str, Any] = {
        "argv": argv,
        "nproc": nproc,
        "port": master_port or _free_port(),
        "run_id": launch_id,
        "log_dir": root,
        "result": os.path.join(root, f"{launch_id}.json"),
    }
    # The ranks inherit the child's environment. NVLink multicast stays off whatever the caller passes:
    # the golden values are recorded without it, and NCCL's NVLS algorithms reduce in another order.
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), "NCCL_NVLS_ENABLE": "0", _MARKER: launch_id}
    # Let the child import this very checkout even when the package is not installed.
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, child_env.get("PYTHONPATH")) if p)
    launcher_log = os.path.join(root, f"{launch_id}.launcher.log")
    start = time.monotonic()
    try:
        with open(launcher_log, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "megatron_cg_plugin.farm.distributed", json.dumps(spec)],
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: killable as a whole
            )
        try:
            rc = proc.wait(timeout_s)
        except BaseException as exc:  # timeout, or Ctrl-C in pytest: never leave ranks behind
            _kill_all(proc, launch_id)
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            raise _timed_out(argv, nproc, timeout_s, root, launch_id, spec["port"], launcher_log) from None
        wall = time.monotonic() - start
        out, err = _rank_logs(root, launch_id, nproc)
        try:
            with open(spec["result"]) as f:
                failed = {int(r): tuple(v) for r, v in json.load(f)["failures"].items()}
        except (OSError, ValueError, KeyError):
            failed = None
        if rc == 0 and failed == {}:
            return LaunchResult(nproc=nproc, stdout=out, stderr=err, wall_s=wall)
        if not failed:  # the launcher itself broke (rendezvous, bad args...)
            raise MultiRankError(
                f"launcher for {argv} exited with code {rc} before reporting ranks:\n{_tail(_read(launcher_log))}"
            )
        raise _ranks_failed(argv, nproc, failed, out, err)
    finally:
        if tmp:
            tmp.cleanup()


def gpus_available() -> int:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - CPU-only build, missing driver, broken NVML
        return 0


def gpu_name() -> str | None:
    """The first CUDA GPU's name (``NVIDIA H100 80GB HBM3``), or None without one."""
    if not gpus_available():
        return None
    import torch

    return str(torch.cuda.get_device_name(0))


def gpu_stack_missing(n: int) -> str | None:
    """Why a GPU functional test cannot run here (too few GPUs, no Transformer Engine), or None."""
    import importlib.util

    found = gpus_available()
    if found < n:
        return f"needs {n} CUDA GPU(s), found {found}"
    if importlib.util.find_spec("transformer_engine") is None:
        return "needs Transformer Engine (pip install 'megatron-cg-plugin[te]')"
    return None


def run_probe(
    probe: os.PathLike[str] | str,
    out_dir: os.PathLike[str] | str,
    name: str,
    *,
    nproc: int = 1,
    args: Sequence[str] = (),
    timeout_s: float = 900,
) -> list[dict]:
    """Runs a GPU probe script on ``nproc`` ranks and returns the JSON result of each rank.

    Skips the calling test (with the reason) where the GPUs or TE are missing. The probe gets
    ``--out OUT_DIR/NAME.json``; on one rank it writes that file, on several ``NAME.rankN.json``.
    A result with ``probe_error`` fails the test with the probe's traceback."""
    from pathlib import Path

    import pytest  # lazily: the package must not depend on pytest

    reason = gpu_stack_missing(nproc)
    if reason:
        pytest.skip(reason)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.json"
    launch([str(probe), *args, "--out", str(out)], nproc=nproc, timeout_s=timeout_s, log_dir=out_dir / f"{name}.logs")
    paths = [out] if nproc == 1 else [out_dir / f"{name}.rank{rank}.json" for rank in range(nproc)]
    results = [json.loads(path.read_text()) for path in paths]
    for result in results:
        assert "probe_error" not in result, result["probe_error"]
    return results


def require_gpus(n: int):
    import pytest  # lazily: the package must not depend on pytest

    k = gpus_available()
    return pytest.mark.skipif(k < n, reason=f"needs {n} CUDA GPUs, found {k}")


def _main(spec_json: str) -> int:
    """Child side: drive torch.distributed.run and record which ranks failed."""
    from torch.distributed import run as tdrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    spec = json.loads(spec_json)
    parser = tdrun.get_args_parser()
    # --shutdown-timeout arrived after torch 2.11: pass it only where this torch knows it.
    known = {option for action in parser._actions for option in action.option_strings}
    shutdown = [f"--shutdown-timeout={_SHUTDOWN_S}"] if "--shutdown-timeout" in known else []
    args = parser.parse_args(
        [
            "--nnodes=1",
            f"--nproc-per-node={spec['nproc']}",
            "--max-restarts=0",
            # c10d rendezvous hosted by this agent on loopback = torchrun --standalone, but on our port.
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{spec['port']}",
            f"--rdzv-id={spec['run_id']}",
            "--local-addr=127.0.0.1",
            f"--log-dir={spec['log_dir']}",
            "--redirects=3",
            *shutdown,
            *spec["argv"],
        ]
    )
    failures: dict[int, tuple[int, float]] = {}
    try:
        tdrun.run(args)
    except ChildFailedError as e:
        failures = {int(r): (int(f.exitcode), float(f.timestamp)) for r, f in e.failures.items()}
    with open(spec["result"], "w") as f:
        json.dump({"failures": failures}, f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
