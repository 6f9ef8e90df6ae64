source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s57: gpt_1b_slot_offload_user_script graphed != eager from step 3 (the first graphed step). Which change?
# The same case with the new per-stack offload rule and with the old per-frame rule (sitecustomize), in parallel.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_TIMEOUT_S=280
T="python3 -m pytest -q -rs -p no:cacheprovider"
OP=$PWD/docs/results/planner-fp8-2026-12-01/drivers/oldrule:$PYTHONPATH
(MEGATRON_CG_FARM_OUT=$F/farm-new timeout 330 $T tests/functional/test_farm.py -k gpt_1b_slot_offload_user_script > $F/farm_new.log 2>&1; echo "new rule rc=$?" >> $F/rc.txt) &
(CG_OLD_OFFLOAD_RULE=1 PYTHONPATH=$OP MEGATRON_CG_FARM_OUT=$F/farm-old timeout 330 $T tests/functional/test_farm.py -k gpt_1b_slot_offload_user_script > $F/farm_old.log 2>&1; echo "old rule rc=$?" >> $F/rc.txt) &
(MEGATRON_CG_SLOT_DEBUG=1 MEGATRON_CG_FARM_OUT=$F/farm-dbg timeout 330 $T tests/functional/test_farm.py -k gpt_1b_slot_offload_user_script > $F/farm_dbg.log 2>&1; echo "new rule, slot debug guard rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt
for n in new old dbg; do echo "== $n"; tail -n 1 $F/farm_$n.log; grep -h "differs\|Error" $F/farm_$n.log | cut -c1-600 | head -3; done
for f in $F/farm-*/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-2:], {k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','pool_bytes')})"; done
mkdir -p $F/farm; for d in $F/farm-*; do mkdir -p $F/farm/$(basename $d); cp $d/*summary.json $d/*graphed.report.json $F/farm/$(basename $d)/ 2>/dev/null; done; rm -rf $F/farm-*
pack
