#!/usr/bin/env bash
# Plugin / stock step time on the Llama-like model: mirrored step cycles in one process, 400 s of them (BENCH_SECONDS).
# Usage: bash benchmarks/llama_like/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
$BENCH_STEPS --bench-out "$OUT/bench" --bench-arms plugin,stock --bench-cycles 9000 --bench-seconds ${BENCH_SECONDS:-400} \
  $LLAMA_MODEL --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
