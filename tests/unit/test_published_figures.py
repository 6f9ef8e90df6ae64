"""Every figure the README and docs publish comes from a benchmarks/<name>/result.json through a table
benchmarks/render.py generates: a committed table that differs from its JSON fails here, and so does a result
that lacks the fields that say how to reproduce it. Doc links must point at files that exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("benchmarks_render", ROOT / "benchmarks" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)
RESULTS = render.load_results()
DOCS = [path for path in render.documents(ROOT) if path.exists()]


def test_there_are_published_results():
    assert RESULTS and "support_matrix" in RESULTS and "llama_like" in RESULTS


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_each_result_says_how_to_reproduce_it(name):
    result = RESULTS[name]
    assert not render.missing_fields(result), f"benchmarks/{name}/result.json lacks {render.missing_fields(result)}"
    assert result["name"] == name, f"benchmarks/{name}/result.json is named {result['name']!r}"
    assert re.search(r"\bmegatron-cg (bench|farm|matrix|tune)\b", result["command"]), result["command"]
    assert re.fullmatch(r"[0-9a-f]{7,40}", result["commit"]), result["commit"]
    assert (ROOT / "benchmarks" / name / "run.sh").is_file(), f"benchmarks/{name}/ has no run.sh"


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_a_command_is_a_real_one(name):
    """No placeholder (<model flags>, <case>) in a result's command: the flags are the run.sh's."""
    assert "<" not in RESULTS[name]["command"], f"benchmarks/{name}/result.json's command has a placeholder"


PLANNER = sorted(name for name in RESULTS if name.startswith("planner_"))


@pytest.mark.parametrize("name", PLANNER)
def test_each_planner_row_comes_from_a_report_its_run_sh_writes(name):
    """A planner row names the run reports under the output folder that hold its figures; run.sh writes each:
    farm/CASE.graphed.report.json for a case it hands megatron-cg farm, runs/NAME.report.json for a
    graphed_report NAME it runs (benchmarks/common.sh)."""
    script = (ROOT / "benchmarks" / name / "run.sh").read_text()
    farmed = set(re.findall(r"\$C/\w+/(\w+)", script))
    reported = set(re.findall(r"^\s*(?:\w+=\S+ )*graphed_report (\w+)", script, re.M))
    for row in RESULTS[name]["figures"]["rows"]:
        assert row.get("reports"), f"benchmarks/{name}/result.json: a row names no report: {row}"
        for report in row["reports"]:
            kind, _, file = report.partition("/")
            written = (kind == "farm" and file.removesuffix(".graphed.report.json") in farmed) or (
                kind == "runs" and file.removesuffix(".report.json") in reported
            )
            assert written, f"benchmarks/{name}/run.sh writes no {report}"


def test_a_source_names_its_device_once():
    for table in render.TABLES:
        text = render.render(table, RESULTS)
        for result in RESULTS.values():
            device = result["device"].split(",")[0]
            assert f"{device}, {device}" not in text, f"table {table!r} names {device} twice"


def test_a_result_without_its_fields_is_refused():
    assert render.missing_fields({"name": "x", "command": "", "figures": {}}) == [
        "command",
        "commit",
        "device",
        "figures",
    ]


def test_every_table_is_quoted_and_renders():
    quoted = {table for path in DOCS for table, _ in render.blocks(path.read_text())}
    assert quoted == set(render.TABLES), (
        f"tables rendered but quoted nowhere, or unknown: {quoted ^ set(render.TABLES)}"
    )


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_generated_tables_are_what_the_json_renders(path):
    for table, body in render.blocks(path.read_text()):
        assert body == render.render(table, RESULTS) + "\n", (
            f"{path.relative_to(ROOT)}'s table {table!r} differs from benchmarks/*/result.json: "
            "run python benchmarks/render.py"
        )


def test_a_changed_figure_fails():
    text = next(path.read_text() for path in DOCS if render.blocks(path.read_text()))
    table, body = render.blocks(text)[0]
    changed = {name: {**result} for name, result in RESULTS.items()}
    changed["llama_like"] = {
        **RESULTS["llama_like"],
        "figures": {**RESULTS["llama_like"]["figures"], "plugin_over_stock": {"median": 9.0, "low": 8.0, "high": 10.0}},
    }
    assert render.render("speed", changed) != render.render("speed", RESULTS)
    assert render.rewrite(text, RESULTS) == text


def test_a_row_timed_as_another_names_it_and_one_not_timed_says_so():
    dense = render.render("tune", {"tune_dense_1b": RESULTS["tune_dense_1b"]})
    assert "| whole layer | 2,586 | - | - | - | the same graphs as attn mlp |" in dense
    assert "| whole layer, slot | 2,987 | - | - | - | the same graphs as attn mlp, slot |" in dense
    offloaded = "not timed: with attention offloaded the model is built otherwise: run megatron-cg tune again"
    assert render._tune_verdict(offloaded) == "not timed"
    assert render._tune_verdict("slower than the best") == "slower than the best"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize(
    "path", [*DOCS, ROOT / "docs" / "design" / "fp8-slot-capture.md"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_relative_links_point_at_files(path):
    missing = [
        target
        for target in LINK.findall(path.read_text())
        if "://" not in target and not (path.parent / target).exists()
    ]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"
