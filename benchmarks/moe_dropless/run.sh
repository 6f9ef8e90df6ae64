#!/usr/bin/env bash
# Plugin / stock step time on the realistic MoE, dropless, through Megatron-LM's own pretrain_gpt.py.
# Usage: bash benchmarks/moe_dropless/run.sh OUT_DIR   (one GPU, MEGATRON_LM_DIR set to a Megatron-LM checkout; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
DATA=$(synthetic_data 4000)
$BENCH_STEPS --bench-out "$OUT/bench" --bench-arms stock,plugin --bench-cycles 400 --bench-seconds 140 \
  "$MEGATRON_LM_DIR/pretrain_gpt.py" $MOE_MODEL $DATA --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router moe_preprocess
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
