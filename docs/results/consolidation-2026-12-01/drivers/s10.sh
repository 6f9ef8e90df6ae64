source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
# Issue 12: where the banks' 256 MiB allocations come from (Python frames), deterministic and not.
P=tests/functional/_probes/banks_probe.py
(timeout 200 torchrun --nproc-per-node 1 --master-port 29511 $P --scenario bank-memory --out $F/bank_memory.json > $F/bank_memory.log 2>&1; echo "rc=$?" >> $F/bank_memory.log) &
mkdir -p $F/nondet; NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 timeout 200 torchrun --nproc-per-node 1 --master-port 29512 $P --scenario bank-memory --out $F/nondet/bank_memory.json > $F/nondet/bank_memory.log 2>&1; echo "rc=$?" >> $F/nondet/bank_memory.log
wait
tail -1 $F/bank_memory.log $F/nondet/bank_memory.log
tar czf $OUT/results.tgz -C $OUT f
