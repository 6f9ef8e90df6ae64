"""benchmarks/tune_check.py: which of a tune's setups the benchmark scripts bench again, with which bench
arguments, and how the benches' intervals are read against the tune's order."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("benchmarks_tune_check", ROOT / "benchmarks" / "tune_check.py")
tune_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tune_check)


def setup_row(name: str, median: float | None, flags: tuple[str, ...] = ("--num-layers", "2")) -> dict:
    graphed = name != "eager"
    ratio = None if median is None else {"median": median, "low": median - 0.01, "high": median + 0.01}
    return {
        "setup": name,
        "graph_flags": ["--cuda-graph-impl", "transformer_engine"] if graphed else [],
        "flags": list(flags),
        "measured": None if median is None and name != "eager" else {"ratio": ratio},
        "verdict": "",
        "predicted_graph_bytes": None,
    }


def test_the_winner_comes_first_then_the_others_fastest_first():
    tune = {
        "setups": [
            setup_row("eager", None),
            setup_row("attn", 0.80),
            setup_row("attn mlp, slot", 0.70),  # a lower median, but not the tune's winner
            setup_row("attn mlp", 0.72),
            setup_row("whole layer", None),  # not timed
        ],
        "winner": {"setup": "attn mlp"},
    }
    assert [row["setup"] for row in tune_check.timed_graphed(tune)] == ["attn mlp", "attn mlp, slot", "attn"]
    tune["winner"] = None
    assert tune_check.timed_graphed(tune)[0]["setup"] == "attn mlp, slot"


def test_te_setups_are_benched_in_steps_and_slot_ones_in_blocks_without_their_slot_flag():
    te = tune_check.bench_args(setup_row("attn", 0.8, ("--cuda-graph-modules", "attn")), "30")
    assert (
        te[:2] == ["--bench-arms", "eager,plugin"]
        and "--bench-interleave" in te
        and te[-2:]
        == [
            "--cuda-graph-modules",
            "attn",
        ]
    )
    assert te[te.index("--bench-seconds") + 1] == "30"
    slot = tune_check.bench_args(setup_row("attn, slot", 0.8, ("--cg-slot-capture", "--num-layers", "2")), "30")
    assert slot[:2] == ["--bench-arms", "eager,slot"] and "--cg-slot-capture" not in slot
    assert "--bench-interleave" not in slot and "--bench-rounds" in slot


@pytest.mark.parametrize(
    "first, second, verdict",
    [
        ((0.60, 0.59, 0.61), (0.80, 0.79, 0.81), "agrees"),
        ((0.80, 0.79, 0.81), (0.60, 0.59, 0.61), "disagrees"),
        ((0.60, 0.58, 0.62), (0.61, 0.60, 0.63), "tie"),
    ],
)
def test_the_benches_agree_disagree_or_tie_by_their_intervals(first, second, verdict):
    def ratio(values):
        return dict(zip(("median", "low", "high"), values, strict=True))

    assert tune_check.agreement(ratio(first), ratio(second)) == verdict


def test_a_block_bench_without_a_distribution_free_interval_gives_the_tunes_interval_over_few_values():
    bench = {
        "ratios": {"slot/eager": {"median": 0.5}, "eager/slot": {"median": 2.0}},
        "ratio_intervals": {},
        "ratio_precision": {"slot/eager": {"pairs": 4, "half_width": 0.02}},
    }
    found = tune_check.bench_ratio(bench)
    assert found["n"] == 4 and found["method"] == "~95% over 4 pairs (Student's t)"
    spread = math.exp(0.02 * 3.1824 / 1.959964)  # Student's t over 3 degrees of freedom, not the normal 1.96
    assert found["low"] == pytest.approx(0.5 / spread, rel=1e-9) and found["high"] == pytest.approx(0.5 * spread)


def test_the_summary_reads_the_tune_and_both_benches(tmp_path):
    tune = {"setups": [setup_row("eager", None), setup_row("attn", 0.8), setup_row("attn mlp", 0.6)]}
    tune["winner"] = {"setup": "attn mlp"}
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tune.json").write_text(json.dumps(tune))
    for index, median in enumerate((0.62, 0.83)):
        bench = {
            "schedule": "steps",
            "ratios": {"plugin/eager": {"median": median}},
            "ratio_intervals": {
                "plugin/eager": {"median": median, "low": median - 0.01, "high": median + 0.01, "n": 9}
            },
        }
        (tmp_path / f"bench-{index}").mkdir()
        (tmp_path / f"bench-{index}" / "bench.json").write_text(json.dumps(bench))
    result = tune_check.summary(tmp_path, "tune_x", "title", "model", "megatron-cg tune ...", "abc1234", "1x GPU")
    figures = result["figures"]
    assert figures["winner"] == "attn mlp" and [b["setup"] for b in figures["benches"]] == ["attn mlp", "attn"]
    assert figures["bench_agrees"] == "agrees"
