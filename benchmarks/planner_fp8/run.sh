#!/usr/bin/env bash
# The planner's graph-pool prediction under FP8 against the measured pool (TE's graphs), over the FP8 farm cases.
# Usage: bash benchmarks/planner_fp8/run.sh OUT_DIR   (one GPU, run from the repository root; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
C=tests/functional/test_cases
megatron-cg farm $C/gpt/tiny_gpt_fp8_delayed $C/gpt/tiny_gpt_fp8_tensorwise \
  $C/gpt/tiny_gpt_fp8_attention_user_script --fit-gpus 1 --out "$OUT/farm"
for report in "$OUT"/farm/*graphed.report.json; do
  python - "$report" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(sys.argv[1], {key: report.get(key) for key in sorted(report) if key.startswith("predicted_")})
PY
done
echo "summary: the predicted_* figures above; the measured ones are each report's scopes in $OUT/farm/*graphed.report.json"
