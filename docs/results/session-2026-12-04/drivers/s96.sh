source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s96 (issue 31): the Llama-like model after the held state is read once a step (Megatron's DDP), stock /
# plugin / plugin-no-check in one process, up to 250 s of cycles (s95a: 1294 cycles in 300 s gave +-0.93%).
source "$(dirname "$0")/llama.sh"
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29993
timeout 360 $B --bench-out $F/llama --bench-arms stock,plugin,plugin-no-check --bench-cycles 3000 --bench-seconds 250 \
  $LLAMA > $F/llama.log 2>&1; echo "llama rc=$?" >> $F/rc.txt; pack
cat $F/rc.txt; sed -n '/^| arm/,/^$/p;/^| ratio/,$p' $F/llama/bench.md
# Then, if time is left: which replays read the held state (counts per arm), checks timed in the step.
D="python3 docs/results/session-2026-12-04/drivers/diag.py bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
DIAG_TIME=1 DIAG_OUT=$F/timed.json MASTER_PORT=29994 timeout 120 $D --bench-out $F/timed \
  --bench-arms plugin,plugin-no-check --bench-cycles 3000 --bench-seconds 40 $LLAMA > $F/timed.log 2>&1
echo "timed rc=$?" >> $F/rc.txt; pack
python3 -c "import json; d=json.load(open('$F/timed.json')); print(json.dumps(d['checks'])); print(d['stats'].get('plugin'))"
