source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s91 (issue 31), alone on the GPU, after the contract check's cheaper process-group read (one read of a layer's collection
# per check): plugin / stock on two host-bound benchmark models with the cycles s87/s89 asked for +-2%, the Llama-like
# model with s89's flags (stock first, 600 cycles) and capture rounds; sized to the 455 s of device time left
# (three calls found no machine, ~100 s each), so not the tiny MoE.
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
G="--cuda-graph-impl transformer_engine"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
bench() { name=$1 limit=$2; shift 2; MASTER_PORT=$((29970 + ${#name})) timeout $limit $B --bench-out $F/$name "$@" \
  > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; pack; }  # packed after each: a cut call keeps the rest
bench llama 150 --bench-arms stock,plugin --bench-cycles 600 --bench-capture-rounds 12 --cg-preset tiny-gpt \
  --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --group-query-attention \
  --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear \
  --seq-length 512 --max-position-embeddings 512 $G
bench gpt4 110 --bench-arms plugin,stock --bench-cycles 400 --cg-preset tiny-gpt --num-layers 4 $G
cat $F/rc.txt
for n in llama gpt4; do echo "== $n"; sed -n '/^| arm | step/,/^$/p;/^| ratio/,$p' $F/$n/bench.md 2>/dev/null; done
