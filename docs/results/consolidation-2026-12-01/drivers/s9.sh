source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
# Issue 12: the slot probe after the plan drives capture_slotted, and what the banks' pool holds (one GPU, CP 1).
(timeout 200 torchrun --nproc-per-node 1 tests/functional/_probes/banks_probe.py --scenario bank-memory --out $F/bank_memory.json > $F/bank_memory.log 2>&1; echo "bank memory rc=$?" >> $F/bank_memory.log) &
MEGATRON_CG_FARM_OUT=$F/slots timeout 300 python3 -m pytest tests/functional/test_slot_memory.py -v -rs -p no:cacheprovider > $F/slots.log 2>&1; echo "slots rc=$?" >> $F/slots.log
wait
tail -2 $F/slots.log; grep -E "PASSED|FAILED|ERROR" $F/slots.log | head -30; grep -E "^E " $F/slots.log | head -20; tail -3 $F/bank_memory.log
tar czf $OUT/results.tgz -C $OUT f
