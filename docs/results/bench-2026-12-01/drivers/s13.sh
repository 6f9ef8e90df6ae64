source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
# Issue 13: megatron-cg bench on the four benchmark models (one process each, arms interleaved inside it).
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-rounds 6"
G="--cuda-graph-impl transformer_engine"
bench() { name=$1; shift; timeout $1 $B --bench-out $F/$name "${@:2}" > $F/$name.log 2>&1; echo "$name rc=$?"; grep -A20 "^| arm" $F/$name.log | head -22; }
bench gpt4 110 --bench-steps 12 --cg-preset tiny-gpt --num-layers 4 $G
bench llama 120 --bench-steps 12 --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 \
  --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm \
  --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
bench moe 130 --bench-steps 12 --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 \
  --moe-pad-expert-input-to-capacity $G
bench dense1b 170 --bench-steps 8 --cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 \
  --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 \
  --vocab-size 32768 $G
tar czf $OUT/results.tgz -C $OUT f
