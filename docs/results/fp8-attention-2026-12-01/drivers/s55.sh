source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15, the final code: FP8 attention through a user's script on slot capture and on TE's graphs, against their
# golden values; the slot report's prediction now redone from the model config (FP8 attention set by the script).
T="python3 -m pytest -q -rs -p no:cacheprovider"
run_case() { (MEGATRON_CG_FARM_OUT=$F/farm-$1 timeout 300 $T tests/functional/test_farm.py -k "$1" > $F/farm_$1.log 2>&1; echo "farm $1 rc=$?" >> $F/rc.txt) & }
run_case tiny_gpt_slot_fp8_attention_user_script
run_case tiny_gpt_fp8_attention_user_script
wait
cat $F/rc.txt
for f in $F/farm-*/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print('$f'.split('/')[-1], {k: s.get(k) for k in ('replays','rejected','arena_bytes','pool_bytes','teardown_pool_bytes_left','failure')}, {k: r.get(k) for k in ('predicted_arena_bytes','predicted_pool_bytes','prediction_leaves_out')})"; done
for f in $F/farm-*/*summary.json; do python3 -c "
import json; d=json.load(open('$f')); print({k: d.get(k) for k in ('case','losses_equal','steps','replays','rejected')})"; done
grep -h "FAILED\|mismatch" $F/farm_*.log | cut -c1-300 | head -6
mkdir -p $F/farm; for d in $F/farm-*; do cp $d/*summary.json $d/*graphed.report.json $F/farm/ 2>/dev/null; done; rm -rf $F/farm-*
pack
