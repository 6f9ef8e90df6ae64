source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
# Issue 13: smoke of megatron-cg bench on the tiny GPT (4 layers).
timeout 240 python3 -m megatron_cg_plugin.cli bench --bench-rounds 2 --bench-steps 6 --bench-no-plot --bench-out $F/smoke \
  --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine > $F/smoke.log 2>&1; echo "smoke rc=$?"
grep -E "block |profiled|megatron-cg bench|Error|error" $F/smoke.log | head -30; tail -25 $F/smoke.log
tar czf $OUT/results.tgz -C $OUT f
