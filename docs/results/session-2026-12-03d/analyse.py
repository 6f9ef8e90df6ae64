"""Every figure of this session's README that a bench did not print itself, from the files here.
Run from the project root: python docs/results/session-2026-12-03d/analyse.py

- s89/s90 (`*.bench.json`): per-cycle plugin / stock ratios split by which arm held the cycle's outer
  places, and the fast-cycle difference: cycles whose four steps all ran under 1.15 x the lower tercile
  of the kept steps, median of (plugin's two steps - stock's two steps) / 2.
- s91: its benches ran past their timeouts and wrote no bench.json; their progress lines remain
  (`s91/*.progress.txt`: per cycle, each arm's mean of its two steps). They are read as the bench reads its
  steps, the first 4 cycles dropped, except that a cycle's mean is arithmetic here (the bench's is geometric)
  and no step is known alone, so the fast-cycle rule cannot be s89's (both arms' means under 1.15 x the
  lower tercile of the cycles' smaller mean)."""
import json
import re
import statistics
from pathlib import Path

from megatron_cg_plugin.plan.bench_schedule import median_interval

HERE = Path(__file__).parent
SKIP = 4  # --bench-skip-steps of every bench here


def interval_text(ratios: list[float]) -> str:
    found = median_interval(ratios)
    return (f"{found.median:.4f} [{found.low:.4f}, {found.high:.4f}] (+-{(found.high - found.low) / 2 / found.median:.2%}, "
            f"n={len(ratios)})")


def by_outer_arm(cycles: list[tuple[str, float]], a: str = "plugin", b: str = "stock") -> str:
    """cycles: (the arm in the cycle's outer places, a / b); the last figure is the outer places' cost if
    the split is theirs alone."""
    split = {arm: statistics.median(r for outer, r in cycles if outer == arm) for arm in (b, a)}
    return f"outer {b} {split[b]:.4f}, outer {a} {split[a]:.4f} (half their ratio {(split[a] / split[b]) ** 0.5 - 1:+.2%})"


def from_json(run: str, model: str, a: str = "plugin", b: str = "stock") -> None:
    data = json.loads((HERE / run / f"{model}.bench.json").read_text())
    cycles: dict[int, list[dict]] = {}
    for step in data["steps"]:
        if step["cycle"] >= SKIP:
            cycles.setdefault(step["cycle"], []).append(step)
    rows = []
    for steps in cycles.values():
        mine = [s["seconds"] for s in steps if s["arm"] == a]
        other = [s["seconds"] for s in steps if s["arm"] == b]
        rows.append((steps[0]["arm"], (mine[0] * mine[1]) ** 0.5 / (other[0] * other[1]) ** 0.5, steps))
    print(f"{run} {model}: {a} / {b} {interval_text([r for _, r, _ in rows])}")
    print(f"  by outer arm: {by_outer_arm([(outer, r) for outer, r, _ in rows], a, b)}")
    kept = sorted(s["seconds"] for _, _, steps in rows for s in steps)
    limit = kept[len(kept) // 3] * 1.15
    fast = [(sum(s["seconds"] for s in steps if s["arm"] == a) - sum(s["seconds"] for s in steps if s["arm"] == b)) / 2
            for _, _, steps in rows if all(s["seconds"] < limit for s in steps)]
    if fast:
        print(f"  fast cycles (all four steps under {limit * 1e3:.1f} ms): {len(fast)}, {a} - {b} "
              f"{statistics.median(fast) * 1e3:+.3f} ms; arm medians {a} "
              f"{statistics.median(s['seconds'] for _, _, st in rows for s in st if s['arm'] == a) * 1e3:.1f} ms, {b} "
              f"{statistics.median(s['seconds'] for _, _, st in rows for s in st if s['arm'] == b) * 1e3:.1f} ms")


def from_progress(model: str) -> None:
    rows, rounds = [], {}
    for line in (HERE / "s91" / f"{model}.progress.txt").read_text().splitlines():
        cycle = re.match(r"cycle (\d+)/\d+: (\w+) ([\d.]+) ms, (\w+) ([\d.]+) ms", line)
        if cycle and int(cycle[1]) > SKIP:  # numbered from 1
            rows.append((cycle[2], {cycle[2]: float(cycle[3]), cycle[4]: float(cycle[5])}))
        capture = re.match(r"capture round (\d+)/\d+: (\w+) ([\d.]+) s", line)
        if capture:
            rounds.setdefault(capture[2], []).append(float(capture[3]))
    # A progress line lists the arms in --bench-arms order; the outer arm alternates, starting with the first.
    first = rows[0][0]
    other = "plugin" if first == "stock" else "stock"
    ratios = [(first if (index + SKIP) % 2 == 0 else other, means["plugin"] / means["stock"])
              for index, (_, means) in enumerate(rows)]
    print(f"s91 {model}: plugin / stock {interval_text([r for _, r in ratios])}")
    print(f"  by outer arm: {by_outer_arm(ratios)}")
    print(f"  arm medians (two-step means) stock {statistics.median(m['stock'] for _, m in rows):.1f} ms, plugin "
          f"{statistics.median(m['plugin'] for _, m in rows):.1f} ms")
    fast = statistics.quantiles([min(m.values()) for _, m in rows], n=3)[0] * 1.15
    quick = [m["plugin"] - m["stock"] for _, m in rows if max(m.values()) <= fast]
    print(f"  cycles with both means under {fast:.1f} ms: {len(quick)}, plugin - stock {statistics.median(quick):+.2f} ms")
    if rounds:
        plugin, stock = rounds["plugin"], rounds["stock"]
        pairs = [(plugin[i] * plugin[i + 1] / (stock[i] * stock[i + 1])) ** 0.5 for i in range(0, len(plugin), 2)]
        found = median_interval(pairs)
        print(f"  capture s plugin {statistics.median(plugin):.3f}, stock {statistics.median(stock):.3f}; plugin / stock per "
              f"pair of mirrored rounds {found.median:.3f} [{found.low:.3f}, {found.high:.3f}] (n={len(pairs)})")


if __name__ == "__main__":
    for run, model in (("s89", "llama"), ("s89", "tinymoe"), ("s89", "dense1b"), ("s90", "droppad"), ("s90", "dropless")):
        from_json(run, model)
    from_json("s90", "gpt4", "plugin-recording", "plugin")
    for model in ("llama", "gpt4"):
        from_progress(model)
