source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 31, not run yet: the step schedule (--bench-interleave steps) on s72's realistic MoE (8 x 2048, 16 experts
# top-2, seq 2048, mbs 1, 4 microbatches, alltoall, grouped GEMM), arms plugin-recording, plugin, stock (plugin /
# stock the inner pair of each A B C C B A cycle). Drop-and-pad `attn moe` through the launcher (~138 ms steps:
# 160 cycles, ~2.3 min of steps); dropless `attn moe_router moe_preprocess` through Megatron-LM's pretrain_gpt.py
# (~262 ms: 90 cycles, ~2.4 min). bench.md's ratio table gives each ratio's 95% interval and the cycles for +-1%/+-2%.
D=$(cd "$(dirname "$0")" && pwd); M=$D/..
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the wheel ships no Makefile
python3 -m megatron_cg_plugin.testing.datasets $F/data --documents 4000 > $F/data.txt 2>&1
python3 - > $F/moe_flags.txt <<'PY'
from megatron_cg_plugin.testing import matrix
flags = matrix.cell_flags({"model": "moe-dropless", "scope": "layer", "precision": "bf16", "capture": "te", "mbs": "1"})
flags[flags.index("--num-layers") + 1] = "8"
print(" ".join(flags))
PY
DATA="--data-path $F/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0"
BENCH="--bench-interleave steps --bench-skip-steps 4 --bench-arms plugin-recording,plugin,stock --bench-no-plot"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
MASTER_PORT=29911 timeout 290 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-cycles 160 --bench-out $F/droppad \
  $(cat $F/moe_flags.txt) $DATA --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity \
  --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe > $F/droppad.log 2>&1
echo "droppad rc=$?" >> $F/rc.txt; pack
MASTER_PORT=29912 timeout 300 python3 -m megatron_cg_plugin.cli bench $BENCH --bench-cycles 90 --bench-out $F/dropless \
  $MEGATRON_LM_DIR/pretrain_gpt.py $(cat $F/moe_flags.txt) $DATA \
  --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess > $F/dropless.log 2>&1
echo "dropless (script) rc=$?" >> $F/rc.txt; rm -rf $F/data; pack
cat $F/rc.txt; cat $F/droppad/bench.md $F/dropless/bench.md 2>/dev/null | head -60; tail -5 $F/dropless.log
