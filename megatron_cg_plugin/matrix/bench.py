"""``megatron-cg matrix bench``: each support-matrix cell's step time with the plugin's graphs over
Megatron's own, measured by ``megatron-cg bench`` through Megatron-LM's ``pretrain_gpt.py`` on the
cell's flags, one process per cell, merged into one JSON that ``matrix render`` sets beside the
correctness runs (the table's "plugin / stock" column).

    megatron-cg matrix bench CELLS.json --out DIR [--only NAME ...] [--parallel N] [--timeout-s S]
                             [-- --bench-rounds R --bench-steps S ...]

The bench's arms are the cell's own capture (``_PLUGIN_ARMS``) and ``stock``, Megatron's
``TECudaGraphHelper`` on the same flags (with Megatron's own offload in a slot-offload cell). A cell
the rules refuse is not launched; nor is one whose stock arm they refuse (the cell's flags without
the plugin's graph-only ``--cg-*`` flags, checked on CPU as ``megatron-cg check`` would), recorded
with that rule. Each bench is one rank with its own rendezvous port (``farm.ports``) and its own
copy of the farm's synthetic indexed dataset, so ``--parallel`` benches side by side share only the
GPU; their figures are then shared-GPU ones, which the rendered table says. The flags after ``--``
go to every ``megatron-cg bench`` as given (its ``--bench-*`` options). The benches train without
``--deterministic-mode``, as a run that is after speed would.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_cg_plugin.bench.command import BenchError, parse_bench_argv
from megatron_cg_plugin.console import EXIT_BAD_INPUT, EXIT_MISMATCH, EXIT_OK
from megatron_cg_plugin.farm.ports import PortAllocator
from megatron_cg_plugin.farm.runner import REPO, data_flags, megatron_lm_dir_from_environment, without_graph_only_flags
from megatron_cg_plugin.inputs import positive, require_output_folder
from megatron_cg_plugin.launch.rendezvous import single_process_values
from megatron_cg_plugin.matrix.runner import Cell, cell_env, cell_flags, farm_case, load_cells, refusal_of, select_cells
from megatron_cg_plugin.parse_errors import OneLineErrors

__all__ = [
    "BenchProcesses",
    "RESULTS_FILE",
    "STOPPED",
    "TIMED_OUT",
    "bench_launch",
    "check_bench_flags",
    "main",
    "run_benches",
]

# The bench arm that captures as the cell's graphed run does. The cell's flags keep --cg-slot-capture, so
# the bench's session has the run's config; ``slot`` is slot-shared capture offloading nothing (the cell
# offloads nothing), ``slot-offload`` follows Megatron's offload flags with in-graph copies and the run's
# --cg-offload-window, what the run's helper does with the default --cg-offload-copies.
_PLUGIN_ARMS = {"te": "plugin", "slot": "slot", "slot-offload": "slot-offload"}
_STOCK_ARM = "stock"
RESULTS_FILE = "matrix-bench.json"
_OWN_BENCH_OPTIONS = ("--bench-arms", "--bench-out")  # set per cell here
_USAGE = (
    "megatron-cg matrix bench CELLS.json --out DIR [--only NAME ...] [--parallel N] [--timeout-s S] "
    "[-- --bench-rounds R --bench-steps S ...]"
)
TIMED_OUT = 124  # as timeout(1) says it
STOPPED = -int(signal.SIGTERM)  # not started: the driver was stopped
_LOG_TAIL = 1500


def _plugin_arm(cell: Mapping[str, str]) -> str:
    return _PLUGIN_ARMS[cell["capture"]]


def _stock_flags(cell: Mapping[str, str]) -> tuple[str, ...]:
    """What the stock arm's graphs capture with: the cell's flags less the plugin's graph-only ones."""
    return without_graph_only_flags(cell_flags(cell))


def check_bench_flags(flags: Sequence[str], *, out_dir: Path = Path(".")) -> None:
    """The flags after ``--`` are ``megatron-cg bench``'s own options, placed before the script, read by
    its own parser here as each cell's bench will read them (with the arms and the output folder this
    command sets), so that a typo or a bad value stops the matrix before any cell starts."""
    if any(flag.startswith("--") and not flag.startswith("--bench-") for flag in flags) or (
        flags and not flags[0].startswith("--bench-")
    ):
        raise ValueError(
            f"after -- come megatron-cg bench's own --bench-* options (e.g. -- --bench-rounds 4 "
            f"--bench-steps 8), not {' '.join(flags)}: each cell's flags are the matrix's."
        )
    if any(flag.split("=", 1)[0] == "--bench-interleave" for flag in flags):
        raise ValueError(
            "--bench-interleave: matrix bench reads the block schedule's rounds and ratios (and most "
            "cells are slot or FP8 captures, which the step schedule refuses); drop it."
        )
    own = [flag for flag in flags if flag.split("=", 1)[0] in _OWN_BENCH_OPTIONS]
    if own:
        raise ValueError(
            f"{own[0]}: matrix bench sets it per cell (the arms: the cell's capture and stock; "
            "the output: DIR/<cell>); drop it."
        )
    try:
        parse_bench_argv(["--bench-arms", f"{_PLUGIN_ARMS['te']},{_STOCK_ARM}", "--bench-out", str(out_dir), *flags])
    except BenchError as error:
        raise ValueError(f"the flags after --: {error}") from None


@dataclass(frozen=True)
class _BenchLaunch:
    """One cell's ``megatron-cg bench``: ``python argv`` in ``env``, writing into ``folder``."""

    cell: Cell
    argv: tuple[str, ...]
    env: Mapping[str, str]
    folder: Path
    port: int

    @property
    def arms(self) -> tuple[str, str]:
        return _plugin_arm(self.cell.factors), _STOCK_ARM

    @property
    def log(self) -> Path:
        return self.folder / "bench.log"

    @property
    def result(self) -> Path:
        return self.folder / "bench.json"  # megatron-cg bench's, in its --bench-out


def bench_launch(
    cell: Cell, out_dir: Path, *, script: Path, bench_flags: Sequence[str], port: int, environ: Mapping[str, str]
) -> _BenchLaunch:
    """The cell's bench command and environment; builds its dataset under ``out_dir/<cell>``."""
    folder = out_dir / cell.name
    argv = (
        "-m",
        "megatron_cg_plugin.cli",
        "bench",
        "--bench-arms",
        ",".join((_plugin_arm(cell.factors), _STOCK_ARM)),
        "--bench-out",
        str(folder),
        "--bench-no-plot",
        *bench_flags,
        str(script),
        *cell_flags(cell.factors),
        *data_flags("synthetic", folder),
        "--cuda-graph-impl",
        "transformer_engine",
    )
    env = {
        **environ,
        "OMP_NUM_THREADS": "1",
        **cell_env(cell.factors),
        **single_process_values({}, port=port),
        "NCCL_NVLS_ENABLE": "0",  # as in the matrix's correctness runs (farm.distributed): one NCCL algorithm set
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), environ.get("PYTHONPATH")) if p),
    }
    return _BenchLaunch(cell, argv, env, folder, port)


class BenchProcesses:
    """Runs benches as ``python argv`` (a ``_Launcher``), each leading its own process group, and
    keeps the running ones, so a driver that is stopped (Ctrl-C, timeout(1)'s SIGTERM, which would
    not reach another group) stops them too, and none starts after."""

    def __init__(self) -> None:
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopped = False

    def __call__(self, argv: Sequence[str], env: Mapping[str, str], log: Path, timeout_s: float) -> int:
        """The bench's exit code, its output in ``log``; ``TIMED_OUT`` (its group killed) past ``timeout_s``."""
        with log.open("w") as out, self._lock:
            if self._stopped:
                return STOPPED
            proc = subprocess.Popen(
                [sys.executable, *argv],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._running.add(proc)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return TIMED_OUT
        finally:
            with self._lock:
                self._running.discard(proc)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            running = list(self._running)
        for proc in running:
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, grace_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(grace_s)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-_LOG_TAIL:]
    except OSError:
        return ""


def _bench_row(launch: _BenchLaunch, returncode: int, *, parallel: int) -> dict[str, Any]:
    """The cell's row from its bench's exit code and ``bench.json``: the plugin / stock ratio's
    median, spread and pairs of rounds, its 95% half-width, and the settings it ran with."""
    arm, stock = launch.arms
    row: dict[str, Any] = {
        "name": launch.cell.name,
        "factors": launch.cell.factors,
        "arms": [arm, stock],
        "port": launch.port,
        "parallel": parallel,
        "log": str(launch.log),
    }
    key = f"{arm}/{stock}"
    data = json.loads(launch.result.read_text()) if not returncode and launch.result.exists() else None
    problem = (
        "megatron-cg bench timed out"
        if returncode == TIMED_OUT
        else f"megatron-cg bench exited with code {returncode}"
        if returncode
        else "megatron-cg bench wrote no bench.json"
        if data is None
        else None
        if key in data["ratios"]
        else f"bench.json has no {key} ratio (it has: {', '.join(data['ratios'])})"
    )
    if problem is not None:
        return {**row, "result": "failed", "problem": problem, "log_tail": _tail(launch.log)}
    assert data is not None
    return {
        **row,
        "result": "benched",
        "ratio": data["ratios"][key],
        "ratio_half_width": data.get("ratio_precision", {}).get(key, {}).get("half_width"),
        "rounds": 1 + max(block["round"] for block in data["blocks"]),
        "steps_per_block": data["steps_per_block"],
        "skip_steps": data["skip_steps"],
        "step_ms": {name: 1e3 * data["step_seconds"][name]["median"] for name in (arm, stock)},
    }


_Launcher = Callable[[Sequence[str], Mapping[str, str], Path, float], int]


def run_benches(
    cells: Sequence[Cell],
    out_dir: Path,
    *,
    megatron_lm_dir: str | None,
    bench_flags: Sequence[str] = (),
    parallel: int = 1,
    timeout_s: float = 600,
    launcher: _Launcher | None = None,
    ports: Callable[[], int] | None = None,
    environ: Mapping[str, str] | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Benches every cell that can run (``parallel`` at a time) and writes ``out_dir/RESULTS_FILE``
    as rows finish: a row per cell, ``benched``, ``failed``, ``refused`` or ``stock-refused``."""
    require_output_folder("--out", out_dir)
    check_bench_flags(bench_flags, out_dir=out_dir)
    if parallel < 1:
        raise ValueError(f"--parallel {parallel}: give the number of benches side by side on the GPU, >= 1.")
    positive("--timeout-s", timeout_s, "seconds a bench may run")
    out_dir.mkdir(parents=True, exist_ok=True)
    ports = PortAllocator() if ports is None else ports
    environ = dict(os.environ) if environ is None else environ
    rows: dict[str, dict[str, Any]] = {}

    def record(row: dict[str, Any]) -> None:
        rows[row["name"]] = row
        progress(_progress_line(row))
        (out_dir / RESULTS_FILE).write_text(
            json.dumps(
                {
                    "bench": {"parallel": parallel, "flags": list(bench_flags)},
                    "rows": [rows[c.name] for c in cells if c.name in rows],
                },
                indent=1,
            )
        )

    # The rules' checks and the datasets first, one cell after another (the checks set process state).
    launches = []
    for cell in cells:
        row = {"name": cell.name, "factors": cell.factors}
        if cell.refused_by:
            record({**row, "result": "refused", "refused_by": list(cell.refused_by)})
            continue
        flags = _stock_flags(cell.factors)
        # A TE-graphs cell's flags are the stock arm's, and matrix plan checked them.
        refused_by, refusal = (
            ((), "")
            if list(flags) == cell_flags(cell.factors)
            else refusal_of(cell.factors, out_dir / cell.name, flags=flags)
        )
        if refused_by:
            record({**row, "result": "stock-refused", "stock_refused_by": list(refused_by), "stock_refusal": refusal})
            continue
        case = farm_case(cell, megatron_lm_dir=megatron_lm_dir)
        unmet = case.unmet()  # no Megatron-LM checkout: nothing launches
        if unmet:
            raise ValueError(unmet)
        script = case.script_file
        assert script is not None  # farm_case runs Megatron-LM's pretrain_gpt.py
        launches.append(
            bench_launch(cell, out_dir, script=script, bench_flags=bench_flags, port=ports(), environ=environ)
        )
    for launch in launches:
        launch.result.unlink(missing_ok=True)  # a former run's figures are not this one's
    launcher = BenchProcesses() if launcher is None else launcher
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallel)
    try:
        futures = {pool.submit(launcher, launch.argv, launch.env, launch.log, timeout_s): launch for launch in launches}
        for future in concurrent.futures.as_completed(futures):
            record(_bench_row(futures[future], future.result(), parallel=parallel))
    except BaseException:  # stopped (Ctrl-C, SIGTERM): no bench outlives the driver, none starts after
        pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(launcher, BenchProcesses):
            launcher.stop()
        raise
    finally:
        pool.shutdown(wait=True)
    return [rows[cell.name] for cell in cells]


def _progress_line(row: Mapping[str, Any]) -> str:
    if row["result"] == "benched":
        ratio = row["ratio"]
        return (
            f"{row['name']}: {'/'.join(row['arms'])} {ratio['median']:.3f} [{ratio['low']:.3f}, "
            f"{ratio['high']:.3f}] (n={ratio['n']})"
        )
    detail = {
        "refused": row.get("refused_by"),
        "stock-refused": row.get("stock_refused_by"),
        "failed": row.get("problem"),
    }[row["result"]]
    return f"{row['name']}: {row['result']} {detail}"


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str]) -> int:
    """``megatron-cg matrix bench``; what follows ``--`` goes to every ``megatron-cg bench``."""
    argv = list(argv)
    own, bench_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = OneLineErrors(
        prog="megatron-cg matrix bench",
        usage=_USAGE,
        epilog="The flags after -- go to every megatron-cg bench "
        "(megatron-cg bench --help lists them): e.g. -- --bench-rounds 4 --bench-steps 8.",
        description="Each cell's step time with the plugin's graphs over Megatron's own (megatron-cg bench through "
        "Megatron-LM's pretrain_gpt.py, MEGATRON_LM_DIR, arms: the cell's capture and stock), one process per cell, "
        f"into DIR/{RESULTS_FILE}, which megatron-cg matrix render takes beside the runs' matrix.json. Cells the "
        "rules refuse, or whose stock arm they refuse, are recorded, not launched.",
    )
    parser.add_argument("cells", type=Path, help="the cells file `matrix plan` wrote")
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help=f"a folder per cell (its bench.json, bench.md, bench.log, dataset) and {RESULTS_FILE}",
    )
    parser.add_argument("--only", nargs="+", help="bench only these cells (names from the cells file)")
    parser.add_argument("--parallel", type=int, default=1, help="benches side by side on the one GPU (default 1)")
    parser.add_argument("--timeout-s", type=float, default=600, help="per bench; a bench past it is a failure")
    options = parser.parse_args(own)
    previous = signal.signal(signal.SIGTERM, _stop)  # timeout(1): through run_benches' cleanup, as Ctrl-C
    try:
        checkout = megatron_lm_dir_from_environment()
        cells = select_cells(load_cells(options.cells), options.only, options.cells)
        rows = run_benches(
            cells,
            options.out,
            megatron_lm_dir=checkout,
            bench_flags=bench_flags,
            parallel=options.parallel,
            timeout_s=options.timeout_s,
        )
    except (OSError, ValueError, KeyError) as error:
        print(f"megatron-cg matrix bench: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        signal.signal(signal.SIGTERM, previous)
    return EXIT_MISMATCH if any(row["result"] == "failed" for row in rows) else EXIT_OK
