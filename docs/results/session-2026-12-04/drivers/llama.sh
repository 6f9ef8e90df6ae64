# Sourced by s95.sh and s96.sh: the Llama-like benchmark model (the flags of ../../session-2026-12-03e/drivers/next_llama.sh).
LLAMA="--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512 --cuda-graph-impl transformer_engine"
