"""GPU functional farm: eager vs graphed training through Megatron's own loop, per step.

Each case needs its GPUs and Transformer Engine and is skipped with the reason otherwise. Set
MEGATRON_CG_FARM_OUT to keep the metrics, reports and logs (ci/run_gpu_functional.sh does), and
MEGATRON_CG_UPDATE_GOLDEN=1 to (re)write the golden files from this real run;
MEGATRON_CG_FARM_TIMEOUT_S bounds each multi-rank launch (default 900 s). With pytest-xdist
(`-n K`) single-GPU cases run side by side, one GPU each: a faster correctness run, but time with
a serial run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_cg_plugin import golden
from megatron_cg_plugin.farm.distributed import gpu_name, gpu_stack_missing, gpus_available
from megatron_cg_plugin.farm.runner import (
    DEFAULT_PLATFORM,
    FarmCase,
    golden_mismatches,
    golden_rewrite_refusal,
    load_cases,
    platform_of,
    problems_of,
    run_case,
)

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]
# Cases running Megatron-LM's own scripts find them in the checkout MEGATRON_LM_DIR names (skipped without one);
# each is held to the golden file of the GPU it runs on (Megatron's golden_values_dev_dgx_<gpu>.json).
_GPU = gpu_name()
CASES = load_cases(
    megatron_lm_dir=os.environ.get("MEGATRON_LM_DIR"), platform=DEFAULT_PLATFORM if _GPU is None else platform_of(_GPU)
)


def _devices_for(case: FarmCase) -> str | None:
    """Under pytest-xdist (-n K), single-GPU cases spread over the host's GPUs by worker number;
    step times are then shared-GPU figures, so time with a serial run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if case.nproc != 1 or not worker.startswith("gw"):
        return None
    return str(int(worker[2:]) % max(1, gpus_available()))


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_graphed_matches_eager_and_golden(case: FarmCase, farm_out: Path) -> None:
    reason = gpu_stack_missing(case.nproc) or case.unmet()
    if reason:
        pytest.skip(reason)
    result = run_case(
        case, farm_out, timeout_s=float(os.environ.get("MEGATRON_CG_FARM_TIMEOUT_S", "900")), devices=_devices_for(case)
    )
    summary = result.summary()

    updating = os.environ.get("MEGATRON_CG_UPDATE_GOLDEN") == "1" and case.golden_case is None and case.check_golden
    previous = golden_mismatches(case, result) if updating and case.golden_path.exists() else None
    if previous is not None:  # what the rewrite replaces, so a regression still shows
        summary["previous_golden_mismatches"] = golden.format_report(previous)
    (farm_out / f"{case.name}.summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    refusal = golden_rewrite_refusal(case.name, previous, dict(os.environ))
    assert refusal is None, refusal

    problems = problems_of(case, result, with_golden=False)
    assert not problems, "\n".join(problems)
    if updating:  # only a run whose graphed losses equal its eager ones writes golden values
        golden.update(case.golden_path, result.golden_run())
    problems = problems_of(case, result)
    assert not problems, "\n".join(problems)
