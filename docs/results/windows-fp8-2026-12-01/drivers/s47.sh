source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 dot-product attention (delayed scaling) through a user's script with --cg-slot-capture, without
# --deterministic-mode (cuDNN 9.14 runs FP8 attention only with non-deterministic algorithms allowed); golden
# written only if eager == graphed bit for bit. Issue 14: the FP8 1B with copies between replays.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
MEGATRON_CG_UPDATE_GOLDEN=1 timeout 200 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_attention_user_script" > $F/farm_fp8_attention.log 2>&1; echo "farm fp8 attention rc=$?"
tail -n 3 $F/farm_fp8_attention.log; grep -h "Error\|mismatch\|differ" $F/farm_fp8_attention.log | cut -c1-400 | head -12
grep -h "Error\|error" $F/farm/*.logs/*/*.txt $F/farm/*.logs/*.txt 2>/dev/null | grep -v Warning | cut -c1-300 | head -8
cp tests/functional/test_cases/gpt/tiny_gpt_slot_fp8_attention_user_script/golden_values_dev_dgx_h200.json $F/golden_fp8_attention.json 2>/dev/null
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','pool_bytes','teardown_pool_bytes_left','failure','ctx_tensors')}, {k: r.get(k) for k in ('predicted_arena_bytes',)})"; done
cat $F/farm/*summary.json 2>/dev/null | head -30
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
M="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp --fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16"
timeout 170 $B --bench-rounds 2 --bench-steps 4 --bench-skip-steps 1 --bench-out $F/bench-1b-fp8-staged --bench-arms slot,slot-offload-staged-w1 $M --fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm > $F/bench-1b-fp8-staged.log 2>&1; echo "bench 1b fp8 staged rc=$?"
sed -n '/^| arm/,$p' $F/bench-1b-fp8-staged/bench.md | head -14; grep -h "Error" $F/bench-1b-fp8-staged.log | tail -3
rm -rf $F/farm/*/data $F/farm/data
tar czf $F/farm_logs.tgz -C $F/farm . 2>/dev/null; rm -rf $F/farm/*.logs
pack
