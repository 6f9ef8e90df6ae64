source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: plugin / stock step and capture time with more mirrored pairs (stock and plugin arms only).
export MEGATRON_CG_FARM_OUT=$F/lifecycle
timeout 150 python3 -m pytest -q -rs tests/functional/test_capture_lifecycle.py -k "after_the_failed or garbage" > $F/lifecycle.log 2>&1; echo "lifecycle rc=$?"; tail -3 $F/lifecycle.log
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-arms stock,plugin"
G="--cuda-graph-impl transformer_engine"
bench() { name=$1; shift; timeout $1 $B --bench-out $F/$name "${@:2}" > $F/$name.log 2>&1; echo "$name rc=$?"; sed -n '/^| arm/,/^| ratio/p;/plugin \/ stock/p' $F/$name/bench.md | grep -v "D2H\|^| stock | 0\|^| plugin | 0\|^| --- | --- | --- | --- |$"; }
bench gpt4 130 --bench-rounds 20 --bench-steps 8 --cg-preset tiny-gpt --num-layers 4 $G
bench llama 130 --bench-rounds 20 --bench-steps 8 --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 \
  --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm \
  --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
bench moe 130 --bench-rounds 20 --bench-steps 8 --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 \
  --moe-pad-expert-input-to-capacity $G
bench dense1b 170 --bench-rounds 12 --bench-steps 6 --cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 \
  --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 \
  --vocab-size 32768 $G
pack
