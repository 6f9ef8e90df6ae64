"""Golden update mode refuses to overwrite a golden file the run differs from, unless accepted."""

from megatron_cg_plugin import golden
from megatron_cg_plugin.farm.runner import ACCEPT_GOLDEN_CHANGE, golden_rewrite_refusal


def series(values: dict[int, float]) -> golden.GoldenValues:
    return golden.GoldenValues({"lm loss": golden.MetricSeries(values)})


def test_a_first_golden_file_or_a_matching_run_is_written():
    assert golden_rewrite_refusal("case", None, {}) is None
    same = golden.compare(series({1: 4.0, 2: 3.5}), series({1: 4.0, 2: 3.5}), deterministic=True)
    assert golden_rewrite_refusal("case", same, {}) is None


def test_a_run_that_differs_from_the_file_it_replaces_is_refused_naming_the_switch():
    differs = golden.compare(series({1: 4.0, 2: 3.5}), series({1: 4.0, 2: 3.25}), deterministic=True)
    assert differs
    refusal = golden_rewrite_refusal("tiny_gpt_layer", differs, {})
    assert refusal is not None and "tiny_gpt_layer" in refusal and golden.format_report(differs) in refusal
    assert f"{ACCEPT_GOLDEN_CHANGE}=1" in refusal
    assert golden_rewrite_refusal("tiny_gpt_layer", differs, {ACCEPT_GOLDEN_CHANGE: "0"}) == refusal
    assert golden_rewrite_refusal("tiny_gpt_layer", differs, {ACCEPT_GOLDEN_CHANGE: "1"}) is None
