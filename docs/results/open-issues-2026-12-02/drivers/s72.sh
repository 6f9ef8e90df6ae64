source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s72 (issue 31), alone on the GPU, one bench after the other: the realistic MoE (8 x 2048, 16 experts top-2, seq 2048,
# mbs 1, 4 microbatches, alltoall, grouped GEMM) on a real indexed dataset; arms plugin, plugin-recording, stock
# interleaved in one process. Drop-and-pad `attn moe` through the launcher; dropless `attn moe_router
# moe_preprocess` through Megatron-LM's own pretrain_gpt.py (megatron-cg bench SCRIPT).
D=$(cd "$(dirname "$0")" && pwd); M=$D/..
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the wheel ships no Makefile
python3 -m megatron_cg_plugin.testing.datasets $F/data --documents 4000 > $F/data.txt 2>&1
python3 - > $F/moe_flags.txt <<'PY'
from megatron_cg_plugin.testing import matrix
cell = {"model": "moe-dropless", "scope": "layer", "precision": "bf16", "capture": "te", "mbs": "1"}
flags = matrix.cell_flags(cell)
flags[flags.index("--num-layers") + 1] = "8"
print(" ".join(flags))
PY
DATA="--data-path $F/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0"
BENCH="--bench-rounds 8 --bench-steps 10 --bench-arms plugin,plugin-recording,stock --bench-no-plot"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
MASTER_PORT=29901 timeout 230 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-out $F/droppad $(cat $F/moe_flags.txt) $DATA \
  --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --cuda-graph-impl transformer_engine \
  --cuda-graph-modules attn moe > $F/droppad.log 2>&1; echo "droppad rc=$?" >> $F/rc.txt; pack
MASTER_PORT=29902 timeout 240 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-out $F/dropless $MEGATRON_LM_DIR/pretrain_gpt.py \
  $(cat $F/moe_flags.txt) $DATA --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess \
  > $F/dropless.log 2>&1; echo "dropless (script) rc=$?" >> $F/rc.txt; pack
cat $F/rc.txt; cat $F/droppad/bench.md $F/dropless/bench.md 2>/dev/null | head -60; tail -5 $F/dropless.log
