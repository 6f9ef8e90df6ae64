source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s94 (issue 31), alone on the GPU: the contract check's quick accept (learned call shape, one pass per kind) on
# the two host-bound models s93 found the check to cost 2.4% on (Llama-like) and s92 ~1.7% (4-layer GPT):
# stock, plugin and plugin-no-check in one process, mirrored cycles of three arms.
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
G="--cuda-graph-impl transformer_engine"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
bench() { name=$1 limit=$2; shift 2; MASTER_PORT=$((29990 + ${#name})) timeout $limit $B --bench-out $F/$name "$@" \
  > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; pack; }
bench llama 190 --bench-arms plugin,stock,plugin-no-check --bench-cycles 1000 --bench-seconds 110 \
  --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights \
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
bench gpt4 180 --bench-arms stock,plugin,plugin-no-check --bench-cycles 1000 --bench-seconds 110 \
  --cg-preset tiny-gpt --num-layers 4 $G
cat $F/rc.txt
for n in llama gpt4; do echo "== $n"; sed -n '/^| arm/,/^$/p;/^| ratio/,$p' $F/$n/bench.md 2>/dev/null; done
