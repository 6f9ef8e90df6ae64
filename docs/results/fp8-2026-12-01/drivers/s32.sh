source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 in slot-shared capture through Megatron (weight-update flag, delayed scaling): the probe's
# fp8 part (current + delayed, weight caching) and three farm cases held to the TE-path goldens.
# Issue 14: the 12x1024 bench memory with the shared parameter-gradient buffers (even rounds this time).
export MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
(timeout 300 python3 tests/functional/_probes/slots_probe.py --part fp8 --out $F/fp8.json > $F/fp8.log 2>&1; echo "fp8 probe rc=$?" >> $F/rc.txt) &
(timeout 300 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_tensorwise or tiny_gpt_slot_fp8_delayed" > $F/farm_fp8.log 2>&1; echo "farm fp8 rc=$?" >> $F/rc.txt) &
(NVTE_CPU_OFFLOAD_V1=1 timeout 300 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_offload" > $F/farm_fp8_offload.log 2>&1; echo "farm fp8 offload rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; grep -E "^fp8" $F/fp8.log | cut -c1-400; for f in $F/farm_fp8.log $F/farm_fp8_offload.log; do tail -n 4 $f; done
grep -h "FAILED\|Error\|error" $F/*.log | cut -c1-400 | head -20
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('scope','replays','rejected','arena_bytes','host_arena_bytes','offloaded_bytes','pool_bytes','teardown_pool_bytes_left')})"; done
for f in $F/farm/*summary.json; do python3 -c "
import json; d=json.load(open('$f')); print({k:v for k,v in d.items() if not isinstance(v,(list,dict))})"; done
M="--num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 100,0,0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
OFF="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
NVTE_CPU_OFFLOAD_V1=1 timeout 200 python3 -m megatron_cg_plugin.cli bench --bench-no-plot --bench-arms stock,slot,slot-offload --bench-rounds 2 --bench-steps 8 --bench-out $F/bench-offload $M $OFF > $F/bench-offload.log 2>&1; echo "bench-offload rc=$?"
sed -n '/^| arm/,$p' $F/bench-offload/bench.md | head -30; tail -n 3 $F/bench-offload.log
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
