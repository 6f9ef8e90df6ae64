source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s93 (issue 31), alone on the GPU: (1) is the Llama-like gap the contract check? stock, plugin (with the
# check's new quick accept) and plugin-no-check in one process, mirrored cycles of three arms; (2) the realistic
# dropless MoE through Megatron-LM's pretrain_gpt.py, plugin / stock, with the cycles s90 asked for (141).
source "$(dirname "$0")/../../session-2026-12-03/drivers/moe_data.sh"
pack() { tar czf $OUT/results.tgz --exclude=f/data -C $OUT f; }  # the dataset stays out of what comes back
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
G="--cuda-graph-impl transformer_engine"
bench() { name=$1 limit=$2; shift 2; MASTER_PORT=$((29990 + ${#name})) timeout $limit $B --bench-out $F/$name "$@" \
  > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; pack; }
bench llama 200 --bench-arms stock,plugin,plugin-no-check --bench-cycles 1000 --bench-seconds 120 \
  --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights \
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512 $G
bench dropless 280 --bench-arms stock,plugin --bench-cycles 400 --bench-seconds 140 $MEGATRON_LM_DIR/pretrain_gpt.py \
  $(cat $F/moe_flags.txt) $DATA $G --cuda-graph-modules attn moe_router moe_preprocess
rm -rf $F/data; pack; cat $F/rc.txt
for n in llama dropless; do echo "== $n"; sed -n '/^| arm/,/^$/p;/^| ratio/,$p' $F/$n/bench.md 2>/dev/null; done
