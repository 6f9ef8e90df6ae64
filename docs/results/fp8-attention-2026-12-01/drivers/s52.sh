source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 dot-product attention (delayed scaling) through a user's script with --cg-slot-capture, after the
# autograd walk keeps the wrappers it visits (s51: FusedAttnFunc's node skipped in some frames by a reused id).
# Golden written only if eager == graphed. Beside it: an FP8 slot case, an offload slot case, the slot probe tests.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
(MEGATRON_CG_UPDATE_GOLDEN=1 timeout 300 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_attention_user_script" > $F/farm_fp8_attention.log 2>&1; echo "farm fp8 attention rc=$?" >> $F/rc.txt) &
(timeout 300 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_delayed_user_script or tiny_gpt_slot_offload or tiny_moe_slot_offload" --deselect "tests/functional/test_farm.py::test_graphed_matches_eager_and_golden[tiny_moe_slot_offload_delayed]" > $F/farm_slot.log 2>&1; echo "farm slot rc=$?" >> $F/rc.txt) &
(timeout 300 $T tests/functional/test_slot_memory.py > $F/slot_memory.log 2>&1; echo "slot memory rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; tail -n 2 $F/farm_fp8_attention.log $F/farm_slot.log $F/slot_memory.log; grep -h "FAILED\|Error\|SKIPPED" $F/*.log | cut -c1-500 | head -12
cp tests/functional/test_cases/gpt/tiny_gpt_slot_fp8_attention_user_script/golden_values_dev_dgx_h200.json $F/golden_fp8_attention.json 2>/dev/null
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','pool_bytes','teardown_pool_bytes_left','failure')}, {k: r.get(k) for k in ('predicted_arena_bytes',)})"; done
for f in $F/farm/*summary.json; do python3 -c "
import json; d=json.load(open('$f')); print({k: d.get(k) for k in ('case','losses_equal','steps','replays','rejected','eager_ms','graphed_ms')})"; done
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
