source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
# Issue 12, second part: the slot probe (plan-driven capture_slotted, one contract), the banks' pool on one GPU,
# and every single-GPU farm case after Megatron took over handing out the graphs.
(MEGATRON_CG_FARM_OUT=$F/slots timeout 300 python3 -m pytest tests/functional/test_slot_memory.py -v -rs -p no:cacheprovider > $F/slots.log 2>&1; echo "slots rc=$?" >> $F/slots.log;
 true;
 timeout 200 torchrun --nproc-per-node 1 tests/functional/_probes/banks_probe.py --scenario bank-memory --out $F/bank_memory.json > $F/bank_memory.log 2>&1; echo "bank memory rc=$?" >> $F/bank_memory.log) &
MEGATRON_CG_FARM_OUT=$F timeout 500 python3 -m pytest tests/functional/test_farm.py tests/functional/test_capture_lifecycle.py -n 3 -v -rs -p no:cacheprovider -k "not dp2 and not hybrid_cp" > $F/farm.log 2>&1
echo "farm rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED" $F/farm.log | tail -20; grep -E "^E " $F/farm.log | head -20
wait
tail -3 $F/slots.log; grep -E "PASSED|FAILED|ERROR" $F/slots.log | head -30; grep -E "^E " $F/slots.log | head; tail -3 $F/bank_memory.log
grep -h "left in graph pools" $F/*/*report* $F/*report* 2>/dev/null | sort | uniq -c | head
tar czf $OUT/results.tgz -C $OUT f --exclude='*.logs'
