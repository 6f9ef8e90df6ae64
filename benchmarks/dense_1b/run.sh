#!/usr/bin/env bash
# Plugin / stock step and capture time on the dense ~1B model (GPU-bound).
# Usage: bash benchmarks/dense_1b/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
MODEL="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768"
$BENCH_STEPS --bench-out "$OUT/bench" --bench-arms plugin,stock --bench-cycles 40 --bench-capture-rounds 12 $MODEL --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
