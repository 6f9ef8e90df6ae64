# Sourced by s74 and s77 after common.sh: the synthetic indexed dataset, the realistic MoE's flags (8 x 2048,
# 16 experts top-2, seq 2048, mbs 1, alltoall, grouped GEMM) in $F/moe_flags.txt, $DATA and one rank's variables.
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile  # the wheel ships no Makefile
python3 -m megatron_cg_plugin.testing.datasets $F/data --documents 4000 > $F/data.txt 2>&1
python3 - > $F/moe_flags.txt <<'PY'
from megatron_cg_plugin.testing import matrix
flags = matrix.cell_flags({"model": "moe-dropless", "scope": "layer", "precision": "bf16", "capture": "te", "mbs": "1"})
flags[flags.index("--num-layers") + 1] = "8"
print(" ".join(flags))
PY
DATA="--data-path $F/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
