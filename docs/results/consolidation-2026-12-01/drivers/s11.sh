source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
# Issue 12: is the second 258 MiB segment fragmentation (the freed workspace segment split by the next layer's
# capture)? The same probe with blocks above 200 MiB never split.
P=tests/functional/_probes/banks_probe.py
mkdir -p $F/nosplit; PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:200 timeout 200 torchrun --nproc-per-node 1 $P --scenario bank-memory --out $F/nosplit/bank_memory.json > $F/nosplit/bank_memory.log 2>&1; echo "rc=$?"
tar czf $OUT/results.tgz -C $OUT f
