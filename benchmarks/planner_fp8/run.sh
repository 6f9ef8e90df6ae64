#!/usr/bin/env bash
# The planner's graph-pool prediction under FP8 against the measured pool (TE's graphs): the FP8 farm cases, then
# a short graphed run of each held-out configuration (predicted before it first ran): the Llama-like model under
# delayed scaling, the dense ~1B under tensorwise scaling with bf16 first and last layers, 12 x 1024 graphing attn
# under delayed scaling, 6 x 1536 (GQA, SwiGLU) under tensorwise scaling, and 6 x 2048 with FP8 dot-product
# attention through a user's script (cuDNN runs FP8 attention only non-deterministically). Every run's report
# holds the prediction beside the measured pool.
# Usage: bash benchmarks/planner_fp8/run.sh OUT_DIR   (one GPU, run from the repository root; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
C=tests/functional/test_cases
megatron-cg farm $C/gpt/tiny_gpt_fp8_delayed $C/gpt/tiny_gpt_fp8_tensorwise \
  $C/gpt/tiny_gpt_fp8_attention_user_script --fit-gpus 1 --out "$OUT/farm"
G="--cuda-graph-impl transformer_engine"
D8="--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max"
T8="--fp8-format hybrid --fp8-recipe tensorwise"
GPT_2048="--cg-preset tiny-gpt --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --vocab-size 32000"
graphed_report llama_like_fp8_delayed $LLAMA_MODEL $D8 $G
graphed_report dense_1b_fp8_tensorwise_bf16_ends $DENSE_1B_MODEL $T8 --first-last-layers-bf16 \
  --num-layers-at-start-in-bf16 1 --num-layers-at-end-in-bf16 1 $G
graphed_report gpt_12x1024_fp8_delayed_attn $GPT_2048 --num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 \
  --num-attention-heads 16 --global-batch-size 8 $D8 $G --cuda-graph-modules attn
graphed_report gpt_6x1536_gqa_swiglu_fp8_tensorwise $GPT_2048 --num-layers 6 --hidden-size 1536 --ffn-hidden-size 4096 \
  --num-attention-heads 12 --group-query-attention --num-query-groups 4 --swiglu --disable-bias-linear \
  --global-batch-size 4 $T8 $G
NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 graphed_report gpt_6x2048_fp8_attention \
  tests/functional/_scripts/user_pretrain_gpt_fp8_attention.py $GPT_2048 --num-layers 6 --hidden-size 2048 \
  --ffn-hidden-size 8192 --num-attention-heads 16 --global-batch-size 4 $D8 $G
python "$(dirname "$0")/../planner_table.py" "$OUT"/farm/*.graphed.report.json "$OUT"/runs/*.report.json | tee "$OUT/planner.md"
echo "summary: $OUT/planner.md (each row's report: benchmarks/planner_fp8/result.json names it)"
