source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: the bench's larger dense model (16 x 2048, seq 2048) with in-graph offload: eager (Megatron's
# offload) == graphed (--cg-slot-capture) through a user's script on the synthetic indexed dataset, golden
# written by this run; then the offload bench on it (stock = Megatron's offload + TE graphs, slot, slot-offload).
# Issue 13: the 4-layer GPT bench with the loader's batches cached (--bench-cached-batches).
export MEGATRON_CG_FARM_OUT=$F/farm MEGATRON_CG_UPDATE_GOLDEN=1
T="python3 -m pytest -q -rs -p no:cacheprovider"
NVTE_CPU_OFFLOAD_V1=1 timeout 270 $T tests/functional/test_farm.py -k "gpt_1b_slot_offload_user_script" > $F/farm_1b.log 2>&1; echo "farm 1b rc=$?"
tail -n 4 $F/farm_1b.log; grep -h "FAILED\|Error" $F/farm_1b.log | cut -c1-400 | head -8
cp tests/functional/test_cases/gpt/gpt_1b_slot_offload_user_script/golden_values_dev_dgx_h200.json $F/ 2>/dev/null
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('scope','replays','rejected','arena_bytes','host_arena_bytes','offloaded_bytes','pool_bytes','teardown_pool_bytes_left')})"; done
unset MEGATRON_CG_UPDATE_GOLDEN
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
M="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --cuda-graph-impl transformer_engine"
OFF="--fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm"
NVTE_CPU_OFFLOAD_V1=1 timeout 200 $B --bench-arms stock,slot,slot-offload --bench-rounds 2 --bench-steps 8 --bench-out $F/bench-1b-offload $M $OFF > $F/bench-1b-offload.log 2>&1; echo "bench 1b offload rc=$?"
sed -n '/^| arm/,$p' $F/bench-1b-offload/bench.md | head -30; tail -n 3 $F/bench-1b-offload.log
timeout 75 $B --bench-arms stock,plugin,plugin-no-check --bench-rounds 8 --bench-steps 6 --bench-cached-batches 4 --bench-out $F/bench-gpt4-cached --cg-preset tiny-gpt --num-layers 4 --cuda-graph-impl transformer_engine > $F/bench-gpt4-cached.log 2>&1; echo "bench gpt4 cached rc=$?"
sed -n '/^| arm/,$p' $F/bench-gpt4-cached/bench.md | head -30; tail -n 3 $F/bench-gpt4-cached.log
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
