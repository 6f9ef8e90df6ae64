source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 dot-product attention under current scaling in slot capture (its delayed-scaling S/dP sub-state
# saved around capture and reduced at replay), through a user's script; FP8 attention on the TE path (delayed and
# tensorwise). Goldens written only where eager == graphed. The slot probe's FP8 attention part, delayed and current
# scaling, 2 and 4 variants, with and without the S-scale snapshot (cuDNN 9.14: non-deterministic algorithms on).
export NVTE_CPU_OFFLOAD_V1=1
T="python3 -m pytest -q -rs -p no:cacheprovider"
run_case() { (MEGATRON_CG_FARM_OUT=$F/farm-$1 MEGATRON_CG_UPDATE_GOLDEN=1 timeout 300 $T tests/functional/test_farm.py -k "$1" > $F/farm_$1.log 2>&1; echo "farm $1 rc=$?" >> $F/rc.txt) & }
run_case tiny_gpt_slot_fp8_attention_tensorwise_user_script
run_case tiny_gpt_fp8_attention_user_script
run_case tiny_gpt_fp8_attention_tensorwise_user_script
(NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 timeout 300 python3 tests/functional/_probes/slots_probe.py --part fp8-attention --out $F/fp8_attention_probe.json > $F/probe.log 2>&1; echo "probe rc=$?" >> $F/rc.txt) &
wait
cat $F/rc.txt
for c in tiny_gpt_slot_fp8_attention_tensorwise_user_script tiny_gpt_fp8_attention_user_script tiny_gpt_fp8_attention_tensorwise_user_script; do
  tail -n 1 $F/farm_$c.log; grep -h "Error\|mismatch\|assert" $F/farm_$c.log | cut -c1-400 | head -4
  cp tests/functional/test_cases/gpt/$c/golden_values_dev_dgx_h200.json $F/golden_$c.json 2>/dev/null
done
python3 -c "
import json; d=json.load(open('$F/fp8_attention_probe.json'))
print('probe_error', d.get('probe_error', '')[-800:])
for k, v in d.items():
    if k.startswith('fp8/'): print(k, v if isinstance(v, str) else {a: b for a, b in v.items() if a in ('exact', 'exact_frames', 'frames', 'fp8_state_equal', 'fp8_state_tensors', 'uncovered_bytes', 'error')})"
for f in $F/farm-*/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','pool_bytes','boundary_bytes','teardown_pool_bytes_left','failure')}, {k: r.get(k) for k in ('predicted_arena_bytes','predicted_pool_bytes','predicted_boundary_bytes')})"; done
for f in $F/farm-*/*summary.json; do python3 -c "
import json; d=json.load(open('$f')); print({k: d.get(k) for k in ('case','losses_equal','steps','replays','rejected','eager_ms','graphed_ms')})"; done
mkdir -p $F/farm; for d in $F/farm-*; do cp $d/*summary.json $d/*graphed.report.json $d/*.metrics.json $F/farm/ 2>/dev/null; done; rm -rf $F/farm-*
pack
