source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: the slot probe's offload part (windows 0/1/4, a capture that raises after an offloaded save must leave
# the CUDA generators working), the offload farm cases on the default window. Issue 15: FP8 data offloaded
# (qkv_linear) and back in tiny_gpt_slot_fp8_offload; FP8 dot-product attention through a user's script with
# --cg-slot-capture (new case, golden written only if eager == graphed). Issue 13: the FP8 1B arenas, held out.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
(timeout 280 python3 tests/functional/_probes/slots_probe.py --part offload --out $F/offload_probe.json > $F/probe.log 2>&1; echo "probe rc=$?" >> $F/rc.txt) &
(timeout 280 $T tests/functional/test_farm.py -k "tiny_gpt_slot_offload or tiny_moe_slot_offload" --deselect "tests/functional/test_farm.py::test_graphed_matches_eager_and_golden[tiny_moe_slot_offload_delayed]" > $F/farm_offload.log 2>&1; echo "farm offload rc=$?" >> $F/rc.txt) &
(MEGATRON_CG_UPDATE_GOLDEN=1 timeout 280 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_offload or tiny_gpt_slot_fp8_attention_user_script" > $F/farm_fp8.log 2>&1; echo "farm fp8 rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; tail -n 3 $F/farm_offload.log $F/farm_fp8.log; grep -h "FAILED\|Error" $F/farm_*.log | cut -c1-400 | head -12
cp tests/functional/test_cases/gpt/tiny_gpt_slot_fp8_attention_user_script/golden_values_dev_dgx_h200.json $F/golden_fp8_attention.json 2>/dev/null
python3 -c "
import json; d=json.load(open('$F/offload_probe.json'))
print('probe_error', d.get('probe_error', '')[-600:])
for k, v in d.items():
    if k.startswith('offload'): print(k, {a: (b[-500:] if isinstance(b, str) else b) for a, b in v.items() if a in ('exact', 'exact_frames', 'error', 'raised', 'recovered', 'arena_bytes', 'pool_bytes', 'replay_ms_median')})"
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','offloaded_bytes','pool_bytes','teardown_pool_bytes_left','failure')}, {k: r.get(k) for k in ('predicted_arena_bytes','predicted_host_arena_bytes')})"; done
B="python3 -m megatron_cg_plugin.cli bench --bench-no-plot"
M="--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --vocab-size 32768 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp --fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16"
timeout 200 $B --bench-rounds 2 --bench-steps 4 --bench-skip-steps 1 --bench-out $F/bench-1b-fp8 --bench-arms slot,slot-offload $M --fine-grained-activation-offloading --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm > $F/bench-1b-fp8.log 2>&1; echo "bench 1b fp8 rc=$?"
sed -n '/^| arm/,$p' $F/bench-1b-fp8/bench.md | head -12; grep -h "Error" $F/bench-1b-fp8.log | tail -3
python3 -c "
import json; d=json.load(open('$F/bench-1b-fp8/bench.json'))
for b in d['blocks'][:2]: print(b['arm'], {k: b.get(k) for k in ('arena_bytes','host_arena_bytes','pool_bytes')})"
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
