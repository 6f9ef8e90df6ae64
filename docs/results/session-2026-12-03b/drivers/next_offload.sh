source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Ran as s85 (../../session-2026-12-03c): issue 32's 6.7B case, alone on the GPU (~5 min).
# The offload-reload-waits-for-its-copy patch (not yet confirmed): three eager runs with Megatron's own offload,
# steps 1-3 each; without the patch 3 of 4 such runs had a wrong step-1 gradient norm (right: 43.539).
python3 docs/results/session-2026-12-03b/drivers/offload_step1_argv.py $F/offload > $F/offload_argv.txt 2>> $F/flags.err
for n in 1 2 3; do
  NVTE_CPU_OFFLOAD_V1=1 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29950 + n)) timeout 150 \
    python3 $(cat $F/offload_argv.txt) > $F/offload_eager_$n.log 2>&1; echo "offload eager $n rc=$?" >> $F/rc.txt
  grep -h "iteration  *1/" $F/offload_eager_$n.log | grep -o "grad norm: [0-9.]*" >> $F/offload_step1_grad_norms.txt
done
cat $F/rc.txt $F/offload_step1_grad_norms.txt
rm -rf $F/offload/data; pack
