"""megatron-cg matrix bench on CPU with a fake launcher: each cell's bench command (arms, flags, data,
single-rank environment), a rendezvous port of its own for benches side by side, refused cells and
cells whose stock arm is refused left unlaunched, the rows read from the bench's own bench.json, and
the "plugin / stock" column render takes from them."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from megatron_cg_plugin import cli
from megatron_cg_plugin.bench import output
from megatron_cg_plugin.bench.command import parse_bench_argv, user_script
from megatron_cg_plugin.bench.output import BenchResult, BlockRecord
from megatron_cg_plugin.farm.ports import ephemeral_start
from megatron_cg_plugin.matrix import bench, runner

GPT_TE = {"model": "gpt", "scope": "layer", "precision": "bf16", "capture": "te", "mbs": "1", "loop": "train"}
LLAMA_SLOT = {"model": "llama", "scope": "attn", "precision": "bf16", "capture": "slot", "mbs": "2", "loop": "train"}
MOE_OFFLOAD = {
    "model": "moe-droppad",
    "scope": "attn",
    "precision": "bf16",
    "capture": "slot-offload",
    "mbs": "1",
    "loop": "train",
}
# Megatron's TE graphs cannot capture a whole layer whose saves its offload moves (whole-layer-offload-unjoined).
LLAMA_LAYER_OFFLOAD = {**LLAMA_SLOT, "scope": "layer", "capture": "slot-offload", "precision": "fp8-delayed"}
REFUSED = runner.Cell({**GPT_TE, "precision": "fp8-blockwise", "capture": "slot"}, ("slot-capture-fp8",), "refused")


@pytest.fixture
def megatron_lm(tmp_path) -> Path:
    folder = tmp_path / "megatron-lm"
    folder.mkdir()
    (folder / "pretrain_gpt.py").write_text("raise SystemExit('not run on CPU')\n")
    return folder


def bench_json(arms: tuple[str, str], *, rounds: int = 4, steps: int = 6, ratio: float = 0.9) -> dict:
    """What megatron-cg bench writes (bench.output.to_json) for blocks whose first arm takes ``ratio``
    of the second's time, with a drift over the schedule."""
    blocks = []
    for round_ in range(rounds):
        for arm in arms if round_ % 2 == 0 else arms[::-1]:
            seconds = 0.1 * (ratio if arm == arms[0] else 1.0) * (1 + 0.01 * len(blocks))
            blocks.append(BlockRecord(round_, arm, (seconds * 2,) + (seconds,) * (steps - 1), 1 << 30, 1.0, 64 << 20))
    return output.to_json(BenchResult("fake", steps, 2, tuple(blocks), {}, {}, None, ()))


class FakeLauncher:
    """Stands in for run_process: reads the bench's own options as megatron-cg bench would and writes
    its bench.json (``fails``: cells whose bench exits 1); records each launch and how many overlap."""

    def __init__(self, fails: tuple[str, ...] = (), hold_s: float = 0.0) -> None:
        self.launches: list[tuple[list[str], dict]] = []
        self.fails, self.hold_s = fails, hold_s
        self.running = self.most_running = 0
        self.lock = threading.Lock()

    def __call__(self, argv, env, log: Path, timeout_s: float) -> int:
        with self.lock:
            self.launches.append((list(argv), dict(env)))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.hold_s)
        options, _flags = parse_bench_argv(list(argv)[3:])
        log.write_text("megatron-cg bench: the log\n")
        with self.lock:
            self.running -= 1
        if options.out.name in self.fails:
            return 1
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "bench.json").write_text(
            json.dumps(bench_json(options.arms, rounds=options.rounds, steps=options.steps))
        )
        return 0


def no_stock_refusal(*_args, **_kwargs):
    return (), ""


@pytest.mark.parametrize(
    "factors, arms",
    [(GPT_TE, ("plugin", "stock")), (LLAMA_SLOT, ("slot", "stock")), (MOE_OFFLOAD, ("slot-offload", "stock"))],
)
def test_a_cells_bench_is_megatron_cg_bench_of_its_capture_and_stock_on_its_flags(tmp_path, megatron_lm, factors, arms):
    cell = runner.Cell(factors)
    script = megatron_lm / "pretrain_gpt.py"
    launch = bench.bench_launch(
        cell,
        tmp_path,
        script=script,
        bench_flags=["--bench-rounds", "4"],
        port=21234,
        environ={"PATH": "/bin", "PYTHONPATH": "/site"},
    )
    assert launch.argv[:3] == ("-m", "megatron_cg_plugin.cli", "bench")
    options, flags = parse_bench_argv(list(launch.argv[3:]))  # as megatron-cg bench reads it
    assert options.arms == arms and options.out == tmp_path / cell.name and not options.plot and options.rounds == 4
    assert user_script(flags) == script  # the bench's options all come before the script
    assert flags[1 : 1 + len(runner.cell_flags(factors))] == runner.cell_flags(factors)
    assert flags[flags.index("--cuda-graph-impl") + 1] == "transformer_engine" and "--deterministic-mode" not in flags
    data = Path(flags[flags.index("--data-path") + 1])
    assert data.parent.parent == tmp_path / cell.name and data.with_suffix(".idx").exists()  # its own dataset
    env = launch.env
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) == ("0", "1", "1", "21234")
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["PATH"] == "/bin" and env["PYTHONPATH"].endswith("/site")
    assert ("NVTE_CPU_OFFLOAD_V1" in env) == (factors["capture"] == "slot-offload")


def test_benches_side_by_side_each_get_a_port_of_their_own(monkeypatch, tmp_path, megatron_lm):
    monkeypatch.setattr(bench, "refusal_of", no_stock_refusal)
    cells = [c for c in runner.design(lambda _cell: ((), "")) if c.factors["capture"] != "slot-offload"][:6]
    launcher = FakeLauncher(hold_s=0.2)
    rows = bench.run_benches(
        cells, tmp_path, megatron_lm_dir=str(megatron_lm), parallel=3, launcher=launcher, progress=lambda _line: None
    )
    ports = [int(env["MASTER_PORT"]) for _argv, env in launcher.launches]
    assert len(ports) == 6 and len(set(ports)) == 6
    assert all(port < ephemeral_start() for port in ports)  # no neighbour's bind(0) or connection can take one
    assert launcher.most_running == 3  # side by side, never more than --parallel
    assert [row["result"] for row in rows] == ["benched"] * 6 and all(row["parallel"] == 3 for row in rows)


def test_a_refused_cell_and_a_cell_whose_stock_arm_is_refused_are_not_launched(tmp_path, megatron_lm):
    """The stock arm's flags (the cell's less --cg-slot-capture) go through the rules as check would."""
    cells = [REFUSED, runner.Cell(LLAMA_LAYER_OFFLOAD), runner.Cell(GPT_TE)]
    launcher = FakeLauncher()
    rows = bench.run_benches(
        cells, tmp_path, megatron_lm_dir=str(megatron_lm), launcher=launcher, progress=lambda _line: None
    )
    assert [row["result"] for row in rows] == ["refused", "stock-refused", "benched"]
    assert rows[0]["refused_by"] == ["slot-capture-fp8"]
    assert rows[1]["stock_refused_by"] == ["whole-layer-offload-unjoined"]
    assert [Path(argv[argv.index("--bench-out") + 1]).name for argv, _env in launcher.launches] == [cells[2].name]
    written = json.loads((tmp_path / bench.RESULTS_FILE).read_text())
    assert [row["name"] for row in written["rows"]] == [c.name for c in cells] and written["bench"]["parallel"] == 1


def test_the_row_is_the_benchs_own_ratio_of_the_cells_capture_over_stock(monkeypatch, tmp_path, megatron_lm):
    monkeypatch.setattr(bench, "refusal_of", no_stock_refusal)
    rows = bench.run_benches(
        [runner.Cell(LLAMA_SLOT)],
        tmp_path,
        megatron_lm_dir=str(megatron_lm),
        bench_flags=["--bench-rounds", "6", "--bench-steps", "5"],
        launcher=FakeLauncher(),
        progress=lambda _line: None,
    )
    [row] = rows
    written = json.loads((tmp_path / runner.cell_name(LLAMA_SLOT) / "bench.json").read_text())
    assert row["arms"] == ["slot", "stock"] and row["ratio"] == written["ratios"]["slot/stock"]
    assert row["ratio"]["n"] == 3 and 0.85 < row["ratio"]["median"] < 0.95
    assert row["ratio_half_width"] == written["ratio_precision"]["slot/stock"]["half_width"]
    assert (row["rounds"], row["steps_per_block"], row["skip_steps"]) == (6, 5, 2)


@pytest.mark.parametrize(
    "returncode, writes, problem",
    [(1, False, "exited with code 1"), (124, False, "timed out"), (0, False, "wrote no bench.json")],
)
def test_a_bench_that_fails_is_a_failed_row_with_its_log_and_the_others_go_on(
    monkeypatch, tmp_path, megatron_lm, returncode, writes, problem
):
    cells = [runner.Cell(GPT_TE), runner.Cell({**GPT_TE, "mbs": "2"})]

    def launcher(argv, env, log, timeout_s):
        log.write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")
        if runner.cell_name(GPT_TE) in " ".join(argv):
            return returncode
        return FakeLauncher()(argv, env, log, timeout_s)

    rows = bench.run_benches(
        cells, tmp_path, megatron_lm_dir=str(megatron_lm), launcher=launcher, progress=lambda _line: None
    )
    assert [row["result"] for row in rows] == ["failed", "benched"]
    assert problem in rows[0]["problem"] and "CUDA out of memory" in rows[0]["log_tail"]


def test_a_former_runs_bench_json_is_not_taken_for_this_one(tmp_path, megatron_lm):
    cell = runner.Cell(GPT_TE)
    (tmp_path / cell.name).mkdir()
    (tmp_path / cell.name / "bench.json").write_text(json.dumps(bench_json(("plugin", "stock"))))
    [row] = bench.run_benches(
        [cell],
        tmp_path,
        megatron_lm_dir=str(megatron_lm),
        launcher=lambda argv, env, log, timeout_s: 0,
        progress=lambda _line: None,
    )
    assert row["result"] == "failed" and "wrote no bench.json" in row["problem"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--bench-arms", "eager"], "--bench-arms: matrix bench sets it per cell"),
        (["--bench-out=x"], "--bench-out=x: matrix bench sets it per cell"),
        (["--deterministic-mode"], "after -- come megatron-cg bench's own --bench-* options"),
        (["steps", "--bench-rounds", "4"], "after -- come megatron-cg bench's own --bench-* options"),
        # its rows read the block schedule's rounds and ratio spread (review: a step run was reported as 1 round)
        (["--bench-interleave", "steps"], "--bench-interleave: matrix bench reads the block schedule's"),
    ],
)
def test_flags_after_the_separator_are_the_benchs_own_options(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        bench.check_bench_flags(flags)


def test_bench_options_the_bench_learns_later_pass_through(tmp_path, megatron_lm):
    launch = bench.bench_launch(
        runner.Cell(GPT_TE),
        tmp_path,
        script=megatron_lm / "pretrain_gpt.py",
        bench_flags=["--bench-cached-batches", "2"],
        port=21000,
        environ={},
    )
    bench.check_bench_flags(["--bench-cached-batches", "2"])
    assert launch.argv[launch.argv.index("--bench-cached-batches") + 1] == "2"


def test_the_command_line_refuses_bad_input_in_one_line(tmp_path, capsys):
    cells = tmp_path / "cells.json"
    cells.write_text(json.dumps([runner.Cell(GPT_TE).to_json()]))
    out = str(tmp_path / "out")
    assert cli.main(["matrix", "bench", str(cells), "--out", out, "--", "--bench-arms", "eager"]) == 2
    assert cli.main(["matrix", "bench", str(cells), "--out", out, "--only", "nope"]) == 2
    assert cli.main(["matrix", "bench", str(cells), "--out", out, "--parallel", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("megatron-cg matrix bench: ") for line in err)
    assert "--only names cells not in" in err[1] and "--parallel 0" in err[2]


def test_without_a_megatron_lm_checkout_nothing_launches(monkeypatch, tmp_path):
    launcher = FakeLauncher()
    with pytest.raises(ValueError, match="MEGATRON_LM_DIR"):
        bench.run_benches(
            [runner.Cell(GPT_TE)], tmp_path, megatron_lm_dir=None, launcher=launcher, progress=lambda _line: None
        )
    assert not launcher.launches


SLEEPS = ["-c", "import time; time.sleep(60)"]


def test_the_runner_keeps_the_output_and_stops_a_bench_past_its_time(tmp_path):
    log = tmp_path / "bench.log"
    run = bench.BenchProcesses()
    assert run(["-c", "print('hello')"], {"PATH": "/usr/bin:/bin"}, log, 60) == 0
    assert log.read_text() == "hello\n"
    start = time.monotonic()
    assert run(SLEEPS, {}, log, 0.5) == bench.TIMED_OUT and time.monotonic() - start < 15


def test_a_stopped_driver_stops_its_running_benches_and_starts_no_more(tmp_path):
    run = bench.BenchProcesses()
    codes = []
    worker = threading.Thread(target=lambda: codes.append(run(SLEEPS, {}, tmp_path / "a.log", 60)))
    worker.start()
    deadline = time.monotonic() + 20
    while not run._running and time.monotonic() < deadline:
        time.sleep(0.05)
    run.stop()
    worker.join(20)
    assert codes and codes[0] < 0  # killed by a signal, long before its 60 s
    started = tmp_path / "started"
    assert run(["-c", f"open({str(started)!r}, 'w')"], {}, tmp_path / "b.log", 60) == bench.STOPPED
    assert not started.exists()


def test_a_driver_stopped_between_benches_starts_none_of_the_rest(tmp_path, megatron_lm):
    cells = [runner.Cell({**GPT_TE, "precision": precision}) for precision in ("bf16", "fp8-delayed", "fp8-tensorwise")]
    launcher = FakeLauncher(hold_s=0.3)  # the second is running when the first's row comes, the third waits

    def stopped(_line):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench.run_benches(cells, tmp_path, megatron_lm_dir=str(megatron_lm), launcher=launcher, progress=stopped)
    assert len(launcher.launches) < 3


def merged_with_benches(benches: list[dict]) -> dict:
    cells = [
        REFUSED,
        runner.Cell(GPT_TE),
        runner.Cell(LLAMA_SLOT),
        runner.Cell(LLAMA_LAYER_OFFLOAD),
        runner.Cell(MOE_OFFLOAD),
    ]
    run = {"steps": 10, "rows": [{**c.to_json(), "result": "exact"} for c in cells[1:]]}
    return runner.merge_results(cells, [run, *benches])


def test_render_sets_each_cells_ratio_beside_its_run_and_says_how_the_bench_ran():
    bench_row = {
        "result": "benched",
        "arms": ["plugin", "stock"],
        "parallel": 4,
        "rounds": 4,
        "steps_per_block": 8,
        "skip_steps": 2,
        "ratio": {"median": 0.934, "low": 0.91, "high": 0.952, "n": 2},
        "ratio_half_width": 0.0213,
    }
    first = {
        "bench": {"parallel": 4},
        "rows": [
            {"name": REFUSED.name, "result": "refused"},
            {**bench_row, "name": runner.cell_name(GPT_TE), "ratio": {**bench_row["ratio"], "median": 1.5}},
            # as run_benches records it: never launched, so no "parallel" (a render once stopped on that)
            {
                "name": runner.cell_name(LLAMA_LAYER_OFFLOAD),
                "result": "stock-refused",
                "stock_refused_by": ["whole-layer-offload-unjoined"],
            },
            {"name": runner.cell_name(MOE_OFFLOAD), "result": "failed", "parallel": 4, "problem": "exited with code 1"},
        ],
    }
    again = {"bench": {"parallel": 4}, "rows": [{**bench_row, "name": runner.cell_name(GPT_TE)}]}  # later wins
    text = runner.render(merged_with_benches([first, again]))
    lines = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert "| exact | 0.93 [0.91, 0.95] +-2.1% (n=2) |" in lines[runner.cell_name(GPT_TE)]
    assert "| refused `slot-capture-fp8` | - |" in lines[REFUSED.name]
    assert "| exact | - |" in lines[runner.cell_name(LLAMA_SLOT)]  # not benched
    assert "| exact | - (stock: `whole-layer-offload-unjoined`) |" in lines[runner.cell_name(LLAMA_LAYER_OFFLOAD)]
    assert "| exact | **bench failed** |" in lines[runner.cell_name(MOE_OFFLOAD)]
    assert "plugin / stock (1 cells benched)" in text and "4 rounds of 8 steps per arm, the first 2" in text
    assert "up to 4 benches side by side on the one GPU (shared-GPU figures)" in text


def test_render_without_benches_says_the_column_is_not_benched():
    text = runner.render(merged_with_benches([]))
    assert "plugin / stock: not benched" in text
    assert "| exact | - | - | - | - |" in text


def test_a_bench_alone_is_no_matrix():
    with pytest.raises(ValueError, match=r"matrix\.json"):
        runner.merge_results([runner.Cell(GPT_TE)], [{"bench": {}, "rows": []}])


def test_render_takes_what_matrix_bench_wrote(monkeypatch, tmp_path, megatron_lm):
    monkeypatch.setattr(bench, "refusal_of", no_stock_refusal)
    cells = [runner.Cell(GPT_TE), runner.Cell(LLAMA_SLOT)]
    bench.run_benches(
        cells,
        tmp_path,
        megatron_lm_dir=str(megatron_lm),
        parallel=2,
        bench_flags=["--bench-rounds", "4", "--bench-steps", "6"],
        launcher=FakeLauncher(),
        progress=lambda _line: None,
    )
    written = json.loads((tmp_path / bench.RESULTS_FILE).read_text())
    run = {"steps": 10, "rows": [{**c.to_json(), "result": "exact"} for c in cells]}
    text = runner.render(runner.merge_results(cells, [run, written]))
    assert text.count("| exact | 0.90 [") == 2 and "4 rounds of 6 steps per arm" in text
    assert "up to 2 benches side by side" in text
