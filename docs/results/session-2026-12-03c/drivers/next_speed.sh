source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Ran as s89 (../../session-2026-12-03d), issue 31, alone on the GPU (~8-9 min): capture time over 12
# mirrored capture rounds (--bench-capture-rounds) on the two models whose single captures came out above
# 1.10x in s87 (dense 1B 1.22x, tiny MoE 1.14x), then the llama-like model, plugin / stock 1.039 in s87, again
# with its host operators profiled per arm (--bench-profile-dir) to name the gap, stock first this time and the
# outer arm alternating cycle by cycle (s87's plugin held the outer places in every cycle).
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
G="--cuda-graph-impl transformer_engine"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
bench() { name=$1 limit=$2; shift 2; MASTER_PORT=$((29930 + ${#name})) timeout $limit $B --bench-out $F/$name "$@" \
  > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; }
bench dense1b 150 --bench-arms plugin,stock --bench-cycles 40 --bench-capture-rounds 12 --cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 \
  --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 \
  --global-batch-size 4 --vocab-size 32768 $G
bench tinymoe 110 --bench-arms plugin,stock --bench-cycles 60 --bench-capture-rounds 12 --cg-preset tiny-moe --cuda-graph-modules attn moe \
  --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity $G
bench llama 240 --bench-arms stock,plugin --bench-cycles 600 --bench-profile-dir $F/llama_profile --cg-preset tiny-gpt --num-layers 3 \
  --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu \
  --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 \
  --max-position-embeddings 512 $G
python3 -m megatron_cg_plugin.bench_output --host-diff $F/llama_profile plugin stock > $F/llama_host_diff.txt 2>&1
rm -f $F/llama_profile/*.device_timeline.json.gz; pack; cat $F/rc.txt; head -25 $F/llama_host_diff.txt
for n in dense1b tinymoe llama; do echo "== $n"; sed -n '/^| ratio/,$p' $F/$n/bench.md 2>/dev/null; done
