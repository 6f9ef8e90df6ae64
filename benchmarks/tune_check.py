"""The tune benchmarks' two steps after ``megatron-cg tune`` (``tune_then_bench`` in common.sh):

    python benchmarks/tune_check.py bench-args OUT/tune/tune.json N
        the ``megatron-cg bench`` arguments (NUL-separated) that time the N-th (0 or 1) of the tune's
        graphed setups in its order (its winner first) against eager in a process of its own: TE's graphs
        as the ``plugin`` arm of the step schedule, slot-shared capture as the ``slot`` arm of the block
        schedule;
    python benchmarks/tune_check.py summary OUT NAME TITLE MODEL COMMAND COMMIT DEVICE
        ``result.json`` from OUT/tune/tune.json and the two benches (OUT/bench-0, OUT/bench-1): each
        setup as the tune measured it, the benches' ratios, and whether they agree with the tune's order
        where the benches' intervals separate the two (a tie where they overlap).

Pure Python; it reads the tune's interval rule from the plugin, which is installed wherever the shell
scripts run ``megatron-cg``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_cg_plugin.tune.ranking import few_values_interval

STEP_BENCH = ("--bench-interleave", "steps", "--bench-skip-steps", "4", "--bench-cycles", "9000")
BLOCK_BENCH = ("--bench-rounds", "8", "--bench-steps", "8")


def timed_graphed(tune: dict) -> list[dict]:
    """The tune's graphed setups with a measured ratio to eager in its order: its winner first (where one
    beat eager beyond its interval), then the others fastest first."""
    rows = [row for row in tune["setups"] if row["graph_flags"] and (row.get("measured") or {}).get("ratio")]
    winner = (tune.get("winner") or {}).get("setup")
    return sorted(rows, key=lambda row: (row["setup"] != winner, row["measured"]["ratio"]["median"]))


def bench_args(row: dict, bench_seconds: str) -> list[str]:
    flags = list(row["flags"])
    if "--cg-slot-capture" in flags:
        flags.remove("--cg-slot-capture")
        return ["--bench-arms", "eager,slot", *BLOCK_BENCH, *flags]
    return ["--bench-arms", "eager,plugin", *STEP_BENCH, "--bench-seconds", bench_seconds, *flags]


def bench_ratio(bench: dict) -> dict:
    """The graphed arm's step time over eager's, with its interval: distribution-free where the bench has
    one, else the tune's interval over a few values (the block schedule's pairs)."""
    (key,) = [key for key in bench["ratios"] if key.endswith("/eager")]
    found = bench["ratio_intervals"].get(key)
    if found:
        return {"median": found["median"], "low": found["low"], "high": found["high"], "n": found["n"], "method": "95%"}
    median, precision = bench["ratios"][key]["median"], bench["ratio_precision"][key]
    few = few_values_interval(median, precision["half_width"], precision["pairs"], unit="pairs")
    return {"median": few.median, "low": few.low, "high": few.high, "n": few.n, "method": few.method}


def agreement(first: dict, second: dict) -> str:
    """Whether the benches agree with the tune's order (``first`` faster): ``agrees`` or ``disagrees`` where
    their intervals separate them, ``tie`` where they overlap."""
    if first["high"] < second["low"]:
        return "agrees"
    if second["high"] < first["low"]:
        return "disagrees"
    return "tie"


def _mib(nbytes: int | None) -> int | None:
    return None if nbytes is None else round(nbytes / 2**20)


def _rounded(ratio: dict) -> dict:
    return {key: round(value, 4) if isinstance(value, float) else value for key, value in ratio.items()}


def summary(out: Path, name: str, title: str, model: str, command: str, commit: str, device: str) -> dict:
    tune = json.loads((out / "tune" / "tune.json").read_text())
    setups = []
    for row in tune["setups"]:
        measured = row.get("measured") or {}
        setups.append(
            {
                "setup": row["setup"],
                "verdict": row["verdict"],
                "predicted_mib": _mib(row["predicted_graph_bytes"]),
                "measured_mib": _mib(measured.get("graph_bytes")),
                "step_ms": None if measured.get("step_seconds") is None else round(measured["step_seconds"] * 1e3, 2),
                "over_eager": None if not measured.get("ratio") else _rounded(measured["ratio"]),
            }
        )
    top = timed_graphed(tune)[:2]
    benches = []
    for index, row in enumerate(top):
        bench = json.loads((out / f"bench-{index}" / "bench.json").read_text())
        ratio = _rounded(bench_ratio(bench))
        benches.append({"setup": row["setup"], "over_eager": ratio, "schedule": bench["schedule"]})
    winner = tune.get("winner")
    return {
        "name": name,
        "title": title,
        "model": model,
        "command": command,
        "commit": commit,
        "device": device,
        "figures": {
            "setups": setups,
            "winner": None if winner is None else winner["setup"],
            "graphs_do_not_pay": tune.get("graphs_do_not_pay"),
            "stopped": tune.get("stopped"),
            "budget_mib": _mib(tune.get("budget_bytes")),
            "benches": benches,
            "bench_agrees": None if len(benches) < 2 else agreement(*(bench["over_eager"] for bench in benches)),
        },
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["bench-args"] and len(argv) in (3, 4):
        rows = timed_graphed(json.loads(Path(argv[1]).read_text()))
        index = int(argv[2])
        if index >= len(rows):
            return 1  # fewer graphed setups timed: no bench to run
        sys.stdout.write("\0".join(bench_args(rows[index], argv[3] if len(argv) == 4 else "40")) + "\0")
        return 0
    if argv[:1] == ["summary"] and len(argv) == 8:
        print(json.dumps(summary(Path(argv[1]), *argv[2:]), indent=1))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
