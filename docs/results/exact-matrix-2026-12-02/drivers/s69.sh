source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 30: (1) moedroppad_moe_fp8blockwise_te_2 again (s68's graphed launch lost its rendezvous port to a cell
# beside it); (2) Megatron-LM's pretrain_gpt.py alone, without the plugin, on gpt_layer_bf16_slotoffload_1's model with
# Megatron's fine-grained offload, eager: does the illegal memory access of s66-s68 come from Megatron's offload?
D=$(cd "$(dirname "$0")" && pwd); M=$D/..
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the wheel ships no Makefile (real-users README)
( timeout 220 python3 -m megatron_cg_plugin.cli matrix run $M/cells.json --out $F/matrix --only moedroppad_moe_fp8blockwise_te_2 > $F/matrix.log 2>&1; echo "matrix rc=$?" >> $F/rc.txt ) &
python3 - > $F/stock_flags.txt <<'PY'
from megatron_cg_plugin.testing import matrix
cell = {"model": "gpt", "scope": "layer", "precision": "bf16", "capture": "slot-offload", "mbs": "1"}
flags = [f for f in matrix.cell_flags(cell) if f != "--cg-slot-capture"]
print(" ".join(flags + "--mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --cuda-graph-impl none --deterministic-mode --train-iters 4".split()))
PY
for drop in 0.1 0.0; do ( RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + ${drop/./})) NVTE_CPU_OFFLOAD_V1=1 timeout 200 python3 $MEGATRON_LM_DIR/pretrain_gpt.py $(cat $F/stock_flags.txt) --hidden-dropout $drop --attention-dropout $drop > $F/stock_offload_dropout$drop.log 2>&1; echo "stock eager offload dropout $drop rc=$?" >> $F/rc.txt ) & done
wait
cat $F/rc.txt; grep -h ": exact\|: differs\|: failed" $F/matrix.log
for f in $F/stock_offload_*.log; do echo "== $f"; grep -h "illegal\|iteration *[0-9]*/" $f | tail -3 | cut -c1-250; done
rm -rf $F/matrix/*.logs $F/matrix/data
pack
