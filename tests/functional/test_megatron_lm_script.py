"""Megatron-LM's own ``pretrain_gpt.py`` (branch core_r0.19.0), unmodified, through ``megatron-cg run``.

Needs a GPU, Transformer Engine and ``MEGATRON_LM_DIR``: a folder holding Megatron-LM's top-level
``pretrain_gpt.py``, ``gpt_builders.py`` and ``model_provider.py`` (not its ``megatron/`` package,
which would shadow the installed megatron-core). Each case is skipped with the reason otherwise.
Every run is one process started without torchrun (``megatron-cg run`` sets the rendezvous
variables itself; the stock run gets them here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cg_plugin import compat
from megatron_cg_plugin.farm.distributed import gpu_stack_missing
from megatron_cg_plugin.golden import GoldenValues
from megatron_cg_plugin.launch.presets import PRESET_FLAGS
from megatron_cg_plugin.launch.rendezvous import single_process_values

pytestmark = [pytest.mark.gpu]

STEPS = 30
# Megatron-LM's script with the tiny-gpt flags (mock data, NullTokenizer), deterministic.
FLAGS = (*PRESET_FLAGS["tiny-gpt"], "--train-iters", str(STEPS), "--deterministic-mode")
DETERMINISTIC_ENV = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_NVLS_ENABLE": "0",
    "PYTHONUNBUFFERED": "1",
}
# Megatron's training_log line: "iteration 3/ 30 | ... | lm loss: 6.912345E+00 | ..."
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
GPU_WORK_STARTED = "> initializing torch distributed"  # Megatron's first GPU-side step


def script_dir() -> Path:
    reason = gpu_stack_missing(1)
    if reason:
        pytest.skip(reason)
    configured = os.environ.get("MEGATRON_LM_DIR")
    if not configured or not (Path(configured) / "pretrain_gpt.py").is_file():
        pytest.skip(
            "needs MEGATRON_LM_DIR: a folder with Megatron-LM core_r0.19.0's pretrain_gpt.py, "
            "gpt_builders.py and model_provider.py"
        )
    return Path(configured)


def run(
    argv: list[str], out: Path, name: str, *, stock: bool = False, timeout_s: float = 600
) -> subprocess.CompletedProcess:
    env = {**os.environ, **DETERMINISTIC_ENV}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if stock:  # plain `python pretrain_gpt.py` on one GPU needs torchrun's variables
        env.update(single_process_values(env))
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout_s)
    (out / f"{name}.log").write_text(f"$ python {' '.join(argv)}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def printed_losses(stdout: str) -> dict[int, str]:
    return {int(step): value for step, value in LOSS_LINE.findall(stdout)}


def test_unmodified_pretrain_gpt_through_megatron_cg_run(farm_out: Path) -> None:
    scripts = script_dir()
    out = farm_out / "megatron_lm_pretrain_gpt"
    out.mkdir(parents=True, exist_ok=True)
    script = str(scripts / "pretrain_gpt.py")
    graphed = [*FLAGS, "--cuda-graph-impl", "transformer_engine"]

    stock = run([script, *graphed], out, "stock_graphed", stock=True)
    assert stock.returncode == 0, stock.stderr[-4000:]
    plugin = run(
        [
            "-m",
            "megatron_cg_plugin.cli",
            "run",
            script,
            *graphed,
            "--cg-metrics-out",
            str(out / "plugin_graphed.metrics.json"),
            "--cg-report-out",
            str(out / "plugin_graphed.report.json"),
        ],
        out,
        "plugin_graphed",
    )
    assert plugin.returncode == 0, plugin.stderr[-4000:]
    eager = run(
        [
            "-m",
            "megatron_cg_plugin.cli",
            "run",
            script,
            *FLAGS,
            "--cuda-graph-impl",
            "none",
            "--cg-metrics-out",
            str(out / "plugin_eager.metrics.json"),
        ],
        out,
        "plugin_eager",
    )
    assert eager.returncode == 0, eager.stderr[-4000:]

    # The report printed by itself, from a script that never calls the plugin.
    assert "megatron-cg-plugin run report" in plugin.stdout
    report = json.loads((out / "plugin_graphed.report.json").read_text())
    scopes = report["scopes"]
    assert scopes and scopes[0]["graphs_captured"] > 0 and scopes[0]["replays"] > 0, scopes
    assert all(scope["rejected"] == 0 for scope in scopes), scopes
    assert "PluginTECudaGraphHelper" not in stock.stdout + stock.stderr

    # Per-step lm loss: the stock script's equals the plugin's (Megatron's printed precision), and the
    # plugin's graphed run equals its eager run exactly.
    stock_losses, plugin_losses = printed_losses(stock.stdout), printed_losses(plugin.stdout)
    assert len(stock_losses) == STEPS and stock_losses == plugin_losses, (stock_losses, plugin_losses)
    graphed_metrics = GoldenValues.load(out / "plugin_graphed.metrics.json").metrics["lm loss"].values
    eager_metrics = GoldenValues.load(out / "plugin_eager.metrics.json").metrics["lm loss"].values
    assert dict(graphed_metrics) == dict(eager_metrics) and len(graphed_metrics) == STEPS
    (out / "summary.json").write_text(
        json.dumps(
            {
                "steps": STEPS,
                "stock_equals_plugin_printed": stock_losses == plugin_losses,
                "plugin_graphed_equals_eager_exact": dict(graphed_metrics) == dict(eager_metrics),
                "stock_losses": stock_losses,
                "report": report,
            },
            indent=2,
        )
        + "\n"
    )


@pytest.mark.parametrize(
    "name, change, rule",
    [
        ("bad_cg_value", ["--cg-contract-check", "bogus"], "--cg-contract-check"),
        ("rule_violation", ["--cuda-graph-modules", "moe"], "[moe-scope-needs-moe]"),
    ],
)
def test_bad_flags_stop_before_gpu_work(farm_out: Path, name: str, change: list[str], rule: str) -> None:
    scripts = script_dir()
    out = farm_out / "megatron_lm_pretrain_gpt"
    out.mkdir(parents=True, exist_ok=True)
    done = run(
        [
            "-m",
            "megatron_cg_plugin.cli",
            "run",
            str(scripts / "pretrain_gpt.py"),
            *FLAGS,
            "--cuda-graph-impl",
            "transformer_engine",
            *change,
        ],
        out,
        name,
        timeout_s=300,
    )
    assert done.returncode == 2, done.stderr[-4000:]
    assert rule in done.stderr and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert GPU_WORK_STARTED not in done.stdout, done.stdout[-2000:]
    # argparse's one line for a bad value; for broken rules the heading once, then one line per rule.
    errors = [line for line in done.stderr.splitlines() if line.startswith("megatron-cg-plugin:") or " error: " in line]
    assert len(errors) == 1, done.stderr[-4000:]
    rule_lines = [line for line in done.stderr.splitlines() if line.startswith("  [")]
    assert all(re.match(r"  \[[a-z0-9-]+\] \S", line) for line in rule_lines), rule_lines


def test_without_apex_the_rule_names_the_flag(farm_out: Path) -> None:
    """Megatron's default --gradient-accumulation-fusion needs APEX: refused before model build."""
    scripts = script_dir()
    if compat.apex_fused_wgrad_available():
        pytest.skip("APEX is installed here: Megatron's gradient-accumulation fusion works")
    out = farm_out / "megatron_lm_pretrain_gpt"
    out.mkdir(parents=True, exist_ok=True)
    flags = [flag for flag in FLAGS if flag != "--no-gradient-accumulation-fusion"]
    done = run(
        [
            "-m",
            "megatron_cg_plugin.cli",
            "run",
            str(scripts / "pretrain_gpt.py"),
            *flags,
            "--cuda-graph-impl",
            "transformer_engine",
        ],
        out,
        "no_apex",
        timeout_s=300,
    )
    assert done.returncode == 2 and "[gradient-accumulation-fusion]" in done.stderr, done.stderr[-4000:]
    assert "--no-gradient-accumulation-fusion" in done.stderr and GPU_WORK_STARTED not in done.stdout
