source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s74 (issue 31), alone on the GPU: the step schedule (--bench-interleave steps) on s72's realistic MoE (8 x 2048,
# 16 experts top-2, seq 2048, mbs 1, 4 microbatches, alltoall, grouped GEMM) on a real indexed dataset; arms
# plugin-recording, plugin, stock in mirrored cycles (A B C C B A). Drop-and-pad `attn moe` through the launcher,
# dropless `attn moe_router moe_preprocess` through Megatron-LM's pretrain_gpt.py (megatron-cg bench SCRIPT).
source "$(dirname "$0")/moe_data.sh"
BENCH="--bench-interleave steps --bench-skip-steps 4 --bench-arms plugin-recording,plugin,stock --bench-no-plot"
MASTER_PORT=29911 timeout 250 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-cycles 140 --bench-out $F/droppad \
  $(cat $F/moe_flags.txt) $DATA --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity \
  --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe > $F/droppad.log 2>&1
echo "droppad rc=$?" >> $F/rc.txt; pack
MASTER_PORT=29912 timeout 265 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-cycles 80 --bench-out $F/dropless \
  $MEGATRON_LM_DIR/pretrain_gpt.py $(cat $F/moe_flags.txt) $DATA \
  --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess > $F/dropless.log 2>&1
echo "dropless (script) rc=$?" >> $F/rc.txt; rm -rf $F/data; pack
cat $F/rc.txt; cat $F/droppad/bench.md $F/dropless/bench.md 2>/dev/null | head -70
for f in $F/droppad.log $F/dropless.log; do echo "== $f"; grep -h "Error\|error:" $f | tail -4 | cut -c1-400; tail -3 $f | cut -c1-300; done
