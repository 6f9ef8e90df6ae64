source "$(dirname "$0")/../../real-users-2026-12-01/drivers/common.sh"
# Issue 15: FP8 attention in slot-shared capture. s35: TE disables FP8 fused attention for determinism with
# this host's cuDNN (< 9.19), so this run allows non-deterministic algorithms (head size 128, delayed scaling).
(NVTE_ALLOW_NONDETERMINISTIC_ALGO=1 NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 timeout 400 python3 tests/functional/_probes/slots_probe.py --part fp8-attention --out $F/dpa.json > $F/dpa.log 2>&1; echo "dpa rc=$?")
grep "Selected backend\|Disabling\|cudnn\|cuDNN" $F/dpa.log | sort | uniq -c | sort -rn | head -8
python3 -c "
import json
d=json.load(open('$F/dpa.json'))
for k, v in d.items():
    print(k, ('ERROR ' + v['error'][-900:]) if isinstance(v, dict) and 'error' in v else json.dumps(v, default=str)[:500])"
gzip -f $F/dpa.log
pack
