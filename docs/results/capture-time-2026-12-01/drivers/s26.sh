source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: the stale-graph check after a failed capture (lifecycle probes), then capture time and
# plugin/stock step time, stock and plugin arms only, 8 rounds.
export MEGATRON_CG_FARM_OUT=$F/lifecycle
timeout 200 python3 -m pytest -q -rs tests/functional/test_capture_lifecycle.py > $F/lifecycle.log 2>&1; echo "lifecycle rc=$?"
tail -5 $F/lifecycle.log
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-arms stock,plugin"
G="--cuda-graph-impl transformer_engine"
bench() { name=$1; shift; timeout $1 $B --bench-out $F/$name "${@:2}" > $F/$name.log 2>&1; echo "$name rc=$?"; grep -A12 "^| arm" $F/$name.log | head -12; }
bench gpt4 120 --bench-rounds 8 --bench-steps 10 --cg-preset tiny-gpt --num-layers 4 $G
bench llama 120 --bench-rounds 8 --bench-steps 10 --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 \
  --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm \
  --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
bench moe 130 --bench-rounds 8 --bench-steps 10 --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 \
  --moe-pad-expert-input-to-capacity $G
pack
