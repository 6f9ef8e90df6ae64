"""Capture time plugin / stock per pair of mirrored rounds, from the bench's blocks (the bench's own
ratios are of step times): python capture_ratios.py <run>/<model>/bench.json ..."""
import json
import math
import statistics
import sys

for path in sys.argv[1:]:
    blocks = json.load(open(path))["blocks"]
    seconds = {(b["round"], b["arm"]): b["capture_seconds"] for b in blocks}
    rounds = sorted({b["round"] for b in blocks})
    pairs = [math.sqrt(seconds[(r, "plugin")] / seconds[(r, "stock")] * seconds[(r + 1, "plugin")] / seconds[(r + 1, "stock")])
             for r in rounds[::2]]
    print(f"{path}: capture plugin / stock {statistics.median(pairs):.3f} [{min(pairs):.3f}, {max(pairs):.3f}] (n={len(pairs)})")
