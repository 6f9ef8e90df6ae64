# Sourced by every benchmarks/*/run.sh: the output folder (the script's one argument), the
# deterministic environment the published figures used, the bench's step schedule, and the
# realistic MoE model both MoE benchmarks train. Nothing is written inside the repository.
set -euo pipefail
OUT=${1:?usage: bash $0 OUT_DIR}
mkdir -p "$OUT"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=${NVTE_ALLOW_NONDETERMINISTIC_ALGO:-0} CUDA_DEVICE_MAX_CONNECTIONS=1
if [ "$NVTE_ALLOW_NONDETERMINISTIC_ALGO" = 0 ]; then export CUBLAS_WORKSPACE_CONFIG=:4096:8; fi
BENCH_STEPS="megatron-cg bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
# The dense ~1B model: 16 layers x 2048, ffn 8192, seq 2048.
DENSE_1B_MODEL="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768"
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

# tune_then_bench NAME TITLE MODEL_WORDS [SCRIPT.py] FLAGS...: megatron-cg tune on the flags (TUNE_SECONDS of
# timing) into $OUT/tune; then its top two graphed setups, each against eager in a bench of its own
# (BENCH_SECONDS of step cycles; slot-shared setups in blocks) into $OUT/bench-0 and $OUT/bench-1; then
# $OUT/result.json, the summary benchmarks/NAME/result.json publishes (tune_check.py).
tune_then_bench() {
  local name=$1 title=$2 model=$3 check i
  shift 3
  check="$(dirname "${BASH_SOURCE[0]}")/tune_check.py"
  local script=()
  if [[ ${1:-} == *.py ]]; then script=("$1"); shift; fi
  local tune=(megatron-cg tune --tune-no-plot --tune-seconds "${TUNE_SECONDS:-60}" --tune-out "$OUT/tune" "${script[@]}" "$@")
  "${tune[@]}"
  for i in 0 1; do
    python "$check" bench-args "$OUT/tune/tune.json" "$i" "${BENCH_SECONDS:-40}" > "$OUT/bench-$i.args" || break
    local args=()
    mapfile -d '' args < "$OUT/bench-$i.args"
    megatron-cg bench --bench-no-plot --bench-out "$OUT/bench-$i" "${script[@]}" "${args[@]}"
  done
  local device commit
  device="1x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), one process, alone on the GPU"
  commit=${COMMIT:-$(git -C "$(dirname "$check")" rev-parse --short HEAD)}  # COMMIT: the code's, outside a checkout
  local command="${tune[*]//$OUT/OUT}"
  [ -z "${MEGATRON_LM_DIR:-}" ] || command=${command//$MEGATRON_LM_DIR/\$MEGATRON_LM_DIR}
  python "$check" summary "$OUT" "$name" "$title" "$model" "$command" "$commit" "$device" > "$OUT/result.json"
  echo "summary: $OUT/tune/tune.md (the tune's table); $OUT/result.json (with the two benches)"
}

# graphed_report NAME [SCRIPT.py] FLAGS...: a short graphed run of the flags (5 steps: Megatron's warmup steps,
# the capture, replays) through the launcher, or through megatron-cg run with a training script, whose run
# report $OUT/runs/NAME.report.json holds the planner's prediction beside the measured graph pool and, with
# --cg-slot-capture, the GPU and pinned host arenas (docs/report.md). Its output goes to $OUT/runs/NAME.log.
graphed_report() {
  local name=$1 run=(python -m megatron_cg_plugin.pretrain_gpt)
  shift
  if [[ ${1:-} == *.py ]]; then run=(megatron-cg run "$1"); shift; fi
  mkdir -p "$OUT/runs"
  "${run[@]}" "$@" --train-iters 5 --cg-report-out "$OUT/runs/$name.report.json" > "$OUT/runs/$name.log" 2>&1 ||
    { echo "$name failed: $OUT/runs/$name.log" >&2; return 1; }
}
