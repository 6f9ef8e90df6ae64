source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s101 (issue 31): the Llama-like model's contract check timed where it runs, inside the step, and at once
# again (diag.py, DIAG_TIME=1), plugin beside plugin-no-check for $CYCLE_SECONDS (default 40) s of cycles.
# Diagnosis only: the timing changes the step, so the run's ratios are not figures.
source "$(dirname "$0")/../../session-2026-12-04/drivers/llama.sh"
D="python3 docs/results/session-2026-12-04/drivers/diag.py bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29994
DIAG_TIME=1 DIAG_OUT=$F/timed.json timeout 150 $D --bench-out $F/timed --bench-arms plugin,plugin-no-check \
  --bench-cycles 3000 --bench-seconds ${CYCLE_SECONDS:-40} $LLAMA > $F/timed.log 2>&1
echo "timed rc=$?" >> $F/rc.txt; rm -rf $F/timed; pack
cat $F/rc.txt
python3 -c "import json; d=json.load(open('$F/timed.json')); print(json.dumps(d['checks'])); print(d['stats'].get('plugin'))"
