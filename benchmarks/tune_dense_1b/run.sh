#!/usr/bin/env bash
# megatron-cg tune on the dense ~1B model, then a bench of its top two setups against eager each.
# Usage: bash benchmarks/tune_dense_1b/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
: "${TUNE_SECONDS:=45}"  # the published run's tune budget (result.json); set TUNE_SECONDS to change it
tune_then_bench tune_dense_1b "megatron-cg tune: dense 1B" "Dense ~1B, 16 x 2048, ffn 8192, seq 2048, mbs 1" \
  $DENSE_1B_MODEL --cuda-graph-impl transformer_engine
