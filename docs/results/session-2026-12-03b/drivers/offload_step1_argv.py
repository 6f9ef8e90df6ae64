"""Prints the argv of the 6.7B farm case's eager run WITH Megatron's own fine-grained offload (the farm's eager
reference trains without it), 24 steps' data schedule, stopped after step 3 (--exit-interval): the step-1
gradient norm that went wrong in 3 of 4 runs (s62-s64; 43.539 is right). Usage: python3 offload_step1_argv.py OUT."""
import dataclasses
import sys
from pathlib import Path

from megatron_cg_plugin.testing import farm

out = Path(sys.argv[1])
case, _ = farm.prepare_case(farm.case_folder("gpt_6p7b_slot_offload_staged_user_script"), out_dir=out)
case = dataclasses.replace(case, eager_offload=True)
print(" ".join([*case.argv(graphed=False, out_dir=out, steps=24), "--exit-interval", "3"]))
