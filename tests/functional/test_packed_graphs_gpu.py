"""Packed sequences under TE graphs without hybrid CP, through Megatron-LM's own
``pretrain_gpt.py`` (core_r0.19.0, unmodified) on one GPU, with ``--dataloader-inter-document-masking``
on a real indexed dataset built here: tiny-gpt's model (RoPE, micro-batch 2: two samples flattened into
one packed stream per microbatch).

- stock Megatron with TE graphs stops at the first replay (the assert Megatron-LM #5619 reports), whole layer;
- the plugin with ``--cg-thd-max-seqs``: graphed (whole layer, ``attn``) equals its eager run bit for bit
  at every step, and its eager run prints the stock eager losses (the padding entries change nothing);
- the plugin's launcher (its own packed batch path) trains graphed == eager the same way;
- a capacity below what a batch holds is refused, naming the flag.

Needs a GPU, Transformer Engine and ``MEGATRON_LM_DIR`` (``test_megatron_lm_script``); skipped otherwise.
The farm's ``gpt_4x2048_*_megatron_lm`` cases run the same path at 4 x 2048, seq 4096, with golden values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_megatron_lm_script import printed_losses, run, script_dir

from megatron_cg_plugin.data.synthetic import synthetic_documents, write_indexed_dataset
from megatron_cg_plugin.golden import GoldenValues
from megatron_cg_plugin.launch.presets import PRESET_FLAGS

pytestmark = [pytest.mark.gpu]

STEPS = 10  # capture after Megatron's 3 warmup steps: 7 graphed steps
CAPACITY = ("--cg-thd-max-seqs", "16")  # two 256-token samples of 16-600-token documents hold far fewer


def flags(data: Path) -> list[str]:
    preset = list(PRESET_FLAGS["tiny-gpt"])
    preset.remove("--mock-data")
    preset[preset.index("--split") + 1] = "98,2,0"
    preset[preset.index("--train-iters") + 1] = str(STEPS)
    return [*preset, "--data-path", str(data), "--dataloader-inter-document-masking", "--deterministic-mode"]


@pytest.fixture(scope="module")
def packed(farm_out: Path) -> tuple[str, list[str], Path]:
    scripts = script_dir()
    out = farm_out / "packed_graphs"
    out.mkdir(parents=True, exist_ok=True)
    data = write_indexed_dataset(
        out / "data" / "tokens", synthetic_documents(400, vocab_size=1024, seed=1234), eod=1023
    )
    return str(scripts / "pretrain_gpt.py"), flags(data), out


LAUNCHER = "launcher"  # plugin()'s script for the plugin's own launcher (megatron-cg run without a script)


def plugin(script: str, argv: list[str], out: Path, name: str):
    entry = (
        ["-m", "megatron_cg_plugin.pretrain_gpt"]
        if script == LAUNCHER
        else ["-m", "megatron_cg_plugin.cli", "run", script]
    )
    done = run(
        [
            *entry,
            *argv,
            "--cg-metrics-out",
            str(out / f"{name}.metrics.json"),
            "--cg-report-out",
            str(out / f"{name}.report.json"),
        ],
        out,
        name,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done, GoldenValues.load(out / f"{name}.metrics.json").metrics["lm loss"].values


def test_stock_megatron_stops_at_the_first_graphed_step(packed) -> None:
    script, argv, out = packed
    done = run([script, *argv, "--cuda-graph-impl", "transformer_engine"], out, "stock_graphed", stock=True)
    assert done.returncode != 0
    assert "packed_seq_params are excluded" in done.stdout + done.stderr, done.stderr[-4000:]


def test_graphed_packed_runs_equal_eager_and_stock(packed) -> None:
    script, argv, out = packed
    stock = run([script, *argv, "--cuda-graph-impl", "none"], out, "stock_eager", stock=True)
    assert stock.returncode == 0, stock.stderr[-4000:]
    eager, eager_losses = plugin(script, [*argv, *CAPACITY, "--cuda-graph-impl", "none"], out, "plugin_eager")
    summary = {
        "stock_eager_printed": printed_losses(stock.stdout),
        "plugin_eager_printed": printed_losses(eager.stdout),
    }
    for scope, extra in (("layer", []), ("attn", ["--cuda-graph-modules", "attn"])):
        _, graphed_losses = plugin(
            script,
            [*argv, *CAPACITY, "--cuda-graph-impl", "transformer_engine", *extra],
            out,
            f"plugin_graphed_{scope}",
        )
        report = json.loads((out / f"plugin_graphed_{scope}.report.json").read_text())
        summary[scope] = {"equal_eager": dict(graphed_losses) == dict(eager_losses), "scopes": report["scopes"]}
        assert dict(graphed_losses) == dict(eager_losses) and len(graphed_losses) == STEPS, (scope, graphed_losses)
        assert all(s["replays"] > 0 and s["rejected"] == 0 for s in report["scopes"]), report["scopes"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # The fixed layout's zero-length sequences and --seq-length bound change no printed loss.
    assert summary["stock_eager_printed"] == summary["plugin_eager_printed"], summary


def test_the_launcher_trains_packed_graphs_like_its_eager_run(packed) -> None:
    """The launcher's own packed batch path (packed/batches.py) into the same layout: graphed == eager."""
    _, argv, out = packed
    _, eager_losses = plugin(LAUNCHER, [*argv, *CAPACITY, "--cuda-graph-impl", "none"], out, "launcher_eager")
    for scope, extra in (("layer", []), ("attn", ["--cuda-graph-modules", "attn"])):
        _, graphed_losses = plugin(
            LAUNCHER,
            [*argv, *CAPACITY, "--cuda-graph-impl", "transformer_engine", *extra],
            out,
            f"launcher_graphed_{scope}",
        )
        assert dict(graphed_losses) == dict(eager_losses) and len(graphed_losses) == STEPS, (scope, graphed_losses)


def test_a_batch_beyond_the_capacity_is_refused_naming_the_flag(packed) -> None:
    script, argv, out = packed
    done = run(
        [
            "-m",
            "megatron_cg_plugin.cli",
            "run",
            script,
            *argv,
            "--cg-thd-max-seqs",
            "2",
            "--cuda-graph-impl",
            "transformer_engine",
        ],
        out,
        "beyond_capacity",
    )
    assert done.returncode != 0
    assert "ThdCapacityError" in done.stderr and "raise --cg-thd-max-seqs to at least" in done.stderr, done.stderr[
        -4000:
    ]
