source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
(MEGATRON_CG_FARM_OUT=$F timeout 240 python3 -m pytest tests/functional/test_slot_memory.py tests/functional/test_thd_partition.py -v -rs -p no:cacheprovider > $F/slots.log 2>&1; echo "slots rc=$?" >> $F/slots.log) &
timeout 200 python3 -m megatron_cg_plugin.pretrain_gpt --cg-preset tiny-gpt --cuda-graph-impl transformer_engine > $F/readme_launcher.log 2>&1; echo "readme launcher rc=$?"
grep -A5 "run report" $F/readme_launcher.log | head -5; grep -E "SignatureMismatch|Traceback" $F/readme_launcher.log | head -3
wait
grep -E "PASSED|FAILED|ERROR|SKIPPED|rc=" $F/slots.log; grep -E "^E " $F/slots.log | head
pack
