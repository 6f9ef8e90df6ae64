#!/usr/bin/env bash
# The support matrix: the all-pairs design, every cell trained eager and graphed (bit-for-bit lm loss), the
# plugin / stock bench per cell, and the table docs/support-matrix.md is.
# Usage: bash benchmarks/support_matrix/run.sh OUT_DIR   (one GPU, MEGATRON_LM_DIR set to a Megatron-LM checkout; nothing is written inside the repository)
source "$(dirname "$0")/../common.sh"
megatron-cg matrix plan --out "$OUT/cells.json"
megatron-cg matrix run "$OUT/cells.json" --out "$OUT/run"
megatron-cg matrix bench "$OUT/cells.json" --out "$OUT/bench" --parallel 3 -- --bench-rounds 4 --bench-steps 6
megatron-cg matrix render "$OUT/cells.json" "$OUT/run/matrix.json" "$OUT/bench/matrix-bench.json" > "$OUT/support-matrix.md"
echo "summary: $OUT/support-matrix.md (compare with docs/support-matrix.md; copy cells.json and the run JSON into"
echo "benchmarks/support_matrix/ to publish them)"
