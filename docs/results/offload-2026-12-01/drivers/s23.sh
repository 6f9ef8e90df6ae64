source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14 (3rd): copies between replays (staging ring, the new default): probe, the three farm cases against
# their goldens (written by s22 with in-graph copies), then the bench with both copy modes.
export MEGATRON_CG_FARM_OUT=$F/farm NVTE_CPU_OFFLOAD_V1=1
(timeout 200 python3 tests/functional/_probes/slots_probe.py --part offload --out $F/offload.json > $F/offload.log 2>&1; echo "probe rc=$?" >> $F/rc.txt) &
for k in tiny_gpt_slot_offload tiny_moe_slot_offload gpt_12x1024_slot_offload; do
  (timeout 230 python3 -m pytest -q -p no:cacheprovider tests/functional/test_farm.py -k "$k" > $F/farm_$k.log 2>&1; echo "farm $k rc=$?" >> $F/rc.txt) &
done
wait
cat $F/rc.txt; grep -E "^offload" $F/offload.log | cut -c1-260; for k in tiny_gpt_slot_offload tiny_moe_slot_offload gpt_12x1024_slot_offload; do tail -2 $F/farm_$k.log; done
M="--num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 100,0,0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
OFF="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
timeout 280 python3 -m megatron_cg_plugin.cli bench --bench-arms stock,slot,slot-offload,slot-offload-in-graph --bench-rounds 4 --bench-steps 8 --bench-out $F/bench-offload --bench-no-plot $M $OFF > $F/bench-offload.log 2>&1; echo "bench rc=$?"
grep -A30 "^| arm" $F/bench-offload.log | head -40 || tail -30 $F/bench-offload.log
rm -rf $F/farm/data $F/farm/*.logs
pack
