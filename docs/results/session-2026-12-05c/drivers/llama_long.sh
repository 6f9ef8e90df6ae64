source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s102 (issue 31): the Llama-like model, plugin / stock only, for $CYCLE_SECONDS (default 450) s of cycles in
# one process: s100c's 1496 cycles left +-1.06%; about 2.6k cycles are needed for +-0.8%.
source "$(dirname "$0")/../../session-2026-12-04/drivers/llama.sh"
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29996
S=${CYCLE_SECONDS:-450}
uptime >> $F/gpu.txt  # the host's load before and after: the noise is the host's
timeout $((S + 100)) $B --bench-out $F/llama --bench-arms plugin,stock --bench-cycles 9000 --bench-seconds $S \
  $LLAMA > $F/llama.log 2>&1; echo "llama rc=$?" >> $F/rc.txt
nproc >> $F/gpu.txt; uptime >> $F/gpu.txt; pack
cat $F/rc.txt; sed -n '/^| arm/,/^$/p;/^| ratio/,$p' $F/llama/bench.md
