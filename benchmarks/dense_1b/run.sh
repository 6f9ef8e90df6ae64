#!/usr/bin/env bash
# Plugin / stock step and capture time on the dense ~1B model (GPU-bound).
# Usage: bash benchmarks/dense_1b/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
$BENCH_STEPS --bench-out "$OUT/bench" --bench-arms plugin,stock --bench-cycles 40 --bench-capture-rounds 12 $DENSE_1B_MODEL --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
