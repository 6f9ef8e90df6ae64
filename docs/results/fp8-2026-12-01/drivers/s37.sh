source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: the review fixes (CPU-only so far) on the GPU: the probe's fp8 part and two slot FP8 farm cases against
# the TE-path goldens; and FP8 slot capture through a user's own script on an indexed dataset (golden written here).
export MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
(timeout 330 python3 tests/functional/_probes/slots_probe.py --part fp8 --out $F/fp8.json > $F/fp8.log 2>&1; echo "fp8 probe rc=$?" >> $F/rc.txt) &
(timeout 330 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_tensorwise" > $F/farm_tw.log 2>&1; echo "farm tensorwise rc=$?" >> $F/rc.txt) &
(NVTE_CPU_OFFLOAD_V1=1 timeout 330 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_offload" > $F/farm_off.log 2>&1; echo "farm offload rc=$?" >> $F/rc.txt) &
(MEGATRON_CG_UPDATE_GOLDEN=1 timeout 330 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_delayed_user_script" > $F/farm_user.log 2>&1; echo "farm user script rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt
python3 -c "
import json; d=json.load(open('$F/fp8.json'))
for k, v in d.items():
    print(k, ('ERROR ' + v['error'][-500:]) if isinstance(v, dict) and 'error' in v else json.dumps({a: b for a, b in v.items() if a in ('exact','exact_frames','frames','fp8_state_equal','always_refreshed_exact_frames','uncovered_bytes')}, default=str))"
for f in $F/farm_tw.log $F/farm_off.log $F/farm_user.log; do tail -n 3 $f; done
grep -h "Error" $F/farm*.log | cut -c1-400 | head -8
G=tests/functional/test_cases/gpt
cp $G/tiny_gpt_slot_fp8_delayed_user_script/golden_values_dev_dgx_h200.json $F/user_script.golden.json
python3 -c "
import json
a=json.load(open('$F/user_script.golden.json'))['lm loss']['values']; b=json.load(open('$G/tiny_gpt_fp8_delayed/golden_values_dev_dgx_h200.json'))['lm loss']['values']
print('user script vs tiny_gpt_fp8_delayed golden, lm loss equal at every step:', a == b, list(a.items())[:3], list(b.items())[:3])"
for f in $F/farm/*summary.json; do python3 -c "
import json; d=json.load(open('$f')); print({k:v for k,v in d.items() if not isinstance(v,(list,dict))})"; done
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs $F/farm/*eager.report.json $F/farm/*metrics.json
pack
