"""The support matrix (matrix.runner): the all-pairs design over the factors, each cell's flags,
refusals from the one rule check, a cell's run as a farm run, and the table rendered from a run's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_cg_plugin.farm.distributed import MultiRankError
from megatron_cg_plugin.matrix import runner as matrix
from megatron_cg_plugin.matrix.covering import uncovered_pairs

REPO = Path(__file__).resolve().parents[2]
# The support matrix is a published result: its design and runs live beside the script that reruns them.
MATRIX = REPO / "benchmarks" / "support_matrix"
CELLS = MATRIX / "cells.json"
RUNS = ("1-correctness.json", "2-correctness.json", "3-correctness.json", "5-correctness.json", "4-bench.json")


def no_refusal(_cell):
    return (), ""


def test_the_design_meets_every_pair_and_names_each_cell_once():
    cells = matrix.design(no_refusal)
    assert not uncovered_pairs([c.factors for c in cells], matrix.FACTORS, allowed=matrix.allowed)
    assert len({c.name for c in cells}) == len(cells)
    assert all(matrix.allowed(c.factors) for c in cells)


def test_refused_cells_cover_only_pairs_no_running_cell_can():
    def refuse(cell):
        return (
            (("slot-capture-fp8",), "x")
            if cell["capture"] != "te" and cell["precision"] == "fp8-blockwise"
            else ((), "")
        )

    cells = matrix.design(refuse)
    running = [c.factors for c in cells if not c.refused_by]
    assert not uncovered_pairs(running, matrix.FACTORS, allowed=lambda c: matrix.allowed(c) and not refuse(c)[0])
    assert all(
        c.factors["precision"] == "fp8-blockwise" and c.factors["capture"] != "te" for c in cells if c.refused_by
    )


@pytest.mark.parametrize(
    "model, modules", [("moe-droppad", ["attn", "moe"]), ("moe-dropless", ["attn", "moe_router", "moe_preprocess"])]
)
def test_the_moe_scope_graphs_the_block_whole_or_its_router(model, modules):
    flags = matrix.cell_flags(
        {"model": model, "scope": "moe", "precision": "bf16", "capture": "te", "mbs": "2", "loop": "train"}
    )
    start = flags.index("--cuda-graph-modules") + 1
    assert flags[start : start + len(modules)] == modules
    assert flags[flags.index("--global-batch-size") + 1] == "8"  # four micro-batches of 2


def test_an_offload_cell_offloads_inside_the_graphs_and_trains_its_reference_without():
    factors = {
        "model": "gpt",
        "scope": "attn",
        "precision": "bf16",
        "capture": "slot-offload",
        "mbs": "1",
        "loop": "train",
    }
    case = matrix.farm_case(matrix.Cell(factors), megatron_lm_dir="/ml")
    assert "--fine-grained-activation-offloading" in case.flags and dict(case.env) == {"NVTE_CPU_OFFLOAD_V1": "1"}
    assert not case.eager_offload and case.script_file == Path("/ml/pretrain_gpt.py") and case.data == "synthetic"


def test_the_committed_design_is_what_plan_writes_today(tmp_path):
    """The cells the matrix ran (benchmarks/support_matrix/cells.json) are the design and the rules' verdicts
    `megatron-cg matrix plan` gives today: a rule change that moves a cell shows here."""
    cells = matrix.design(lambda cell: matrix.refusal_of(cell, tmp_path))
    committed = json.loads(CELLS.read_text())
    assert [(c["name"], c["refused_by"]) for c in committed] == [(c.name, list(c.refused_by)) for c in cells]


def test_a_refused_cell_is_recorded_without_running(monkeypatch, tmp_path):
    monkeypatch.setattr(matrix, "run_case", lambda *a, **k: pytest.fail("a refused cell ran"))
    cell = matrix.Cell(
        {
            "model": "gpt",
            "scope": "layer",
            "precision": "fp8-blockwise",
            "capture": "slot",
            "mbs": "1",
            "loop": "train",
        },
        ("slot-capture-fp8",),
        "refused",
    )
    row = matrix.run_cell(cell, tmp_path, megatron_lm_dir=None, steps=10, timeout_s=1)
    assert row["result"] == "refused" and row["refused_by"] == ["slot-capture-fp8"]


def test_a_cell_whose_run_dies_is_a_failure_and_the_others_go_on(monkeypatch, tmp_path):
    def dies(case, *_a, **_k):
        raise MultiRankError(f"{case.name}: rank 0 exited 1")

    monkeypatch.setattr(matrix, "run_case", dies)
    cells = matrix.design(no_refusal)[:3]
    shown: list[str] = []
    rows = matrix.run_matrix(cells, tmp_path, megatron_lm_dir="/ml", jobs=2, progress=shown.append)
    assert [r["result"] for r in rows] == ["failed"] * 3 and "rank 0 exited 1" in rows[0]["problems"][0]
    # each failure's cause on screen, not only in matrix.json
    assert sorted(shown) == sorted(f"{c.name}: failed: MultiRankError: {c.name}: rank 0 exited 1" for c in cells)
    assert [r["name"] for r in json.loads((tmp_path / "matrix.json").read_text())["rows"]] == [c.name for c in cells]


@pytest.mark.parametrize(
    "stderr, shown",
    [
        (  # a refusal: its first line, then its other lines (not only its pointer to the docs)
            "noise\nmegatron-cg-plugin: [full-recompute] use selective\n"
            "  (1 rule broken: see docs/troubleshooting.md)\n",
            [
                "FarmRunError: the graphed run failed: rank 0 (exit code 2): megatron-cg-plugin: [full-recompute] use "
                "selective",
                "   (1 rule broken: see docs/troubleshooting.md)",
            ],
        ),
        (  # no exception line found (a killed rank): the rank's last lines under the first
            "loading\nstep 1\nstep 2\n",
            ["FarmRunError: the graphed run failed: rank 0 (exit code -9)", "   step 1", "   step 2"],
        ),
    ],
)
def test_a_failed_cells_cause_is_on_screen_whole(monkeypatch, tmp_path, stderr, shown):
    from megatron_cg_plugin.farm.distributed import RankFailure
    from megatron_cg_plugin.farm.runner import FarmRunError

    def fails(case, out_dir, **_k):
        failure = RankFailure(0, 2 if "plugin" in stderr else -9, stderr, "")
        raise FarmRunError("graphed", out_dir / "x.logs", MultiRankError("1 of 1 ranks failed", [failure]))

    monkeypatch.setattr(matrix, "run_case", fails)
    printed: list[str] = []
    matrix.run_matrix(matrix.design(no_refusal)[:1], tmp_path, megatron_lm_dir="/ml", progress=printed.append)
    lines = printed[0].split(": failed: ", 1)[1].splitlines()
    assert [lines[0], *lines[len(lines) + 1 - len(shown) :]] == shown


def test_the_table_names_each_result_its_rules_and_the_pools():
    rows = [
        {
            "name": "a",
            "factors": dict(zip(matrix.FACTORS, ("gpt", "layer", "bf16", "te", "1", "train"))),
            "result": "exact",
            "refused_by": [],
            "pool_bytes": 100 * 2**20,
            "predicted_pool_bytes": 110 * 2**20,
            "teardown_pool_bytes_left": 0,
            "teardown_allocated_delta_bytes": 0,
        },
        {
            "name": "b",
            "factors": dict(zip(matrix.FACTORS, ("gpt", "layer", "fp8-blockwise", "slot", "1", "train"))),
            "result": "refused",
            "refused_by": ["slot-capture-fp8"],
        },
        {
            "name": "c",
            "factors": dict(zip(matrix.FACTORS, ("llama", "attn", "bf16", "slot", "2", "train"))),
            "result": "differs",
            "first_differing_step": 4,
            "refused_by": [],
        },
    ]
    text = matrix.render({"factors": matrix.FACTORS, "steps": 10, "rows": rows})
    assert "| a | gpt | layer | bf16 | te | 1 | train | exact | - | 110 / 100 (1.10) |" in text  # not benched
    assert "refused `slot-capture-fp8`" in text and "**differs** from step 4" in text
    assert "1 exact, 1 differs, 1 refused." in text


def test_a_matrix_split_over_runs_takes_each_cells_last_row_and_names_what_did_not_run():
    cells = matrix.design(
        lambda cell: (
            (("slot-capture-fp8",), "x")
            if cell["precision"] == "fp8-blockwise" and cell["capture"] != "te"
            else ((), "")
        )
    )
    running = [c for c in cells if not c.refused_by]
    first = {"steps": 10, "rows": [{"name": c.name, "factors": c.factors, "result": "failed"} for c in running[:3]]}
    again = {"steps": 10, "rows": [{"name": running[0].name, "factors": running[0].factors, "result": "exact"}]}
    merged = matrix.merge_results(cells, [first, again])
    results = {row["name"]: row["result"] for row in merged["rows"]}
    assert [row["name"] for row in merged["rows"]] == [c.name for c in cells]
    assert results[running[0].name] == "exact" and results[running[1].name] == "failed"
    assert results[running[3].name] == "not-run"
    assert all(results[c.name] == "refused" for c in cells if c.refused_by)
    assert "**not run**" in matrix.render(merged) and " not run." in matrix.render(merged)
    with pytest.raises(ValueError, match="same --steps"):
        matrix.merge_results(cells, [first, {**again, "steps": 12}])


def test_the_support_matrix_page_is_the_render_of_its_runs():
    """docs/support-matrix.md is `megatron-cg matrix render` of the committed design and runs: three correctness
    runs (the last ran the one cell the first two left) and the matrix bench (the plugin / stock column)."""
    runs = [json.loads((MATRIX / "runs" / run).read_text()) for run in RUNS]
    cells = [matrix.Cell(r["factors"], tuple(r["refused_by"]), r["refusal"]) for r in json.loads(CELLS.read_text())]
    assert (REPO / "docs" / "support-matrix.md").read_text() == matrix.render(matrix.merge_results(cells, runs))


def test_the_published_summary_is_what_its_inputs_say():
    """benchmarks/support_matrix/result.json names the inputs the page renders, in that order, and its figures
    are those the inputs give: cells, results, the pairs the design covers, the cells benched."""
    summary = json.loads((MATRIX / "result.json").read_text())
    assert summary["inputs"] == ["cells.json", *(f"runs/{run}" for run in RUNS)]
    cells = [matrix.Cell(r["factors"], tuple(r["refused_by"]), r["refusal"]) for r in json.loads(CELLS.read_text())]
    merged = matrix.merge_results(cells, [json.loads((MATRIX / "runs" / run).read_text()) for run in RUNS])
    rows = merged["rows"]
    can_meet = uncovered_pairs([], matrix.FACTORS, allowed=matrix.allowed)
    left = uncovered_pairs([c.factors for c in cells], matrix.FACTORS, allowed=matrix.allowed)
    figures = {
        "cells": len(rows),
        "exact": sum(row["result"] == "exact" for row in rows),
        "refused": sum(row["result"] == "refused" for row in rows),
        "benched": sum(
            row["result"] != "refused" and (row.get("bench") or {}).get("result") == "benched" for row in rows
        ),
        "pairs_covered": len(can_meet - left),
        "steps_per_cell": merged["steps"],
    }
    assert summary["figures"] == figures, "benchmarks/support_matrix/result.json's figures differ from its inputs"


def test_a_cell_whose_graphed_losses_move_differs_from_the_first_step_that_moved(monkeypatch, tmp_path):
    class Result:
        eager, graphed, report = {1: 7.0, 2: 6.5, 3: 6.1, 4: 5.9}, {1: 7.0, 2: 6.5, 3: 6.1, 4: 5.8}, {"scopes": []}
        resumed = None

        def losses(self, which):
            return which

        def summary(self):
            return {}

    monkeypatch.setattr(matrix, "run_case", lambda *a, **k: Result())
    monkeypatch.setattr(matrix, "problems_of", lambda *a, **k: ["lm loss differs"])
    cell = matrix.design(no_refusal)[0]
    row = matrix.run_cell(cell, tmp_path, megatron_lm_dir="/ml", steps=4, timeout_s=1)
    assert row["result"] == "differs" and row["first_differing_step"] == 4


def test_an_eval_resume_cell_saves_once_per_run_and_leaves_no_checkpoint(monkeypatch, tmp_path):
    """Cells run side by side on one GPU host: each first half ends on --exit-interval (one save, not two) and a
    cell's checkpoints go when it is done, whatever its result (a 2048-hidden MoE's is about 9 GB)."""
    cell = next(c for c in matrix.design(no_refusal) if c.factors["loop"] == "eval-resume")
    case = matrix.farm_case(cell, megatron_lm_dir="/ml")
    assert case.resumes and case.resume_from_exit

    def dies_after_saving(case, out_dir, **_):
        for graphed in (False, True):
            (case.checkpoint(out_dir, graphed=graphed) / "iter_0000005").mkdir(parents=True)
        raise OSError("No space left on device")

    monkeypatch.setattr(matrix, "run_case", dies_after_saving)
    row = matrix.run_cell(cell, tmp_path, megatron_lm_dir="/ml", steps=10, timeout_s=1)
    assert row["result"] == "failed" and "No space left" in row["problems"][0]
    assert not list(tmp_path.glob("*.checkpoints"))
