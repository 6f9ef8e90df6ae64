#!/usr/bin/env bash
# megatron-cg tune on the realistic MoE, dropless, through Megatron-LM's own pretrain_gpt.py on a real indexed
# dataset, then a bench of its top two setups against eager each.
# Usage: bash benchmarks/tune_moe/run.sh OUT_DIR   (one GPU, MEGATRON_LM_DIR set to a Megatron-LM checkout; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
: "${TUNE_SECONDS:=50}"  # the published run's tune budget (result.json); set TUNE_SECONDS to change it
: "${BENCH_SECONDS:=30}"  # and its benches' seconds
DATA=$(synthetic_data 4000)
tune_then_bench tune_moe "megatron-cg tune: realistic MoE, dropless, through pretrain_gpt.py" \
  "MoE 8 x 2048, 16 experts top 2, dropless, alltoall, seq 2048, Megatron-LM's pretrain_gpt.py" \
  "$MEGATRON_LM_DIR/pretrain_gpt.py" $MOE_MODEL $DATA --train-iters 1000 --cuda-graph-impl transformer_engine \
  --cuda-graph-modules attn moe_router moe_preprocess
