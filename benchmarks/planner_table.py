"""Predicted against measured, from run reports: ``python benchmarks/planner_table.py REPORT.json...``.

Each report (``--cg-report-out``: a farm run's ``<case>.graphed.report.json``, or ``graphed_report``'s in
``benchmarks/common.sh``) holds the planner's prediction for the run's flags beside what its capture measured:
the graph pool, and with ``--cg-slot-capture`` the GPU arenas and the pinned host arenas. Prints one markdown
row per report, in MiB; these are the figures benchmarks/planner_*/result.json publish. Pure Python."""

from __future__ import annotations

import json
import sys
from pathlib import Path

PARTS = (
    ("pool", "predicted_pool_bytes", "pool_bytes"),
    ("GPU arenas", "predicted_arena_bytes", "arena_bytes"),
    ("pinned host arenas", "predicted_host_arena_bytes", "host_arena_bytes"),
)


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}".rstrip("0").rstrip(".")


def row(path: Path) -> list[str]:
    report = json.loads(path.read_text())
    scopes = [scope for scope in report.get("scopes", []) if not scope.get("failure")]
    cells = [path.name.removesuffix(".report.json").removesuffix(".graphed")]
    for _, predicted_key, measured_key in PARTS:
        predicted = report.get(predicted_key)
        measured = sum(scope.get(measured_key) or 0 for scope in scopes)
        if predicted is None and not measured:
            cells.append("-")
        else:
            ratio = f" ({predicted / measured:.2f})" if predicted is not None and measured else ""
            cells.append(f"{'-' if predicted is None else _mib(predicted)} / {_mib(measured)}{ratio}")
    return cells


def main(paths: list[str]) -> int:
    header = ["run", *(f"{name} MiB predicted / measured" for name, _, _ in PARTS)]
    print("| " + " | ".join(header) + " |\n| " + " | ".join("---" for _ in header) + " |")
    for path in sorted(Path(p) for p in paths):
        print("| " + " | ".join(row(path)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
