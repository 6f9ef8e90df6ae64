#!/usr/bin/env bash
# The planner's graph-pool prediction against the measured pool, over the single-GPU farm cases (bf16, TE's graphs).
# Each farm run's report holds both; `megatron-cg plan <the case's flags>` prints the prediction on CPU.
# Usage: bash benchmarks/planner_pool/run.sh OUT_DIR   (one GPU, run from the repository root, MEGATRON_LM_DIR set for the *_megatron_lm cases; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
C=tests/functional/test_cases
megatron-cg farm $C/gpt/tiny_gpt_attn $C/gpt/tiny_gpt_layer $C/gpt/tiny_gpt_real_data $C/moe/tiny_moe_router \
  $C/moe/tiny_moe_droppad $C/moe/tiny_moe_real_data_spm $C/gpt/gpt_12x1024_attn $C/gpt/gpt_12x1024_layer \
  $C/moe/moe_8x2048_droppad_megatron_lm $C/moe/moe_8x2048_dropless_megatron_lm --fit-gpus 1 --out "$OUT/farm"
for report in "$OUT"/farm/*graphed.report.json; do
  python - "$report" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(sys.argv[1], {key: report.get(key) for key in sorted(report) if key.startswith("predicted_")})
PY
done
echo "summary: the predicted_* figures above; the measured ones are each report's scopes in $OUT/farm/*graphed.report.json"
