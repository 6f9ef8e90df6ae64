source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
# Issue 13: the GPU-busy fraction as the union of device activity, and the MoE capture without the stale-graph collect.
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-rounds 4 --bench-steps 8"
G="--cuda-graph-impl transformer_engine"
timeout 110 $B --bench-out $F/moe --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 \
  --moe-pad-expert-input-to-capacity $G > $F/moe.log 2>&1; echo "moe rc=$?"; grep -A8 "^| arm" $F/moe.log | head -12
timeout 110 $B --bench-out $F/gpt4 --cg-preset tiny-gpt --num-layers 4 $G > $F/gpt4.log 2>&1; echo "gpt4 rc=$?"; grep -A8 "^| arm" $F/gpt4.log | head -12
tar czf $OUT/results.tgz -C $OUT f
