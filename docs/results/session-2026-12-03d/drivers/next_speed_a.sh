source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Ran as s92 (results in session-2026-12-03e/s92), issue 31, alone on the GPU (~9 min): plugin / stock on the
# Llama-like model (stock first, capture rounds) and the 4-layer GPT, each with more cycles than the bench
# asked for +-2% and --bench-seconds so a slow host still ends with bench.json (s91's benches ran into
# their timeouts and wrote none); each timeout leaves ~80-100 s for start-up, captures and profiling (s91's
# Llama-like bench spent ~70 s outside its cycles). With --bench-profile-dir on the Llama-like model the
# Python profile now includes the backward (on the profiled thread).
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
G="--cuda-graph-impl transformer_engine"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
bench() { name=$1 limit=$2; shift 2; MASTER_PORT=$((29990 + ${#name})) timeout $limit $B --bench-out $F/$name "$@" \
  > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; pack; }
bench llama 240 --bench-arms stock,plugin --bench-cycles 1000 --bench-seconds 140 --bench-capture-rounds 12 \
  --bench-profile-dir $F/llama_profile \
  --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights \
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
bench gpt4 230 --bench-arms plugin,stock --bench-cycles 1000 --bench-seconds 150 --cg-preset tiny-gpt --num-layers 4 $G
python3 -m megatron_cg_plugin.bench_output --host-diff $F/llama_profile plugin stock > $F/llama_host_diff.txt 2>&1
rm -f $F/llama_profile/*.device_timeline.json.gz; pack; cat $F/rc.txt; sed -n '/^python calls/,+30p' $F/llama_host_diff.txt
for n in llama gpt4; do echo "== $n"; sed -n '/^| ratio/,$p' $F/$n/bench.md 2>/dev/null; done
