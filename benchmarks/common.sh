# Sourced by every benchmarks/*/run.sh: the output folder (the script's one argument), the
# deterministic environment the published figures used, the bench's step schedule, and the
# realistic MoE model both MoE benchmarks train. Nothing is written inside the repository.
set -euo pipefail
OUT=${1:?usage: bash $0 OUT_DIR}
mkdir -p "$OUT"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=${NVTE_ALLOW_NONDETERMINISTIC_ALGO:-0} CUDA_DEVICE_MAX_CONNECTIONS=1
if [ "$NVTE_ALLOW_NONDETERMINISTIC_ALGO" = 0 ]; then export CUBLAS_WORKSPACE_CONFIG=:4096:8; fi
BENCH_STEPS="megatron-cg bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
# The Llama-like model: 3 layers, h=512, GQA 8/2, SwiGLU, RMSNorm, RoPE, seq 512.
LLAMA_MODEL="--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512"
# The realistic MoE: 8 x 2048, 16 experts top 2, expert ffn 1408, GQA 16/4, SwiGLU, RMSNorm, RoPE, seq 2048, alltoall.
MOE_MODEL="--seq-length 2048 --max-position-embeddings 2048 --num-layers 8 --hidden-size 2048 --num-attention-heads 16
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16
  --eval-iters 0 --eval-interval 1000000 --log-interval 1 --log-num-zeros-in-grad --seed 1234
  --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --group-query-attention
  --num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
  --ffn-hidden-size 5632 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 1408
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm --micro-batch-size 1 --global-batch-size 4"

# synthetic_data DOCUMENTS: a small real indexed dataset under $OUT/data; prints the flags that read it.
synthetic_data() {
  python -m megatron_cg_plugin.data.synthetic "$OUT/data" --documents "$1" > "$OUT/data.txt"
  echo "--data-path $OUT/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0"
}
