source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: the FP8 capture-failure probe, with Megatron's per-step first-microbatch reset, and without the FP8 meta restore.
export MEGATRON_CG_FARM_OUT=$F/lifecycle
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/functional/test_capture_lifecycle.py -k "fp8" > $F/lifecycle_fp8.log 2>&1; echo "lifecycle fp8 rc=$?"
tail -25 $F/lifecycle_fp8.log | grep -v "^$" | cut -c1-300
for f in $F/lifecycle/*.json; do python3 -c "
import json; d=json.load(open('$f')); print('$f'.split('/')[-1], {k: str(v)[:300] for k, v in d.items() if k not in ('losses','eager_losses')}, d.get('losses') == d.get('eager_losses'))"; done
rm -rf $F/lifecycle/*.logs
pack
