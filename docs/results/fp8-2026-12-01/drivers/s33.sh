source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15 (s32 found two bugs: a forward hook replaced outputs; decomposing a saved Float8Tensor emptied the
# module's cached weight workspace): the probe's fp8 part (current, delayed, FP8 attention with and without
# the S-scale snapshot, weight caching) and three farm cases held to the TE-path goldens.
export MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
(timeout 420 python3 tests/functional/_probes/slots_probe.py --part fp8 --out $F/fp8.json > $F/fp8.log 2>&1; echo "fp8 probe rc=$?" >> $F/rc.txt) &
(timeout 420 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_tensorwise or tiny_gpt_slot_fp8_delayed" > $F/farm_fp8.log 2>&1; echo "farm fp8 rc=$?" >> $F/rc.txt) &
(NVTE_CPU_OFFLOAD_V1=1 timeout 420 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_offload" > $F/farm_fp8_offload.log 2>&1; echo "farm fp8 offload rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt
python3 -c "
import json; d=json.load(open('$F/fp8.json'))
for k, v in d.items():
    print(k, ('ERROR ' + v['error'][-700:]) if isinstance(v, dict) and 'error' in v else json.dumps(v, default=str)[:300])"
for f in $F/farm_fp8.log $F/farm_fp8_offload.log; do tail -n 4 $f; done
grep -h "Error" $F/farm*.log | cut -c1-400 | head -12
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('scope','replays','rejected','arena_bytes','host_arena_bytes','offloaded_bytes','pool_bytes','teardown_pool_bytes_left')})"; done
for f in $F/farm/*summary.json; do python3 -c "
import json; d=json.load(open('$f')); print({k:v for k,v in d.items() if not isinstance(v,(list,dict))})"; done
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs $F/farm/*eager.report.json
pack
