source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Written for the next device call (not run yet), issue 31, alone on the GPU (~8 min): the Llama-like model with
# the quick accept, stock / plugin / plugin-no-check, up to 300 s of cycles (s94's 110 s on a slow host gave
# +-2.78%; the bench asked for 664 cycles for +-2%).
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29995
timeout 400 $B --bench-out $F/llama --bench-arms stock,plugin,plugin-no-check --bench-cycles 3000 --bench-seconds 300 \
  --cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights \
  --disable-bias-linear --seq-length 512 --max-position-embeddings 512 --cuda-graph-impl transformer_engine \
  > $F/llama.log 2>&1; echo "llama rc=$?" >> $F/rc.txt; pack
cat $F/rc.txt; sed -n '/^| arm/,/^$/p;/^| ratio/,$p' $F/llama/bench.md
