"""s91's benches ran past their timeouts (the host stepped at about twice s89's time), so they wrote no
bench.json; their progress lines remain (`<model>.progress.txt`): per cycle, each arm's mean of its two
steps. This reads them as the bench would read its steps, with two differences it says: the mean of a
cycle's two steps is arithmetic here (the bench's is geometric), and no step-level figures exist.
Run: python docs/results/session-2026-12-03d/s91/from_progress.py"""
import re
import statistics
import sys
from pathlib import Path

from megatron_cg_plugin.plan.bench_schedule import median_interval

HERE = Path(__file__).parent
SKIP = 4  # --bench-skip-steps, as the bench drops them


def cycles(model: str) -> list[dict[str, float]]:
    rows = []
    for line in (HERE / f"{model}.progress.txt").read_text().splitlines():
        match = re.match(r"cycle (\d+)/\d+: (\w+) ([\d.]+) ms, (\w+) ([\d.]+) ms", line)
        if match:
            rows.append({match[2]: float(match[3]), match[4]: float(match[5])})
    return rows[SKIP:]


def captures(model: str) -> dict[str, list[float]]:
    rounds: dict[str, list[float]] = {}
    for line in (HERE / f"{model}.progress.txt").read_text().splitlines():
        match = re.match(r"capture round (\d+)/\d+: (\w+) ([\d.]+) s", line)
        if match:
            rounds.setdefault(match[2], []).append(float(match[3]))
    return rounds


def main() -> None:
    for model in ("llama", "gpt4"):
        rows = cycles(model)
        interval = median_interval([row["plugin"] / row["stock"] for row in rows])
        fast = statistics.quantiles([min(row.values()) for row in rows], n=3)[0]  # the fastest third of cycles
        quick = [row["plugin"] - row["stock"] for row in rows if max(row.values()) <= fast * 1.15]
        print(f"{model}: {len(rows)} cycles kept; plugin / stock {interval.median:.4f} [{interval.low:.4f}, "
              f"{interval.high:.4f}] (+-{(interval.high - interval.low) / 2 / interval.median:.2%}); arm means "
              f"stock {statistics.median(r['stock'] for r in rows):.1f} ms, plugin {statistics.median(r['plugin'] for r in rows):.1f} ms; "
              f"fast cycles (both arms <= {fast * 1.15:.1f} ms): {len(quick)}, plugin - stock median {statistics.median(quick):+.2f} ms")
        rounds = captures(model)
        if rounds:
            plugin, stock = rounds["plugin"], rounds["stock"]
            # Rounds mirror (stock, plugin), (plugin, stock): a pair of rounds gives one drift-cancelled ratio.
            pairs = [(plugin[i] * plugin[i + 1] / (stock[i] * stock[i + 1])) ** 0.5 for i in range(0, len(plugin), 2)]
            capture = median_interval(pairs)
            print(f"  capture s plugin {statistics.median(plugin):.3f}, stock {statistics.median(stock):.3f}; plugin / stock "
                  f"per pair of rounds {capture.median:.3f} [{capture.low:.3f}, {capture.high:.3f}] (n={len(pairs)})")


if __name__ == "__main__":
    sys.exit(main())
