source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Written for the next device call (not run yet), issue 31, alone on the GPU (~9 min): plugin / stock on the
# Llama-like model (stock first, capture rounds) and the 4-layer GPT, each with more cycles than the bench
# asked for +-2% and --bench-seconds so a slow host still ends with bench.json (s91's benches ran into
# their timeouts and wrote none).
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
G="--cuda-graph-impl transformer_engine"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
bench() { name=$1 limit=$2; shift 2; MASTER_PORT=$((29990 + ${#name})) timeout $limit $B --bench-out $F/$name "$@" \
  > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; pack; }
bench llama 230 --bench-arms stock,plugin --bench-cycles 1000 --bench-seconds 150 --bench-capture-rounds 12 \
  --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights \
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
bench gpt4 220 --bench-arms plugin,stock --bench-cycles 1000 --bench-seconds 150 --cg-preset tiny-gpt --num-layers 4 $G
cat $F/rc.txt
for n in llama gpt4; do echo "== $n"; sed -n '/^| ratio/,$p' $F/$n/bench.md 2>/dev/null; done
