source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 attention (delayed scaling, SBHD) in slot-shared capture, head size 128 (s34: TE's FP8 fused
# attention on sm_90 takes head size 128 only), deterministic; with and without the S-scale snapshot.
(NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 timeout 400 python3 tests/functional/_probes/slots_probe.py --part fp8-attention --out $F/dpa.json > $F/dpa.log 2>&1; echo "dpa rc=$?")
grep "Selected backend\|Disabling" $F/dpa.log | sort | uniq -c | sort -rn | head -8
python3 -c "
import json
d=json.load(open('$F/dpa.json'))
for k, v in d.items():
    print(k, ('ERROR ' + v['error'][-900:]) if isinstance(v, dict) and 'error' in v else json.dumps(v, default=str)[:500])"
gzip -f $F/dpa.log
pack
