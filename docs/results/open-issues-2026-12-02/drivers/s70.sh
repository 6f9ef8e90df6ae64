source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s70 (correctness, side by side on one GPU): (1) issue 30's last matrix cell; (2) issue 33 item 5: Megatron-LM's
# MoE fine-grained-offloading case fitted to one GPU, attention graphed, eager vs graphed; (3) issue 34 item 1: what
# stock Megatron and the plugin do today with --dataloader-inter-document-masking and TE graphs (layer, attn).
D=$(cd "$(dirname "$0")" && pwd); M=$D/..
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the wheel ships no Makefile
( timeout 420 python3 -m megatron_cg_plugin.cli matrix run $M/../exact-matrix-2026-12-02/cells.json --out $F/matrix \
    --only llama_layer_fp8delayed_slotoffload_1 > $F/matrix.log 2>&1; echo "matrix rc=$?" >> $F/rc.txt ) &
( timeout 480 python3 -m megatron_cg_plugin.cli farm $M/cases/gpt3_moe_fine_grained_offloading_attn --fit-gpus 1 \
    --out $F/ep4 --steps 10 > $F/ep4.log 2>&1; echo "ep4 farm rc=$?" >> $F/rc.txt ) &
python3 -m megatron_cg_plugin.testing.datasets $F/data --documents 2000 > $F/data.txt 2>&1
python3 - > $F/docmask_flags.txt <<'PY'
from megatron_cg_plugin.testing import matrix
cell = {"model": "llama", "scope": "layer", "precision": "bf16", "capture": "te", "mbs": "1"}
print(" ".join(matrix.cell_flags(cell) + "--deterministic-mode --train-iters 10 --split 99,1,0".split()))
PY
DATA="--data-path $F/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --dataloader-inter-document-masking"
port=29710
probe() {  # name, runner (stock|plugin), extra flags
  local name=$1 runner=$2; shift 2; port=$((port + 1))
  if [ $runner = stock ]; then cmd="python3 $MEGATRON_LM_DIR/pretrain_gpt.py"; else cmd="python3 -m megatron_cg_plugin.cli run $MEGATRON_LM_DIR/pretrain_gpt.py"; fi
  ( RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 400 \
      $cmd $(cat $F/docmask_flags.txt) $DATA "$@" > $F/docmask_$name.log 2>&1; echo "docmask $name rc=$?" >> $F/rc.txt ) &
}
probe eager stock --cuda-graph-impl none
probe stock_layer stock --cuda-graph-impl transformer_engine
probe stock_attn stock --cuda-graph-impl transformer_engine --cuda-graph-modules attn
probe plugin_layer plugin --cuda-graph-impl transformer_engine --cg-report-out $F/docmask_plugin_layer.report.json
probe plugin_attn plugin --cuda-graph-impl transformer_engine --cuda-graph-modules attn --cg-report-out $F/docmask_plugin_attn.report.json
wait
cat $F/rc.txt; grep -h ": exact\|: differs\|: failed" $F/matrix.log; tail -5 $F/ep4.log
for f in $F/docmask_*.log; do echo "== $f"; grep -h "Error\|error:\|iteration *[0-9]*/" $f | tail -4 | cut -c1-300; done
rm -rf $F/matrix/*.logs $F/matrix/data $F/data
pack
