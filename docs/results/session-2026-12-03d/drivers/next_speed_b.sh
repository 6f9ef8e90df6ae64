source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Not run as a whole (its dropless half ran in session-2026-12-03e/drivers/s93.sh), issue 31, alone on the GPU (~9.5 min): plugin / stock on the
# tiny MoE (capture rounds; s89 asked for ~1500 cycles for +-2%) and on the realistic dropless MoE through
# Megatron-LM's pretrain_gpt.py (s90 asked for 141), each bounded by --bench-seconds with ~90-120 s left for
# start-up, captures and profiling (s89's tiny MoE spent up to 78 s outside its cycles, s90's dropless 116 s).
# 140 s of tiny-MoE cycles is ~820 cycles at s89's speed: about +-2.7%, not the +-2% s89 asked 1505 cycles for.
source "$(dirname "$0")/../../session-2026-12-03/drivers/moe_data.sh"
pack() { tar czf $OUT/results.tgz --exclude=f/data -C $OUT f; }  # the dataset stays out of what comes back
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
G="--cuda-graph-impl transformer_engine"
bench() { name=$1 limit=$2; shift 2; MASTER_PORT=$((29990 + ${#name})) timeout $limit $B --bench-out $F/$name "$@" \
  > $F/$name.log 2>&1; echo "$name rc=$?" >> $F/rc.txt; pack; }
bench tinymoe 230 --bench-arms plugin,stock --bench-cycles 2000 --bench-seconds 140 --bench-capture-rounds 12 \
  --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity $G
bench dropless 270 --bench-arms stock,plugin --bench-cycles 400 --bench-seconds 150 $MEGATRON_LM_DIR/pretrain_gpt.py \
  $(cat $F/moe_flags.txt) $DATA $G --cuda-graph-modules attn moe_router moe_preprocess
rm -rf $F/data; pack; cat $F/rc.txt
for n in tinymoe dropless; do echo "== $n"; sed -n '/^| ratio/,$p' $F/$n/bench.md 2>/dev/null; done
