source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 attention (delayed scaling, SBHD) in slot-shared capture. s33: TE found no FP8 attention
# backend (sm_90 FP8 fused attention needs head size 128; the probe used 64): again with 4 heads of 128.
(NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 timeout 200 python3 tests/functional/_probes/slots_probe.py --part fp8-attention --out $F/dpa_det.json > $F/dpa_det.log 2>&1; echo "det rc=$?")
grep -i "disabl\|backend\|unavailable" $F/dpa_det.log | sort | uniq -c | sort -rn | head -15
(NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 timeout 300 python3 tests/functional/_probes/slots_probe.py --part fp8-attention --out $F/dpa_nondet.json > $F/dpa_nondet.log 2>&1; echo "nondet rc=$?")
python3 -c "
import json
for f in ('dpa_det', 'dpa_nondet'):
    d=json.load(open('$F/' + f + '.json'))
    for k, v in d.items():
        print(f, k, ('ERROR ' + v['error'][-600:]) if isinstance(v, dict) and 'error' in v else json.dumps(v, default=str)[:400])"
pack
