source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 dot-product attention (delayed scaling) through a user's script with --cg-slot-capture, after the
# fix of per-call quantizer ownership (looked up by identity when a ctx object is met; s48 showed the S-scale
# snapshot missed in capture). Eager vs graphed, bit for bit, without --deterministic-mode (cuDNN 9.14).
# Beside it, an FP8 slot case that must still equal its golden values.
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_OUT=$F/farm
T="python3 -m pytest -q -rs -p no:cacheprovider"
(timeout 230 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_attention_user_script" > $F/farm_fp8_attention.log 2>&1; echo "farm fp8 attention rc=$?" >> $F/rc.txt) &
(timeout 230 $T tests/functional/test_farm.py -k "tiny_gpt_slot_fp8_delayed_user_script" > $F/farm_fp8_delayed.log 2>&1; echo "farm fp8 delayed rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt; tail -n 2 $F/farm_fp8_attention.log $F/farm_fp8_delayed.log; grep -h "Error" $F/farm_fp8_*.log | cut -c1-400 | head -6
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','pool_bytes','teardown_pool_bytes_left','failure')}, {k: r.get(k) for k in ('predicted_arena_bytes',)})"; done
for f in $F/farm/*summary.json; do python3 -c "
import json; d=json.load(open('$f')); print({k: d.get(k) for k in ('case','losses_equal','steps','replays','rejected','eager_ms','graphed_ms')})"; done
rm -rf $F/farm/*/data $F/farm/data $F/farm/*.logs
pack
