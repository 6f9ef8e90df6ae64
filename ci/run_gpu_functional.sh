#!/usr/bin/env bash
# Runs the GPU functional farm on a host with CUDA GPUs, TE and megatron-core importable
# (PYTHONPATH or an installed venv), and writes the summary table.
#   bash ci/run_gpu_functional.sh [OUT_DIR] [extra pytest args]
# MEGATRON_CG_UPDATE_GOLDEN=1 rewrites each case's golden_values_dev_dgx_<gpu>.json (tests/functional/test_cases/), the
# file of the GPU this run is on (h100, h200), from this run.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/megatron-cg-farm}}
shift || true
mkdir -p "$out"
export MEGATRON_CG_FARM_OUT="$out" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
set +e
python3 -m pytest tests/functional -v -rs -p no:cacheprovider "$@" 2>&1 | tee "$out/farm.log"
status=${PIPESTATUS[0]}
set -e
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
from megatron_cg_plugin.farm.runner import format_summary
out = Path(sys.argv[1])
rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.summary.json"))]
table = format_summary(rows)
(out / "farm_summary.md").write_text(table + "\n")
print(table)
PY
exit "$status"
