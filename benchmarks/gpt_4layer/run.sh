#!/usr/bin/env bash
# Plugin / stock step time on the 4-layer GPT (tiny-gpt), with the plugin's check off as a third arm.
# Usage: bash benchmarks/gpt_4layer/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
$BENCH_STEPS --bench-out "$OUT/bench" --bench-arms stock,plugin,plugin-no-check --bench-cycles 1000 --bench-seconds 110 \
  --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
