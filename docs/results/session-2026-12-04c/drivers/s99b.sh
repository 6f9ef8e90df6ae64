source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Written for the next device call (not run yet), issue 31, alone on the GPU (~5 min): dense 1B's capture time,
# plugin / stock over 24 mirrored capture rounds (12 pairs; s89's 12 rounds gave 1.023 [0.978, 1.178]), with
# a few step cycles beside them.
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-interleave steps --bench-skip-steps 4"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29997
timeout 330 $B --bench-out $F/dense1b --bench-arms plugin,stock --bench-cycles 20 --bench-capture-rounds 24 \
  --cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 \
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 \
  --cuda-graph-impl transformer_engine > $F/dense1b.log 2>&1
echo "dense1b rc=$?" >> $F/rc.txt; pack
cat $F/rc.txt; sed -n '/^| arm/,/^$/p;/^| ratio/,$p;/apture/p' $F/dense1b/bench.md
