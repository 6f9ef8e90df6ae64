source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14, GPT-3 6.7B's shape on one GPU: (1) the farm case, eager reference without offload vs graphed with the
# attention groups offloaded between replays (golden values written by this run); (2) an eager run with Megatron's
# own offload, 6 steps, to set beside s62's (its step-1 gradient norm against the no-offload reference).
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_TIMEOUT_S=220
C=gpt_6p7b_slot_offload_staged_user_script
MEGATRON_CG_UPDATE_GOLDEN=1 MEGATRON_CG_FARM_OUT=$F/farm timeout 260 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py -k $C > $F/farm_$C.log 2>&1; echo "farm $C rc=$?"
tail -n 3 $F/farm_$C.log; grep -h "Error\|mismatch\|differs" $F/farm_$C.log | cut -c1-400 | head -5
cp tests/functional/test_cases/gpt/$C/golden_values_dev_dgx_h200.json $F/ 2>/dev/null && echo "golden written"
python3 - > $F/eager_offload_cmd.txt <<'PY'
import dataclasses, pathlib, shlex
from megatron_cg_plugin.testing.farm import prepare_case
case, _ = prepare_case("tests/functional/test_cases/gpt/gpt_6p7b_slot_offload_staged_user_script", out_dir=pathlib.Path("/tmp/e2"))
case = dataclasses.replace(case, eager_offload=True)
print(shlex.join(["python3", *case.argv(graphed=False, out_dir=pathlib.Path("/tmp/e2"), steps=6)]))
PY
mkdir -p /tmp/e2; timeout 150 bash -c "$(cat $F/eager_offload_cmd.txt)" > $F/eager_offload_run.log 2>&1; echo "eager with offload rc=$?"
for f in $F/farm/*.logs/*/attempt_0/0/stdout.log $F/eager_offload_run.log; do echo "== $f"; grep -h "iteration  *[1-6]/" $f | sed 's/.*iteration *\([0-9]*\)\/.*lm loss: \([^ ]*\) .*grad norm: \([^ ]*\) .*num zeros: \([^ ]*\) .*/step \1 loss \2 gnorm \3 zeros \4/'; done
for f in $F/farm/*graphed.report.json; do python3 -c "
import json; r=json.load(open('$f')); s=r['scopes'][0]
print({k: s.get(k) for k in ('replays','rejected','arena_bytes','host_arena_bytes','pool_bytes','teardown_pool_bytes_left')})"; done
rm -rf $F/farm/data; pack
