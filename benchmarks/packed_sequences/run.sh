#!/usr/bin/env bash
# Packed sequences (document masking, THD) through Megatron-LM's pretrain_gpt.py: eager against the plugin's
# graphs (stock Megatron cannot graph these microbatches). Production mode: not deterministic.
# Usage: bash benchmarks/packed_sequences/run.sh OUT_DIR   (one GPU, MEGATRON_LM_DIR set to a Megatron-LM checkout; nothing is written inside the repository)
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=1
source "$(dirname "$0")/../common.sh"
python -m megatron_cg_plugin.data.synthetic "$OUT/data" --documents 16000 --max-document-length 200 > "$OUT/data.txt"
MODEL="--num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention
  --num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
  --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --seq-length 4096 --max-position-embeddings 4096
  --micro-batch-size 1 --global-batch-size 4 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2
  --weight-decay 0.01 --clip-grad 1.0 --bf16 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234
  --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --train-iters 100000"
DATA="--data-path $OUT/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0
  --dataloader-inter-document-masking --cg-thd-max-seqs 128"
megatron-cg bench --bench-no-plot --bench-rounds 4 --bench-steps 6 --bench-arms eager,plugin --bench-out "$OUT/bench" \
  "$MEGATRON_LM_DIR/pretrain_gpt.py" $MODEL $DATA --cuda-graph-impl transformer_engine
echo "summary: $OUT/bench/bench.md (plugin / eager, step ms, peak allocated + graph pool)"
