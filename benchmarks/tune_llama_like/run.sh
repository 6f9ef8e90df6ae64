#!/usr/bin/env bash
# megatron-cg tune on the Llama-like model, then a bench of its top two setups against eager each.
# Usage: bash benchmarks/tune_llama_like/run.sh OUT_DIR   (one GPU; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
: "${TUNE_SECONDS:=40}"  # the published run's tune budget (result.json); set TUNE_SECONDS to change it
tune_then_bench tune_llama_like "megatron-cg tune: Llama-like model" \
  "Llama-like, 3 layers, h=512, GQA 8/2, SwiGLU, RMSNorm, RoPE, seq 512" $LLAMA_MODEL --cuda-graph-impl transformer_engine
