source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Ran as s86 (../../session-2026-12-03c): issue 31, alone on the GPU: what recording costs, recording and
# plugin alone (A B B A) so no third arm sits beside either, on the launch-bound 4-layer GPT and on the drop-and-pad
# MoE of s74/s77.
source "$(dirname "$0")/../../session-2026-12-03/drivers/moe_data.sh"
BENCH="--bench-interleave steps --bench-skip-steps 4 --bench-arms plugin-recording,plugin --bench-no-plot"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
MASTER_PORT=29941 timeout 150 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-cycles 300 --bench-out $F/gpt4 \
  --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine > $F/gpt4.log 2>&1; echo "gpt4 rc=$?" >> $F/rc.txt
MASTER_PORT=29942 timeout 240 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-cycles 150 --bench-out $F/droppad \
  $(cat $F/moe_flags.txt) $DATA --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity \
  --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe > $F/droppad.log 2>&1; echo "droppad rc=$?" >> $F/rc.txt
rm -rf $F/data; pack; cat $F/rc.txt; grep -A4 "^| ratio" $F/gpt4/bench.md $F/droppad/bench.md
