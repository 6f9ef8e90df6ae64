source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"  # the same stack and environment
MEGATRON_CG_FARM_OUT=$F timeout 230 python3 -m pytest tests/functional/test_farm.py tests/functional/test_capture_lifecycle.py -n 3 -v -rs -p no:cacheprovider -k "(tiny_gpt_layer and not dp2) or contracts" > $F/final.log 2>&1
echo "final rc=$?"; grep -E "PASSED|FAILED|ERROR" $F/final.log | tail -5; grep -E "^E " $F/final.log | head
tar czf $OUT/results.tgz -C $OUT f --exclude='*.logs'
