source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s77 (issue 31), alone on the GPU: s74 found plugin / stock 1.032 [1.019, 1.042] on the drop-and-pad MoE with the
# recording arm first in each cycle (plugin after it at 151.6 ms, after stock at 148.7). Plugin and stock alone here
# (A B B A), with each arm's host operators profiled (--bench-profile-dir; bench_output --host-diff names a gap);
# then the 4-layer GPT of docs/performance.md.
source "$(dirname "$0")/moe_data.sh"
BENCH="--bench-interleave steps --bench-skip-steps 4 --bench-arms plugin,stock --bench-no-plot"
MASTER_PORT=29931 timeout 170 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-cycles 100 --bench-out $F/droppad \
  --bench-profile-dir $F/profile $(cat $F/moe_flags.txt) $DATA --moe-expert-capacity-factor 1.0 \
  --moe-pad-expert-input-to-capacity --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe > $F/droppad.log 2>&1
echo "droppad rc=$?" >> $F/rc.txt
python3 -m megatron_cg_plugin.bench_output --host-diff $F/profile plugin stock > $F/host_diff.txt 2>&1
rm -f $F/profile/*.device_timeline.json.gz; rm -rf $F/data; pack
MASTER_PORT=29932 timeout 100 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-cycles 200 --bench-out $F/gpt4 \
  --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine > $F/gpt4.log 2>&1
echo "gpt4 rc=$?" >> $F/rc.txt; pack
cat $F/rc.txt; grep -A5 "^| ratio" $F/droppad/bench.md $F/gpt4/bench.md; head -25 $F/host_diff.txt
