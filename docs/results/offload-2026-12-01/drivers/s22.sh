source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14 (2nd): probe, the three slot-offload farm cases (goldens), then the bench with and without offload flags.
export MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_UPDATE_GOLDEN=1
(timeout 240 python3 tests/functional/_probes/slots_probe.py --part offload --out $F/offload.json > $F/offload.log 2>&1; echo "probe rc=$?" >> $F/rc.txt) &
(timeout 300 python3 -m pytest -q -p no:cacheprovider tests/functional/test_farm.py -k "tiny_gpt_slot_offload or tiny_moe_slot_offload or gpt_12x1024_slot_offload" > $F/farm.log 2>&1; echo "farm rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; grep -E "^offload" $F/offload.log | cut -c1-300; tail -4 $F/farm.log
for c in tests/functional/test_cases/*/*slot_offload*; do cp $c/golden_values_dev_dgx_h200.json $F/farm/$(basename $c).golden.json 2>/dev/null; done
M="--num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 100,0,0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
OFF="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
export NVTE_CPU_OFFLOAD_V1=1
timeout 270 python3 -m megatron_cg_plugin.cli bench --bench-arms eager,stock,slot,slot-offload --bench-rounds 4 --bench-steps 8 --bench-out $F/bench-offload --bench-no-plot $M $OFF > $F/bench-offload.log 2>&1; echo "bench A rc=$?"
grep -A30 "^| arm" $F/bench-offload.log | head -40 || tail -20 $F/bench-offload.log
timeout 110 python3 -m megatron_cg_plugin.cli bench --bench-arms stock,slot --bench-rounds 2 --bench-steps 6 --bench-out $F/bench-plain --bench-no-plot $M > $F/bench-plain.log 2>&1; echo "bench B rc=$?"
grep -A12 "^| arm" $F/bench-plain.log | head -14 || tail -20 $F/bench-plain.log
rm -rf $F/farm/data $F/farm/*.logs
pack
