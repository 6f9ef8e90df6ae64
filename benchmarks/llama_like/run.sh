#!/usr/bin/env bash
# Plugin / stock step time on the Llama-like model: mirrored step cycles in one process, 400 s of them (BENCH_SECONDS).
# Usage: bash benchmarks/llama_like/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
set -euo pipefail
OUT=${1:?usage: bash benchmarks/llama_like/run.sh OUT_DIR}
mkdir -p "$OUT"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUDA_DEVICE_MAX_CONNECTIONS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
BENCH="megatron-cg bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
MODEL="--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512"
$BENCH --bench-out "$OUT/bench" --bench-arms plugin,stock --bench-cycles 9000 --bench-seconds ${BENCH_SECONDS:-400} \
  $MODEL --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
