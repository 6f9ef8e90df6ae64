source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 14: the 6.7B farm case again against the golden values s63 wrote (its graphed run trains 3 eager warmup steps
# with Megatron's own offload, which s62 and s63 found not reproducible on this model).
export NVTE_CPU_OFFLOAD_V1=1 MEGATRON_CG_FARM_TIMEOUT_S=220
C=gpt_6p7b_slot_offload_staged_user_script
MEGATRON_CG_FARM_OUT=$F/farm timeout 250 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_farm.py -k $C > $F/farm_$C.log 2>&1; echo "farm $C rc=$?"
tail -n 3 $F/farm_$C.log; grep -h "differs\|mismatch" $F/farm_$C.log | cut -c1-300 | head -4
for f in $F/farm/*.logs/*/attempt_0/0/stdout.log; do echo "== $f"; grep -h "iteration  *[1-4]/" $f | sed 's/.*iteration *\([0-9]*\)\/.*lm loss: \([^ ]*\) .*grad norm: \([^ ]*\) .*/step \1 loss \2 gnorm \3/'; done
rm -rf $F/farm/data; pack
