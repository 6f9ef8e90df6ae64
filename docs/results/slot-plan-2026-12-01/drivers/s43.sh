source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# After the review fixes: slot boundaries adopt Megatron's sample arguments as static inputs, parameter-gradient
# buffers only for reached parameters. The slot-memory functional tests (variants, rings, offload) and the MoE
# attn slot farm case (boundary beside the plan, eager == graphed, golden).
export MEGATRON_CG_FARM_OUT=$F/farm NVTE_CPU_OFFLOAD_V1=1
T="python3 -m pytest -q -rs -p no:cacheprovider"
(timeout 200 $T tests/functional/test_slot_memory.py > $F/slot_memory.log 2>&1; echo "slot memory rc=$?" >> $F/rc.txt) &
(timeout 200 $T tests/functional/test_farm.py -k "tiny_moe_slot_offload and not delayed" > $F/farm_moe.log 2>&1; echo "farm moe rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; tail -n 3 $F/slot_memory.log; tail -n 2 $F/farm_moe.log; grep -h "FAILED\|Error" $F/*.log | cut -c1-300 | head -10
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','boundary_bytes','pool_bytes')}, {k: r.get(k) for k in ('predicted_pool_bytes','predicted_arena_bytes','predicted_boundary_bytes')})"; done
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
