source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: Megatron's delayed offload flush observed after slot-shared replays (golden written from this run).
export MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_UPDATE_GOLDEN=1 NVTE_CPU_OFFLOAD_V1=1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/functional/test_farm.py -k "tiny_moe_slot_offload_delayed" > $F/farm.log 2>&1; echo "farm rc=$?"
tail -3 $F/farm.log
cp tests/functional/test_cases/moe/tiny_moe_slot_offload_delayed/golden_values_dev_dgx_h200.json $F/farm/golden.json
python3 -c "
import json; r=json.load(open('$F/farm/tiny_moe_slot_offload_delayed.graphed.report.json')); s=r['scopes'][0]
print({k: s.get(k) for k in ('scope','replays','rejected','arena_bytes','host_arena_bytes','offloaded_bytes','offload_groups_flushed','teardown_pool_bytes_left')})"
rm -rf $F/farm/data $F/farm/*.logs
pack
