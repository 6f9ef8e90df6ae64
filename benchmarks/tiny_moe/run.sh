#!/usr/bin/env bash
# Plugin / stock step and capture time on the tiny MoE, drop-and-pad, graphing attn moe.
# Usage: bash benchmarks/tiny_moe/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
$BENCH_STEPS --bench-out "$OUT/bench" --bench-arms plugin,stock --bench-cycles 4000 --bench-seconds 300 --bench-capture-rounds 12 \
  --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity \
  --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
