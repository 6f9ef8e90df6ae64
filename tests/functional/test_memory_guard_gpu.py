"""The memory guard on a GPU, through Megatron-LM's own ``pretrain_gpt.py`` (core_r0.19.0, unmodified) on a
real indexed dataset built here: a dense 4 x 2048 model at seq 2048, micro-batch 1, graphed as whole layers.

The GPU's share for capture is set with ``--cg-memory-budget-gib`` halfway between the planner's prediction
for ``attn`` and for the whole layer (read from ``megatron-cg tune --tune-dry-run``, not written here), so:

- the whole-layer run stops before anything is captured, with the predicted and free bytes and the setups
  that fit as flags;
- the first setup it names trains under the same budget, graphed;
- the whole-layer run under ``--cg-on-capture-error eager`` records the refusal and trains eagerly, printing
  the suggested graphed run's losses (deterministic mode: graphs change no bit).

Needs a GPU, Transformer Engine and ``MEGATRON_LM_DIR`` (``test_megatron_lm_script``); skipped otherwise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_megatron_lm_script import printed_losses, run, script_dir

from megatron_cg_plugin.data.synthetic import synthetic_documents, write_indexed_dataset
from megatron_cg_plugin.launch.presets import PRESET_FLAGS

pytestmark = [pytest.mark.gpu]

STEPS = 8  # capture after Megatron's 3 warmup steps
MODEL = (
    "--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "8192", "--num-attention-heads", "16",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
    "--global-batch-size", "2", "--vocab-size", "1024",
)  # fmt: skip
WONT_FIT = "would not fit in memory, so nothing was captured"
# A fitting setup's line in the guard's message: "  --cuda-graph-modules attn  (1.04 GiB on the GPU ...)"
SUGGESTION = re.compile(r"^  (--\S.*?)  \((\d+\.\d+) GiB on the GPU", re.MULTILINE)


def flags(data: Path) -> list[str]:
    preset = list(PRESET_FLAGS["tiny-gpt"])
    preset.remove("--mock-data")
    preset[preset.index("--split") + 1] = "98,2,0"
    preset[preset.index("--train-iters") + 1] = str(STEPS)
    graphs = ("--cuda-graph-impl", "transformer_engine")
    return [*preset, *MODEL, "--data-path", str(data), "--deterministic-mode", *graphs]


def predicted_gib(script: str, argv: list[str], out: Path) -> dict[str, float]:
    """Each setup's predicted GPU bytes (GiB), as ``megatron-cg tune --tune-dry-run`` writes them."""
    dry_run = ["-m", "megatron_cg_plugin.cli", "tune", "--tune-dry-run", "--tune-out", str(out / "tune")]
    done = run([*dry_run, script, *argv], out, "tune_dry_run", timeout_s=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((out / "tune" / "tune.json").read_text())["setups"]
    return {row["setup"]: row["predicted_graph_bytes"] / 2**30 for row in rows if row.get("predicted_graph_bytes")}


def with_setup(argv: list[str], line: str) -> list[str]:
    """``argv`` with a suggestion's flags: those after ``without`` dropped (each with its values), the rest added."""
    add, _, dropped = line.partition(", without ")
    kept, skipping = [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg in dropped.split()
        if not skipping:
            kept.append(arg)
    return [*kept, *add.split()]


@pytest.fixture(scope="module")
def guarded(farm_out: Path) -> tuple[str, list[str], Path, float]:
    scripts = script_dir()
    out = farm_out / "memory_guard"
    out.mkdir(parents=True, exist_ok=True)
    data = write_indexed_dataset(
        out / "data" / "tokens", synthetic_documents(400, vocab_size=1024, seed=1234), eod=1023
    )
    script, argv = str(scripts / "pretrain_gpt.py"), flags(data)
    predicted = predicted_gib(script, argv, out)
    assert predicted["attn"] < predicted["whole layer"], predicted
    budget = (predicted["attn"] + predicted["whole layer"]) / 2
    return script, [*argv, "--cg-memory-budget-gib", f"{budget:.3f}"], out, budget


def plugin_run(script: str, argv: list[str], out: Path, name: str):
    report = out / f"{name}.report.json"
    done = run(["-m", "megatron_cg_plugin.cli", "run", script, *argv, "--cg-report-out", str(report)], out, name)
    return done, (json.loads(report.read_text()) if report.is_file() else None)


def test_a_capture_that_does_not_fit_stops_and_the_suggested_setup_trains(guarded) -> None:
    script, argv, out, budget = guarded
    refused, report = plugin_run(script, argv, out, "whole_layer_over_budget")
    assert refused.returncode == 2 and WONT_FIT in refused.stderr, refused.stderr[-4000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-4000:]  # megatron-cg run's own message
    assert f"--cg-memory-budget-gib {float(f'{budget:.3f}'):g}" in refused.stderr, refused.stderr[-4000:]
    suggestions = SUGGESTION.findall(refused.stderr)
    assert suggestions and all(float(gib) <= budget for _, gib in suggestions), refused.stderr[-4000:]
    assert report is None or all(scope["graphs_captured"] == 0 for scope in report["scopes"]), report

    first = with_setup(argv, suggestions[0][0])
    trained, report = plugin_run(script, first, out, "suggested_setup")
    assert trained.returncode == 0, trained.stderr[-4000:]
    assert report["scopes"] and all(scope["graphs_captured"] > 0 and not scope["failure"] for scope in report["scopes"])
    graphed_losses = printed_losses(trained.stdout)
    assert len(graphed_losses) == STEPS, trained.stdout[-2000:]

    fallback, report = plugin_run(script, [*argv, "--cg-on-capture-error", "eager"], out, "whole_layer_eager_fallback")
    assert fallback.returncode == 0, fallback.stderr[-4000:]
    assert report["scopes"] and all(WONT_FIT in (scope["failure"] or "") for scope in report["scopes"]), report
    assert all(scope["graphs_captured"] == 0 for scope in report["scopes"]), report
    assert printed_losses(fallback.stdout) == graphed_losses
    (out / "summary.json").write_text(
        json.dumps({"budget_gib": budget, "suggestions": suggestions, "losses": graphed_losses}, indent=2) + "\n"
    )
