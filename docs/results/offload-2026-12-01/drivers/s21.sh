source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: slot probe (offload + edge cases), the three slot-offload farm cases (goldens written), then the bench.
export MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_UPDATE_GOLDEN=1
(timeout 300 python3 tests/functional/_probes/slots_probe.py --part offload --out $F/offload.json > $F/offload.log 2>&1; echo "probe rc=$?" >> $F/rc.txt) &
(timeout 420 python3 -m pytest -x -q -p no:cacheprovider tests/functional/test_farm.py -k "tiny_gpt_slot_offload or tiny_moe_slot_offload" > $F/farm_tiny.log 2>&1; echo "farm tiny rc=$?" >> $F/rc.txt) &
(timeout 420 python3 -m pytest -x -q -p no:cacheprovider tests/functional/test_farm.py -k "gpt_12x1024_slot_offload" > $F/farm_big.log 2>&1; echo "farm big rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; grep -E "^offload" $F/offload.log | cut -c1-400; tail -5 $F/farm_tiny.log $F/farm_big.log
for c in tests/functional/test_cases/*/*slot_offload*; do cp $c/golden_values_dev_dgx_h200.json $F/$(basename $c).golden.json 2>/dev/null; done
M="--num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 100,0,0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
OFF="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
NVTE_CPU_OFFLOAD_V1=1 timeout 170 python3 -m megatron_cg_plugin.cli bench --bench-arms eager,stock,slot,slot-offload --bench-rounds 2 --bench-steps 8 --bench-out $F/bench-offload --bench-no-plot $M $OFF > $F/bench-offload.log 2>&1; echo "bench rc=$?"
tail -25 $F/bench-offload.log
pack
