#!/usr/bin/env bash
# The planner's graph-pool prediction against the measured pool (bf16, TE's graphs): the single-GPU farm cases
# (the realistic MoE's two through Megatron-LM's pretrain_gpt.py), then a short graphed run of each bench model
# (the 4-layer GPT, the Llama-like model, the tiny MoE, the dense ~1B, with the flags of benchmarks/gpt_4layer,
# llama_like, tiny_moe and dense_1b). Every run's report holds the prediction beside the measured pool;
# `megatron-cg plan <the flags>` prints the same prediction on CPU.
# Usage: bash benchmarks/planner_pool/run.sh OUT_DIR   (one GPU, run from the repository root, MEGATRON_LM_DIR set for the *_megatron_lm cases; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
C=tests/functional/test_cases
megatron-cg farm $C/gpt/tiny_gpt_attn $C/gpt/tiny_gpt_layer $C/gpt/tiny_gpt_real_data $C/moe/tiny_moe_router \
  $C/moe/tiny_moe_droppad $C/moe/tiny_moe_real_data_spm $C/gpt/gpt_12x1024_attn $C/gpt/gpt_12x1024_layer \
  $C/gpt/gpt_12x1024_attn_user_script $C/gpt/gpt_12x1024_layer_user_script \
  $C/moe/moe_8x2048_droppad_megatron_lm $C/moe/moe_8x2048_dropless_megatron_lm --fit-gpus 1 --out "$OUT/farm"
G="--cuda-graph-impl transformer_engine"
graphed_report gpt_4layer --cg-preset tiny-gpt --num-layers 4 $G
graphed_report llama_like $LLAMA_MODEL $G
graphed_report tiny_moe --cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 \
  --moe-pad-expert-input-to-capacity $G
graphed_report dense_1b $DENSE_1B_MODEL $G
python "$(dirname "$0")/../planner_table.py" "$OUT"/farm/*.graphed.report.json "$OUT"/runs/*.report.json | tee "$OUT/planner.md"
echo "summary: $OUT/planner.md (each row's report: benchmarks/planner_pool/result.json names it)"
