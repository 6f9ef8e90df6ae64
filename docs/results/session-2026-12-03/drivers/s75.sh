source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s75 (issue 31; not run in its session, ran as s87 in ../../session-2026-12-03c), alone on the GPU, one bench after the other: the four benchmark models of docs/performance.md
# (s13's flags) under the step schedule, plugin / stock in mirrored cycles (A B B A).
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4 --bench-arms plugin,stock"
G="--cuda-graph-impl transformer_engine"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
bench() { name=$1 limit=$2 cycles=$3; shift 3; MASTER_PORT=$((29920 + ${#name})) timeout $limit $B --bench-cycles $cycles \
  --bench-out $F/$name "$@" > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; }
bench gpt4 120 250 --cg-preset tiny-gpt --num-layers 4 $G
bench llama 110 300 --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 \
  --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm \
  --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
bench tinymoe 120 300 --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 \
  --moe-pad-expert-input-to-capacity $G
bench dense1b 170 100 --cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 \
  --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 \
  --vocab-size 32768 $G
pack; cat $F/rc.txt
for n in gpt4 llama tinymoe dense1b; do echo "== $n"; grep -A6 "^| ratio" $F/$n/bench.md 2>/dev/null; grep -h "Error\|error:" $F/$n.log | tail -3 | cut -c1-300; done
