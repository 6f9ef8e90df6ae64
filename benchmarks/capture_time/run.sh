#!/usr/bin/env bash
# Capture time, plugin / stock, over mirrored rounds of blocks (each block captures anew), on the four bench models.
# Usage: bash benchmarks/capture_time/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
BENCH="megatron-cg bench --bench-no-plot --bench-arms stock,plugin"
DENSE="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768"
$BENCH --bench-out "$OUT/gpt4" --bench-rounds 20 --bench-steps 8 --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine
$BENCH --bench-out "$OUT/llama" --bench-rounds 20 --bench-steps 8 $LLAMA_MODEL --cuda-graph-impl transformer_engine
$BENCH --bench-out "$OUT/moe" --bench-rounds 20 --bench-steps 8 --cg-preset tiny-moe --cuda-graph-modules attn moe \
  --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity --cuda-graph-impl transformer_engine
$BENCH --bench-out "$OUT/dense1b" --bench-rounds 12 --bench-steps 6 $DENSE --cuda-graph-impl transformer_engine
echo "summaries: $OUT/{gpt4,llama,moe,dense1b}/bench.md (capture plugin / stock in each ratio table)"
