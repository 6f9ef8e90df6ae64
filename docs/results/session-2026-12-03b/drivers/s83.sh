source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# s83 (issue 34, speed; the last 4 device minutes of this session, so smaller than s74b: 4 rounds x 6 steps, 4 microbatches),
# realistic size through Megatron-LM's own pretrain_gpt.py: 8 layers x 2048 (GQA 16/4, SwiGLU, RMSNorm, RoPE), seq
# 4096, document masking on many short documents (16-200 tokens: ~38 a sample), eager vs the plugin's graphs (stock
# cannot graph packed batches: the bench refuses its arm), interleaved in one process.
printf 'default:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
python3 -c "from megatron_cg_plugin.testing import datasets as d; print(d.write_indexed_dataset('$F/data/synthetic_text_document', d.synthetic_documents(16000, vocab_size=1024, seed=1234, max_length=200), eod=1023))" > $F/data.txt 2>&1
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=1  # production mode: TE keeps fused THD attention at L = --seq-length (s80)
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29904
MODEL="--num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention
  --num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
  --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --seq-length 4096 --max-position-embeddings 4096
  --micro-batch-size 1 --global-batch-size 4 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2
  --weight-decay 0.01 --clip-grad 1.0 --bf16 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234
  --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --train-iters 100000"
DATA="--data-path $F/data/synthetic_text_document --tokenizer-type NullTokenizer --vocab-size 1024 --split 99,1,0
  --dataloader-inter-document-masking --cg-thd-max-seqs 128"
timeout 200 python3 -m megatron_cg_plugin.cli bench --bench-rounds 4 --bench-steps 6 --bench-arms eager,plugin --bench-no-plot \
  --bench-out $F/packed $MEGATRON_LM_DIR/pretrain_gpt.py $MODEL $DATA --cuda-graph-impl transformer_engine > $F/packed.log 2>&1
echo "packed bench rc=$?" >> $F/rc.txt; rm -rf $F/data; pack; cat $F/rc.txt; cat $F/packed/bench.md; tail -3 $F/packed.log
