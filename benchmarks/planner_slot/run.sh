#!/usr/bin/env bash
# Slot-shared capture's pool, GPU arenas and pinned host arenas, predicted against measured: the slot farm cases,
# then a short graphed run of each larger configuration: 12 x 1024 graphing attn mlp without offload (the farm's
# gpt_12x1024_slot_offload_user_script is the same model with offload), the dense ~1B under FP8 tensorwise scaling
# (bf16 first and last layers) graphing attn mlp, without and with offload (held out: predicted before it first
# ran), and the realistic MoE (8 x 2048, 16 experts, drop-and-pad) graphing attn moe. Every run's report holds the
# prediction beside the measured figures.
# Usage: bash benchmarks/planner_slot/run.sh OUT_DIR   (one GPU, run from the repository root; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
export NVTE_CPU_OFFLOAD_V1=1
C=tests/functional/test_cases
megatron-cg farm $C/gpt/tiny_gpt_slot_offload $C/moe/tiny_moe_slot_offload $C/moe/tiny_moe_slot_offload_delayed \
  $C/gpt/gpt_12x1024_slot_offload_user_script $C/gpt/gpt_1b_slot_offload_user_script $C/gpt/tiny_gpt_slot_fp8_tensorwise \
  $C/gpt/tiny_gpt_slot_fp8_delayed_user_script $C/gpt/tiny_gpt_slot_fp8_offload $C/gpt/tiny_gpt_slot_fp8_attention_user_script \
  --fit-gpus 1 --out "$OUT/farm"
SLOT="--cuda-graph-impl transformer_engine --cg-slot-capture"
OFFLOAD="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
GPT_12X1024="--num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --position-embedding-type rope --micro-batch-size 1 --global-batch-size 8 --lr 3e-4
  --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16
  --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --split 100,0,0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234
  --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0"
DENSE_1B_FP8="$DENSE_1B_MODEL --fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16"
MOE_8X2048="--cg-preset tiny-gpt --num-layers 8 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
  --group-query-attention --num-query-groups 4 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1
  --global-batch-size 4 --vocab-size 32000 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 1408
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm --swiglu --disable-bias-linear"
graphed_report gpt_12x1024_slot $GPT_12X1024 $SLOT --cuda-graph-modules attn mlp
graphed_report dense_1b_fp8_tensorwise_slot $DENSE_1B_FP8 $SLOT --cuda-graph-modules attn mlp
graphed_report dense_1b_fp8_tensorwise_slot_offload $DENSE_1B_FP8 $SLOT --cuda-graph-modules attn mlp $OFFLOAD
graphed_report moe_8x2048_droppad_slot $MOE_8X2048 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity \
  --deterministic-mode $SLOT --cuda-graph-modules attn moe
python "$(dirname "$0")/../planner_table.py" "$OUT"/farm/*.graphed.report.json "$OUT"/runs/*.report.json | tee "$OUT/planner.md"
echo "summary: $OUT/planner.md (each row's report: benchmarks/planner_slot/result.json names it)"
