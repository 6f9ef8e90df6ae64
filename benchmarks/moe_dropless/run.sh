#!/usr/bin/env bash
# Plugin / stock step time on the realistic MoE, dropless, through Megatron-LM's own pretrain_gpt.py.
# Usage: bash benchmarks/moe_dropless/run.sh OUT_DIR   (one GPU, MEGATRON_LM_DIR set to a Megatron-LM checkout; nothing is written inside the repository)
set -euo pipefail
OUT=${1:?usage: bash benchmarks/moe_dropless/run.sh OUT_DIR}
mkdir -p "$OUT"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUDA_DEVICE_MAX_CONNECTIONS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
BENCH="megatron-cg bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
# The realistic MoE: 8 x 2048, 16 experts top 2, expert ffn 1408, GQA 16/4, SwiGLU, RMSNorm, RoPE, seq 2048, alltoall.
MODEL="--seq-length 2048 --max-position-embeddings 2048 --num-layers 8 --hidden-size 2048 --num-attention-heads 16
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16
  --eval-iters 0 --eval-interval 1000000 --log-interval 1 --log-num-zeros-in-grad --seed 1234
  --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --group-query-attention
  --num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
  --ffn-hidden-size 5632 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 1408
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm --micro-batch-size 1 --global-batch-size 4"
python -m megatron_cg_plugin.data.synthetic "$OUT/data" --documents 4000 > "$OUT/data.txt"
DATA="--data-path $OUT/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0"
$BENCH --bench-out "$OUT/bench" --bench-arms stock,plugin --bench-cycles 400 --bench-seconds 140 \
  "$MEGATRON_LM_DIR/pretrain_gpt.py" $MODEL $DATA --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
