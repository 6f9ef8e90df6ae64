source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s73: s72's dropless bench again through Megatron-LM's pretrain_gpt.py, now that the bench's train_step stand-in
# carries __wrapped__ (s72: install()'s signature check, which runs after the bench's patch for a script, refused it).
D=$(cd "$(dirname "$0")" && pwd); M=$D/..
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
python3 -m megatron_cg_plugin.testing.datasets $F/data --documents 4000 > $F/data.txt 2>&1
python3 - > $F/moe_flags.txt <<'PY'
from megatron_cg_plugin.testing import matrix
flags = matrix.cell_flags({"model": "moe-dropless", "scope": "layer", "precision": "bf16", "capture": "te", "mbs": "1"})
flags[flags.index("--num-layers") + 1] = "8"
print(" ".join(flags))
PY
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29903
timeout 270 python3 -m megatron_cg_plugin.cli bench --bench-rounds 6 --bench-steps 10 --bench-arms plugin,plugin-recording,stock \
  --bench-no-plot --bench-out $F/dropless $MEGATRON_LM_DIR/pretrain_gpt.py $(cat $F/moe_flags.txt) \
  --data-path $F/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0 \
  --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess > $F/dropless.log 2>&1
echo "dropless (script) rc=$?" >> $F/rc.txt; rm -rf $F/data; pack; cat $F/rc.txt; cat $F/dropless/bench.md; tail -3 $F/dropless.log
