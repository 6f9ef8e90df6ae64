#!/usr/bin/env bash
# Plugin / stock step time on the realistic MoE, drop-and-pad (capacity 1.0, padded), graphing attn moe.
# Usage: bash benchmarks/moe_droppad/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
DATA=$(synthetic_data 4000)
$BENCH_STEPS --bench-out "$OUT/bench" --bench-arms plugin,stock --bench-cycles 110 $MOE_MODEL $DATA \
  --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --cuda-graph-impl transformer_engine --cuda-graph-modules attn moe
echo "summary: $OUT/bench/bench.md (plugin / stock in its ratio table; everything in $OUT/bench/bench.json)"
