source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 current scaling inside slot-shared capture: the slot probe (bitwise, wrap-ring2, 2 and 4
# variants) and two farm cases through Megatron's loop (goldens written by the run), one with in-graph offload.
export MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_UPDATE_GOLDEN=1
(timeout 240 python3 tests/functional/_probes/slots_probe.py --part fp8 --out $F/fp8_probe.json > $F/fp8_probe.log 2>&1; echo "fp8 probe rc=$?" >> $F/rc.txt) &
(timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py -k "tiny_gpt_slot_fp8 and not offload" > $F/farm_slot_fp8.log 2>&1; echo "farm slot fp8 rc=$?" >> $F/rc.txt) &
(timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_offload" > $F/farm_slot_fp8_offload.log 2>&1; echo "farm slot fp8 offload rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt
grep -E "^fp8/" $F/fp8_probe.log | cut -c1-330; python3 -c "
import json; d=json.load(open('$F/fp8_probe.json')); print(str(d.get('probe_error', ''))[-1500:]); [print(k, str(v.get('error',''))[-1200:]) for k, v in d.items() if isinstance(v, dict) and v.get('error')]"
for f in $F/farm_slot_fp8.log $F/farm_slot_fp8_offload.log; do echo "== $f"; grep -E "passed|failed|Error|error" $f | cut -c1-400 | tail -8; done
for c in tests/functional/test_cases/gpt/tiny_gpt_slot_fp8*; do cp $c/golden_values_dev_dgx_h200.json $F/$(basename $c).golden.json 2>/dev/null; done
ls $F/farm; for f in $F/farm/*.logs/*graphed*/stderr.log $F/farm/*graphed*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "Error|error" "$f" | tail -5 | cut -c1-500; }; done
rm -rf $F/farm/data
pack
