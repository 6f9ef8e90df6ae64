"""Prints a farm case's eager flags and step count without the plugin's --cg-* flags: the same run on
stock Megatron-LM's pretrain_gpt.py (s81, s82). Usage: python3 stock_flags.py CASE (F and
MEGATRON_LM_DIR set; the case's data is built under $F/stock)."""
import os
import sys
from pathlib import Path

from megatron_cg_plugin.testing import farm

out = Path(os.environ["F"]) / "stock"
case, _ = farm.prepare_case(f"tests/functional/test_cases/gpt/{sys.argv[1]}", out_dir=out,
                            megatron_lm_dir=os.environ["MEGATRON_LM_DIR"])
flags, kept = case.run_flags(graphed=False, out_dir=out), []
for index, flag in enumerate(flags):
    if flag.startswith("--cg-") or (index and flags[index - 1].startswith("--cg-") and not flag.startswith("--")):
        continue
    kept.append(flag)
print(" ".join([*kept, "--train-iters", str(case.steps)]))
