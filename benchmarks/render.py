"""Doc tables from the published results: every ``benchmarks/<name>/result.json``.

A doc quotes a table between two markers, and this module writes what goes between them:

    <!-- generated: benchmarks/render.py TABLE -->
    ...
    <!-- end generated -->

``python benchmarks/render.py`` rewrites every such block under README.md and docs/ in place;
``python benchmarks/render.py TABLE`` prints one table. ``tests/unit/test_published_figures.py``
fails when a committed block differs from what the JSON renders. Pure Python, no dependencies.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REQUIRED = ("name", "command", "commit", "device", "figures")
SPEED_MODELS = ("gpt_4layer", "llama_like", "tiny_moe", "dense_1b", "moe_droppad", "moe_dropless")
BLOCK = re.compile(
    r"(<!-- generated: benchmarks/render\.py (?P<table>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)


def load_results(root: Path = HERE) -> dict[str, dict]:
    """Every result.json under ``root``, by its folder's name."""
    return {path.parent.name: json.loads(path.read_text()) for path in sorted(root.glob("*/result.json"))}


def missing_fields(result: dict) -> list[str]:
    """The required fields a result lacks or leaves empty."""
    return [field for field in REQUIRED if result.get(field) in (None, "", {}, [])]


def _interval(figure: dict, digits: int = 4) -> str:
    return f"{figure['median']:.{digits}f} [{figure['low']:.{digits}f}, {figure['high']:.{digits}f}]"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _source(result: dict, whole_device: bool = False) -> str:
    """Where a table's figures come from: the folder, the commit and the device (the GPU alone, or with
    ``whole_device`` the device field as written: "1x NVIDIA H200 (141 GB), one process, ...")."""
    device = result["device"] if whole_device else result["device"].split(",")[0]
    return f"`benchmarks/{result['name']}/` at {result['commit']}, {device}"


def speed(results: dict[str, dict]) -> str:
    rows = []
    for name in SPEED_MODELS:
        result = results[name]
        figures = result["figures"]
        capture = figures.get("capture_plugin_over_stock")
        rows.append(
            [
                result["model"],
                _interval(figures["plugin_over_stock"]),
                str(figures["cycles"]),
                _interval(capture, 3) + f" ({capture['pairs']} pairs)" if capture else "-",
                _source(result),
            ]
        )
    return _table(
        ["model", "step time plugin / stock [95% interval]", "cycles kept", "capture plugin / stock", "source"], rows
    )


def capture(results: dict[str, dict]) -> str:
    result = results["capture_time"]
    rows = [
        [row["model"], _interval(row, 3), str(row["pairs"])] for row in result["figures"]["capture_plugin_over_stock"]
    ]
    return _table(["model", "capture time plugin / stock, median [lowest, highest] pair", "pairs of rounds"], rows) + (
        f"\n\nSource: {_source(result, whole_device=True)}."
    )


def packed(results: dict[str, dict]) -> str:
    result = results["packed_sequences"]
    figures = result["figures"]
    step, peak = figures["step_ms"], figures["peak_allocated_plus_pool_mib"]
    rows = [
        ["eager", str(step["eager"]), "-", f"{peak['eager']:,}", "-"],
        [
            "plugin",
            str(step["plugin"]),
            _interval(figures["plugin_over_eager"], 3),
            f"{peak['plugin']:,}",
            f"{figures['graph_pool_mib']:,}",
        ],
    ]
    table = _table(
        [
            "arm",
            "step ms",
            "over eager, median [lowest, highest] pair",
            "peak allocated + graph pool MiB",
            "graph pool MiB",
        ],
        rows,
    )
    return (
        f"{table}\n\nModel: {result['model']}. Stock Megatron: {figures['stock']}. "
        f"Source: {_source(result, whole_device=True)}."
    )


def offload(results: dict[str, dict]) -> str:
    result = results["offload_6p7b"]
    figures = result["figures"]
    rows = []
    for arm in figures["arms"]:
        step = arm["step_ms"]
        step_text = f"{step[0]} [{step[1]}, {step[2]}]" if len(step) == 3 else str(step[0])
        over = arm.get("over_slot")
        over_text = (
            "1"
            if over is None
            else (f"{over[0]:.2f} [{over[1]:.2f}, {over[2]:.2f}]" if len(over) == 3 else f"{over[0]:.2f}")
        )
        less = arm.get("less_than_slot_pct")
        rows.append(
            [arm["arm"], step_text, over_text, f"{arm['graph_memory_mib']:,}", "-" if less is None else f"{less}%"]
        )
    table = _table(
        ["arm", "step ms [spread]", "step / slot", "graph memory (pool + arenas) MiB", "less than slot"], rows
    )
    staged = figures["staged_over_stock"]
    return (
        f"{table}\n\nCopies between replays over Megatron's offload: {_interval(staged, 3)} "
        f"({staged['pairs']} pairs). Model: {result['model']}. Source: {_source(result, whole_device=True)}."
    )


def _predicted(results: dict[str, dict], name: str) -> str:
    result = results[name]
    rows = [
        [
            row["set"],
            row["case"],
            str(row["predicted_mib"]),
            str(row["measured_mib"]),
            f"{row['predicted_mib'] / row['measured_mib']:.2f}",
        ]
        for row in result["figures"]["rows"]
    ]
    return _table(["set", "case", "predicted MiB", "measured MiB", "predicted / measured"], rows) + (
        f"\n\nSource: {_source(result, whole_device=True)}."
    )


def _pair(predicted, measured, exact: bool = True) -> str:
    """Predicted / measured; arenas are sums of known storages, so equal figures are equal to the byte."""
    if predicted is None:
        return "-"
    if exact and predicted == measured:
        return f"{predicted:g} / {measured:g} (to the byte)"
    return f"{predicted:g} / {measured:g} ({predicted / measured:.2f})"


def slot(results: dict[str, dict]) -> str:
    result = results["planner_slot"]
    rows = [
        [
            row["run"],
            _pair(row["pool_predicted_mib"], row["pool_measured_mib"], exact=False),
            _pair(row["arenas_predicted_mib"], row["arenas_measured_mib"]),
            _pair(row["host_predicted_mib"], row["host_measured_mib"]),
        ]
        for row in result["figures"]["rows"]
    ]
    return _table(["run", "pool MiB predicted / measured", "GPU arenas MiB", "pinned host arenas MiB"], rows) + (
        f"\n\nSource: {_source(result, whole_device=True)}."
    )


def moe_drops(results: dict[str, dict]) -> str:
    result = results["moe_drops"]
    rows = [
        [row["case"], f"{row['planned_uniform_pct']:.2f}%", f"{row['measured_pct']:.2f}%"]
        for row in result["figures"]["rows"]
    ]
    return _table(["case", "dropped, planned (uniform router)", "dropped, measured"], rows) + (
        f"\n\nSource: {_source(result, whole_device=True)}."
    )


TUNE_MODELS = ("tune_dense_1b", "tune_llama_like", "tune_moe")  # those published so far are rendered
TIMED_ONCE_AS = re.compile(r"timed once, as (.+)$")  # megatron-cg tune's verdict on a dense whole layer


def _ratio(ratio: dict | None) -> str:
    return "-" if ratio is None else _interval(ratio, 3)


def _tune_verdict(verdict: str) -> str:
    """A row's verdict for the table: a row not timed says only that, or which row timed its graphs."""
    if not verdict.startswith("not timed"):
        return verdict
    twin = TIMED_ONCE_AS.search(verdict)
    return f"the same graphs as {twin.group(1)}" if twin else "not timed"


def tune(results: dict[str, dict]) -> str:
    """Per model ``megatron-cg tune`` ran on: its table (setup, graph memory, step, ratio, verdict), its
    winner, and the separate benches of its top two setups."""
    parts = []
    for name in (name for name in TUNE_MODELS if name in results):
        result = results[name]
        figures = result["figures"]
        rows = [
            [
                row["setup"],
                "-" if row["predicted_mib"] is None else f"{row['predicted_mib']:,}",
                "-" if row["measured_mib"] is None else f"{row['measured_mib']:,}",
                "-" if row["step_ms"] is None else f"{row['step_ms']:.1f}",
                _ratio(row["over_eager"]) if row["over_eager"] else ("1" if row["setup"] == "eager" else "-"),
                _tune_verdict(row["verdict"]),
            ]
            for row in figures["setups"]
        ]
        table = _table(
            ["setup", "predicted graph MiB", "measured graph MiB", "step ms", "vs eager [95%]", "verdict"], rows
        )
        benches = "; ".join(
            f"{bench['setup']} {_ratio(bench['over_eager'])} ({bench['schedule']})" for bench in figures["benches"]
        )
        winner = figures["winner"] or "none: graphs do not pay"
        agreement = {"agrees": "agrees with the tune's order", "tie": "a tie", "disagrees": "disagrees"}
        parts.append(
            f"**{result['model']}** (`benchmarks/{name}/`)\n\n{table}\n\nWinner: {winner}. Each of the top two against "
            f"eager in a bench of its own: {benches}; {agreement.get(figures['bench_agrees'], 'not run')}."
            + "".join(f" {note[0].upper()}{note[1:]}." for note in figures.get("notes", ()))
            + f" Source: {_source(result)}."
        )
    return "\n\n".join(parts)


def contract_check(results: dict[str, dict]) -> str:
    """The replay check's host cost per layer replay in each ``--cg-contract-check`` mode, from the results that
    timed it (the bench times it on the plugin arm after its schedule)."""
    modes = ["full", "shapes", "off"]
    rows = [
        [result["model"], *(f"{result['figures']['contract_check_us'][mode]:.1f}" for mode in modes), _source(result)]
        for result in results.values()
        if "contract_check_us" in result["figures"]
    ]
    return _table(["model", *(f"{mode}: us per layer replay" for mode in modes), "source"], rows)


def index(results: dict[str, dict]) -> str:
    rows = [
        [f"[`{name}`]({name}/)", result.get("title", name), result["commit"], result["device"]]
        for name, result in results.items()
    ]
    return _table(["folder", "what it measures", "commit", "device"], rows)


TABLES: dict[str, Callable[[dict[str, dict]], str]] = {
    "speed": speed,
    "capture": capture,
    "contract-check": contract_check,
    "packed": packed,
    "offload": offload,
    "planner-pool": lambda results: _predicted(results, "planner_pool"),
    "planner-fp8": lambda results: _predicted(results, "planner_fp8"),
    "planner-slot": slot,
    "moe-drops": moe_drops,
    "tune": tune,
    "index": index,
}


def render(table: str, results: dict[str, dict] | None = None) -> str:
    """The markdown of one table, from the results (read from benchmarks/ when not given)."""
    return TABLES[table](load_results() if results is None else results)


def blocks(text: str) -> list[tuple[str, str]]:
    """(table, committed body) for every generated block of a doc's text."""
    return [(match["table"], match["body"]) for match in BLOCK.finditer(text)]


def rewrite(text: str, results: dict[str, dict]) -> str:
    """The doc's text with every generated block rendered anew."""
    return BLOCK.sub(lambda m: f"{m.group(1)}{TABLES[m['table']](results)}\n{m.group(4)}", text)


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md")), root / "benchmarks" / "README.md"]


def main(argv: list[str]) -> int:
    results = load_results()
    if argv:
        print(render(argv[0], results))
        return 0
    for path in documents():
        text = path.read_text()
        new = rewrite(text, results)
        if new != text:
            path.write_text(new)
            print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
