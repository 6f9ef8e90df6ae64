source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 30: (1) the support matrix (cells.json: megatron-cg matrix plan) eager vs graphed through Megatron-LM's
# pretrain_gpt.py, 5 cells side by side, with allocator traces of every capture (drivers/trace, named by cell);
# (2) the dropout probe (slot capture puts the generators back; without it the masks move); (3) the issue's FP8
# current-scaling shape as a farm case (dropout 0.1), golden values written by this run.
D=$(cd "$(dirname "$0")" && pwd); M=$D/..
export MEGATRON_CG_FARM_TIMEOUT_S=300
( MEMTRACE_DIR=$F/traces PYTHONPATH=$D/trace:$PYTHONPATH timeout 520 python3 -m megatron_cg_plugin.cli matrix run $M/cells.json --out $F/matrix --jobs 5 > $F/matrix.log 2>&1; echo "matrix rc=$?" >> $F/rc.txt ) &
( timeout 200 python3 tests/functional/_probes/slots_probe.py --part dropout --out $F/dropout_probe.json > $F/dropout_probe.log 2>&1; echo "probe rc=$?" >> $F/rc.txt
  C=gpt_5x2048_slot_fp8_tensorwise_megatron_lm
  MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/farm timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py -k $C > $F/farm_$C.log 2>&1; echo "farm $C rc=$?" >> $F/rc.txt
  cp tests/functional/test_cases/gpt/$C/golden_values_dev_dgx_h200.json $F/golden_$C.json 2>/dev/null ) &
wait
cat $F/rc.txt; grep -h "dropout/" $F/dropout_probe.log; tail -n 3 $F/farm_*.log | cut -c1-600
grep -h ": exact\|: differs\|: failed\|: refused" $F/matrix.log
python3 - $F <<'PY'
import json, sys
rows = json.load(open(f"{sys.argv[1]}/matrix/matrix.json"))["rows"]
for r in rows:
    if r["result"] in ("differs", "failed"):
        print("==", r["name"], r["result"], r.get("first_differing_step"), [p[:700] for p in r.get("problems", [])][:2])
PY
mkdir -p $F/logtails; for d in $F/matrix/*.logs; do n=$(basename $d .logs); f=$(ls $d/*/attempt_0/0/stdout.log 2>/dev/null | head -1); [ -n "$f" ] && tail -c 6000 $f > $F/logtails/$n.txt; done
rm -rf $F/matrix/*.logs $F/matrix/data $F/farm/*.logs $F/farm/data
pack
