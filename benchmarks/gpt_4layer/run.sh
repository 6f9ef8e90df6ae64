#!/usr/bin/env bash
# Plugin / stock step time on the 4-layer GPT (tiny-gpt), with the plugin's check off as a third arm.
# Usage: bash benchmarks/gpt_4layer/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
set -euo pipefail
OUT=${1:?usage: bash benchmarks/gpt_4layer/run.sh OUT_DIR}
mkdir -p "$OUT"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUDA_DEVICE_MAX_CONNECTIONS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
BENCH="megatron-cg bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
$BENCH --bench-out "$OUT/bench" --bench-arms stock,plugin,plugin-no-check --bench-cycles 1000 --bench-seconds 110 \
  --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
