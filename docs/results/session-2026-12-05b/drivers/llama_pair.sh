source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s100c/s101 (issue 31): the Llama-like model, plugin / stock only (two arms: 4 steps a cycle, where s96's three
# took 6), up to $CYCLE_SECONDS (default 300) s of cycles, in a process of its own.
source "$(dirname "$0")/../../session-2026-12-04/drivers/llama.sh"
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29995
timeout 400 $B --bench-out $F/llama2 --bench-arms plugin,stock --bench-cycles 5000 --bench-seconds ${CYCLE_SECONDS:-300} \
  $LLAMA > $F/llama2.log 2>&1; echo "llama2 rc=$?" >> $F/rc.txt; pack
cat $F/rc.txt; sed -n '/^| arm/,/^$/p;/^| ratio/,$p' $F/llama2/bench.md
