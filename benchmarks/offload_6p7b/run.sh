#!/usr/bin/env bash
# In-graph offload on GPT-3 6.7B's shape (32 x 4096): slot without offload, copies between replays with
# window 1, and Megatron's own offload with TE's graphs, in one process.
# Usage: bash benchmarks/offload_6p7b/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
export NVTE_CPU_OFFLOAD_V1=1
MODEL="--cg-preset tiny-gpt --num-layers 32 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768
  --use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
  --main-grads-dtype bf16"
OFFLOAD="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
megatron-cg bench --bench-no-plot --bench-rounds 4 --bench-steps 5 --bench-out "$OUT/bench" \
  --bench-arms slot,slot-offload-staged-w1,stock $MODEL --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp \
  $OFFLOAD
echo "summary: $OUT/bench/bench.md (step ms, graph pool + GPU arenas, pinned host arenas per arm)"
