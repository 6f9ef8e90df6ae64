source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 13: boundary buffers measured (the report's new field) on two slot farm cases, beside the plan.
# Issue 14: the offload bench on the bench's larger dense model (16 x 2048, seq 2048) with --cuda-graph-modules
# attn mlp (Megatron 0.19.2 cannot capture a whole layer with its own offload: s38), all of Megatron's attention
# groups offloaded, then only core_attn.
export MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
NVTE_CPU_OFFLOAD_V1=1 timeout 200 $T tests/functional/test_farm.py -k "tiny_gpt_slot_offload or tiny_moe_slot_offload" --deselect "tests/functional/test_farm.py::test_graphed_matches_eager_and_golden[tiny_moe_slot_offload_delayed]" > $F/farm_slot.log 2>&1; echo "farm slot rc=$?"
tail -n 3 $F/farm_slot.log
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','boundary_bytes','pool_bytes')}, {k: r.get(k) for k in ('predicted_pool_bytes','predicted_arena_bytes','predicted_boundary_bytes','predicted_host_arena_bytes')})"; done
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
M="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp"
bench() { name=$1; shift; NVTE_CPU_OFFLOAD_V1=1 timeout 190 $B --bench-rounds 2 --bench-steps 8 --bench-out $F/$name "$@" > $F/$name.log 2>&1; echo "$name rc=$?"; sed -n '/^| arm/,$p' $F/$name/bench.md | head -24; grep -h "Error" $F/$name.log | tail -3; }
bench bench-1b-offload --bench-arms stock,slot,slot-offload $M --fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm
bench bench-1b-core-attn --bench-arms slot,slot-offload $M --fine-grained-activation-offloading --offload-modules core_attn
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
