#!/usr/bin/env bash
# Slot-shared capture's pool, GPU arenas and pinned host arenas, predicted against measured, over the slot farm cases.
# Usage: bash benchmarks/planner_slot/run.sh OUT_DIR   (one GPU, run from the repository root; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
export NVTE_CPU_OFFLOAD_V1=1
C=tests/functional/test_cases
megatron-cg farm $C/gpt/tiny_gpt_slot_offload $C/moe/tiny_moe_slot_offload $C/moe/tiny_moe_slot_offload_delayed \
  $C/gpt/gpt_12x1024_slot_offload_user_script $C/gpt/gpt_1b_slot_offload_user_script $C/gpt/tiny_gpt_slot_fp8_tensorwise \
  $C/gpt/tiny_gpt_slot_fp8_delayed_user_script $C/gpt/tiny_gpt_slot_fp8_offload $C/gpt/tiny_gpt_slot_fp8_attention_user_script \
  --fit-gpus 1 --out "$OUT/farm"
for report in "$OUT"/farm/*graphed.report.json; do
  python - "$report" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(sys.argv[1], {key: report.get(key) for key in sorted(report) if key.startswith("predicted_")})
PY
done
echo "summary: the predicted_* figures above; the measured ones are each report's scopes in $OUT/farm/*graphed.report.json"
