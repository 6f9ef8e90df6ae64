#!/usr/bin/env bash
# Plugin / stock step and capture time on the tiny MoE, drop-and-pad, graphing attn moe.
# Usage: bash benchmarks/tiny_moe/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
set -euo pipefail
OUT=${1:?usage: bash benchmarks/tiny_moe/run.sh OUT_DIR}
mkdir -p "$OUT"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUDA_DEVICE_MAX_CONNECTIONS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
BENCH="megatron-cg bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
$BENCH --bench-out "$OUT/bench" --bench-arms plugin,stock --bench-cycles 4000 --bench-seconds 300 --bench-capture-rounds 12 \
  --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity \
  --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
