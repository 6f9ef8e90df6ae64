"""Recomputes the figures of this session's README that the bench does not print: per pair of arms the
median difference in ms over the cycles run wholly in the host's fast mode (every step of the cycle
under 1.2x the 5th percentile of all kept steps), and the plugin / stock ratio by which arm held the
cycle's outer places (two-arm runs). Run: python3 analyse.py [RESULTS_DIR] (no dependencies beyond the
standard library); RESULTS_DIR, this folder by default, holds one folder per call (s*/)."""

import gzip
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def cycles_of(bench: dict) -> list[list[tuple[str, float]]]:
    by_cycle: dict[int, list[tuple[str, float]]] = {}
    for step in bench["steps"]:
        if step["cycle"] >= bench["skip_steps"]:
            by_cycle.setdefault(step["cycle"], []).append((step["arm"], step["seconds"] * 1e3))
    return [by_cycle[c] for c in sorted(by_cycle)]


def geometric(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def main() -> None:
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for path in sorted(results.glob("s*/*.bench.json.gz")):
        bench = json.loads(gzip.decompress(path.read_bytes()))
        cycles = cycles_of(bench)
        arms = sorted({arm for cycle in cycles for arm, _ in cycle})
        steps = sorted(ms for cycle in cycles for _, ms in cycle)
        limit = 1.2 * steps[len(steps) // 20]
        fast = [cycle for cycle in cycles if max(ms for _, ms in cycle) < limit]
        print(f"{path.parent.name}/{path.name.split('.')[0]}: {len(cycles)} cycles, {len(fast)} fast (every step "
              f"< {limit:.1f} ms)")
        for a in arms:
            for b in arms:
                if a < b and fast:
                    diffs = [statistics.fmean(ms for arm, ms in c if arm == a) -
                             statistics.fmean(ms for arm, ms in c if arm == b) for c in fast]
                    print(f"  fast cycles, {a} - {b}: median {statistics.median(diffs):+.3f} ms")
        if arms == ["plugin", "stock"]:
            by_outer: dict[str, list[float]] = {}
            for cycle in cycles:
                means = {arm: geometric([ms for a, ms in cycle if a == arm]) for arm in arms}
                by_outer.setdefault(cycle[0][0], []).append(means["plugin"] / means["stock"])
            print("  plugin / stock by the outer arm: " + ", ".join(
                f"{arm} {statistics.median(r):.4f} (n={len(r)})" for arm, r in sorted(by_outer.items())))


if __name__ == "__main__":
    main()
