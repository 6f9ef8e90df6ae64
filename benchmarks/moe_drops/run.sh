#!/usr/bin/env bash
# Tokens the MoE routers drop at capacity factor 1.5, measured in the farm's two drop-and-pad cases (the farm
# turns on --cg-moe-drop-stats for MoE cases); `megatron-cg plan <flags> --router-load uniform` gives the plan.
# Usage: bash benchmarks/moe_drops/run.sh OUT_DIR   (one GPU, run from the repository root; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
C=tests/functional/test_cases
megatron-cg farm $C/moe/tiny_moe_droppad $C/moe/tiny_moe_real_data_spm --fit-gpus 1 --out "$OUT/farm"
echo "summary: the drop fraction in each run report under $OUT/farm (moe drops beside the capacity plan)"
