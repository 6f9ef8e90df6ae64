source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s95 (issue 31): why the Llama-like model's check costs ~0.75 ms a step in s95a where a loop of checks takes
# 0.1 ms. (a) in-step timing of every check, counts of quick accepts / full checks / learns, GC per arm;
# (b) the plugin arm as a bound copy like plugin-no-check's, so the two differ in the check alone.
D="python3 docs/results/session-2026-12-04/drivers/diag.py bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
source "$(dirname "$0")/llama.sh"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
DIAG_TIME=1 DIAG_OUT=$F/timed.json MASTER_PORT=29991 timeout 200 $D --bench-out $F/timed \
  --bench-arms plugin,plugin-no-check --bench-cycles 3000 --bench-seconds 80 $LLAMA > $F/timed.log 2>&1
echo "timed rc=$?" >> $F/rc.txt; pack
DIAG_SWAP=1 DIAG_OUT=$F/swap.json MASTER_PORT=29992 timeout 270 $D --bench-out $F/swap \
  --bench-arms stock,plugin,plugin-no-check --bench-cycles 3000 --bench-seconds 160 $LLAMA > $F/swap.log 2>&1
echo "swap rc=$?" >> $F/rc.txt; pack
cat $F/rc.txt; python3 -c "import json; d=json.load(open('$F/timed.json')); print(json.dumps(d['checks'])); [print(k, {a: round(b, 1) for a, b in v.items()}) for k, v in d['stats'].items()]"
python3 -c "import json; d=json.load(open('$F/swap.json')); [print(k, {a: round(b, 1) for a, b in v.items()}) for k, v in d['stats'].items()]"
sed -n '/^| ratio/,/^$/p' $F/timed/bench.md $F/swap/bench.md
