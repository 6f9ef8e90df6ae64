#!/usr/bin/env bash
# Capture time, plugin / stock, over mirrored rounds of blocks (each block captures anew), on the four bench models.
# Usage: bash benchmarks/capture_time/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
set -euo pipefail
OUT=${1:?usage: bash benchmarks/capture_time/run.sh OUT_DIR}
mkdir -p "$OUT"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUDA_DEVICE_MAX_CONNECTIONS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
BENCH="megatron-cg bench --bench-no-plot --bench-arms stock,plugin"
LLAMA="--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512"
DENSE="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768"
$BENCH --bench-out "$OUT/gpt4" --bench-rounds 20 --bench-steps 8 --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine
$BENCH --bench-out "$OUT/llama" --bench-rounds 20 --bench-steps 8 $LLAMA --cuda-graph-impl transformer_engine
$BENCH --bench-out "$OUT/moe" --bench-rounds 20 --bench-steps 8 --cg-preset tiny-moe --cuda-graph-modules attn moe \
  --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity --cuda-graph-impl transformer_engine
$BENCH --bench-out "$OUT/dense1b" --bench-rounds 12 --bench-steps 6 $DENSE --cuda-graph-impl transformer_engine
echo "summaries: $OUT/{gpt4,llama,moe,dense1b}/bench.md (capture plugin / stock in each ratio table)"
