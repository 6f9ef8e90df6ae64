source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Verification of the previous session's CPU-only changes: lifecycle (after-failure diagnosis, garbage weakrefs),
# slot farm cases (shared parameter-gradient buffers, check_stale=False) against their goldens; then the benches:
# plugin-no-check arm on the host-bound GPT (issue 13) and slot memory on 12x1024 (issue 14).
export MEGATRON_CG_FARM_OUT=$F/farm NVTE_CPU_OFFLOAD_V1=1
T="python3 -m pytest -q -rs -p no:cacheprovider"
(MEGATRON_CG_FARM_OUT=$F/lifecycle timeout 250 $T tests/functional/test_capture_lifecycle.py > $F/lifecycle.log 2>&1; echo "lifecycle rc=$?" >> $F/rc.txt) &
(timeout 280 $T tests/functional/test_farm.py -k "tiny_gpt_slot_offload or tiny_moe_slot_offload" > $F/farm_slot.log 2>&1; echo "farm slot rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; tail -3 $F/lifecycle.log $F/farm_slot.log; grep -h "FAILED\|Error" $F/*.log | cut -c1-300 | head -20
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('scope','replays','rejected','arena_bytes','boundary_bytes','host_arena_bytes','pool_bytes','teardown_pool_bytes_left')})"; done
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
G="--cuda-graph-impl transformer_engine"
timeout 150 $B --bench-arms stock,plugin,plugin-no-check --bench-rounds 16 --bench-steps 8 --bench-out $F/gpt4 --cg-preset tiny-gpt --num-layers 4 $G > $F/gpt4.log 2>&1; echo "gpt4 rc=$?"
sed -n '/^| arm/,$p' $F/gpt4/bench.md | head -30
M="--num-layers 12 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 100,0,0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
OFF="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
timeout 200 $B --bench-arms stock,slot,slot-offload --bench-rounds 3 --bench-steps 8 --bench-out $F/bench-offload $M $OFF > $F/bench-offload.log 2>&1; echo "bench-offload rc=$?"
sed -n '/^| arm/,$p' $F/bench-offload/bench.md | head -30
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs $F/lifecycle/*.logs
pack
