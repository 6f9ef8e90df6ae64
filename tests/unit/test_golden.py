"""Tests for megatron_cg_plugin.golden: schema I/O, Megatron's tolerance rules, reports."""

import json
import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.golden import (
    GoldenFormatError,
    GoldenValues,
    MetricSeries,
    MetricsRecorder,
    Mismatch,
    Tolerance,
    compare,
    default_tolerances,
    format_report,
    update,
)

# Shaped like a Megatron tests/functional_tests/.../golden_values_*.json file.
MEGATRON_FILE = """{
    "lm loss": {"start_step": 1, "end_step": 5, "step_interval": 1,
                "values": {"1": 10.95659, "2": 10.9534, "3": 10.95236, "4": 10.94928, "5": 10.94401}},
    "num-zeros": {"start_step": 1, "end_step": 5, "step_interval": 1,
                  "values": {"1": 56862.0, "2": 56922.0, "3": "nan", "4": 56874.0, "5": 56909.0}},
    "mem-allocated-bytes": {"start_step": 1, "end_step": 5, "step_interval": 1,
                            "values": {"1": 1339286016, "2": 1339286016, "3": 1339286016,
                                       "4": 1339286016, "5": 1339286016}},
    "mem-max-allocated-bytes": {"start_step": 1, "end_step": 5, "step_interval": 1,
                                "values": {"1": 3418015744, "2": 3913941504, "3": 3913941504,
                                           "4": 3913941504, "5": 3913941504}},
    "iteration-time": {"start_step": 1, "end_step": 5, "step_interval": 1,
                       "values": {"1": 12.3, "2": 0.41, "3": 0.402, "4": 0.405, "5": 0.399}}
}
"""


def gv(**series: dict) -> GoldenValues:
    """GoldenValues from keyword args; underscores in names become dashes/spaces as Megatron spells them."""
    names = {
        "lm_loss": "lm loss",
        "num_zeros": "num-zeros",
        "iteration_time": "iteration-time",
        "mem": "mem-allocated-bytes",
        "mem_max": "mem-max-allocated-bytes",
    }
    return GoldenValues({names.get(k, k): MetricSeries(v) for k, v in series.items()})


def entry(**overrides):
    base = {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"1": 1.0, "2": 2.0}}
    base.update(overrides)
    return base


# ---------------------------------------------------------------- parsing and round trips


def test_megatron_file_parses(tmp_path):
    p = tmp_path / "golden_values_dev.json"
    p.write_text(MEGATRON_FILE)
    g = GoldenValues.load(p)
    assert list(g.metrics) == [
        "lm loss",
        "num-zeros",
        "mem-allocated-bytes",
        "mem-max-allocated-bytes",
        "iteration-time",
    ]
    loss = g.metrics["lm loss"]
    assert (loss.start_step, loss.end_step, loss.step_interval) == (1, 5, 1)
    assert loss.values[1] == 10.95659 and loss.values[5] == 10.94401
    assert math.isnan(g.metrics["num-zeros"].values[3])
    assert g.metrics["mem-allocated-bytes"].values[2] == 1339286016
    # ints stay ints, so byte counts are written back exactly as read
    assert isinstance(g.metrics["mem-allocated-bytes"].values[2], int)
    # Per the brief, NaN only equals NaN under an exact rule; num-zeros uses rtol, so even the
    # file against itself reports its "nan" step. Everything else matches itself.
    mm = compare(g, GoldenValues.load(p), deterministic=True)
    assert [(m.metric, m.step, m.rule) for m in mm] == [("num-zeros", 3, "rtol 0.2")]


def test_to_json_schema_sorted_and_nan_as_string():
    s = MetricSeries({10: 3.0, 2: 1.0, 6: math.nan}, step_interval=4)
    d = s.to_json()
    assert d == {"start_step": 2, "end_step": 10, "step_interval": 4, "values": {"2": 1.0, "6": "nan", "10": 3.0}}
    assert list(d["values"]) == ["2", "6", "10"]
    json.dumps(d, allow_nan=False)  # strict JSON: no bare NaN literal


def test_infinities_round_trip(tmp_path):
    g = gv(lm_loss={1: math.inf, 2: -math.inf})
    g.save(tmp_path / "g.json")
    back = GoldenValues.load(tmp_path / "g.json")
    assert back.metrics["lm loss"].values == {1: math.inf, 2: -math.inf}


def test_save_pretty_trailing_newline_creates_dirs(tmp_path):
    p = tmp_path / "a" / "b" / "golden.json"
    gv(lm_loss={1: 1.5}).save(p)
    text = p.read_text()
    assert text.endswith("}\n") and "\n  " in text
    assert json.loads(text) == {"lm loss": {"start_step": 1, "end_step": 1, "step_interval": 1, "values": {"1": 1.5}}}
    assert [f.name for f in p.parent.iterdir()] == ["golden.json"]  # no temp file left behind


def test_save_failure_keeps_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "golden.json"
    gv(lm_loss={1: 1.0}).save(p)
    before = p.read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("megatron_cg_plugin.golden.os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        gv(lm_loss={1: 2.0}).save(p)
    assert p.read_text() == before
    assert [f.name for f in tmp_path.iterdir()] == ["golden.json"]


def test_update_writes_actual(tmp_path):
    p = tmp_path / "x" / "golden.json"
    p.parent.mkdir()
    p.write_text(MEGATRON_FILE)
    new = gv(lm_loss={1: 9.0, 2: 8.5})
    update(p, new)
    assert GoldenValues.load(p) == new


finite = st.floats(allow_nan=False, allow_infinity=True)
number = st.one_of(finite, st.integers(min_value=-(2**62), max_value=2**62))
series = st.builds(
    MetricSeries,
    st.dictionaries(st.integers(min_value=0, max_value=10**6), number, min_size=1, max_size=20),
    st.integers(min_value=1, max_value=100),
)
golden = st.builds(GoldenValues, st.dictionaries(st.text(min_size=1, max_size=30), series, max_size=6))


@settings(max_examples=150, deadline=None)
@given(g=golden)
def test_property_save_load_exact(tmp_path_factory, g):
    p = tmp_path_factory.mktemp("rt") / "g.json"
    g.save(p)
    back = GoldenValues.load(p)
    assert back == g
    for name, s in g.metrics.items():  # exact floats, and int vs float preserved
        for step, v in s.values.items():
            assert type(back.metrics[name].values[step]) is type(v)
    assert GoldenValues.from_json(g.to_json()) == g


@settings(max_examples=50, deadline=None)
@given(steps=st.lists(st.integers(0, 10**6), min_size=1, max_size=10, unique=True))
def test_property_nan_round_trip(tmp_path_factory, steps):
    p = tmp_path_factory.mktemp("nan") / "g.json"
    gv(lm_loss=dict.fromkeys(steps, math.nan)).save(p)
    back = GoldenValues.load(p).metrics["lm loss"]
    assert sorted(back.values) == sorted(steps)
    assert all(math.isnan(v) for v in back.values.values())


def test_bare_nan_literal_also_accepted():
    g = GoldenValues.from_json(
        json.loads('{"lm loss": {"start_step": 1, "end_step": 1, "step_interval": 1, "values": {"1": NaN}}}')
    )
    assert math.isnan(g.metrics["lm loss"].values[1])


@pytest.mark.parametrize(
    "bad, field",
    [
        ({k: v for k, v in entry().items() if k != "start_step"}, "start_step"),
        ({k: v for k, v in entry().items() if k != "values"}, "values"),
        (entry(end_step="2"), "end_step"),
        (entry(step_interval=True), "step_interval"),
        (entry(step_interval=0), "step_interval"),
        (entry(start_step=3), "end_step"),
        (entry(values=[1.0, 2.0]), "values"),
        (entry(values={}), "values"),
        (entry(values={"one": 1.0}), "values['one']"),
        (entry(values={"1": "fast"}), "values['1']"),
        (entry(values={"1": None}), "values['1']"),
        (entry(values={"1": True}), "values['1']"),
        (entry(values={"1": 1.0, "01": 2.0}), "values['01']"),
        (entry(values={"3": 1.0}), "values['3']"),
        ("not an object", "<entry>"),
    ],
)
def test_format_errors_name_metric_and_field(bad, field):
    with pytest.raises(GoldenFormatError) as ei:
        GoldenValues.from_json({"lm loss": entry(), "num-zeros": bad})
    msg = str(ei.value)
    assert "'num-zeros'" in msg and repr(field) in msg, msg
    assert isinstance(ei.value, ValueError)


def test_format_error_top_level_and_bad_json(tmp_path):
    with pytest.raises(GoldenFormatError, match="top level"):
        GoldenValues.from_json([1, 2])
    p = tmp_path / "broken.json"
    p.write_text('{"lm loss": ')
    with pytest.raises(GoldenFormatError, match=r"broken\.json"):
        GoldenValues.load(p)


def test_end_step_beyond_last_key_is_accepted():
    # sampled every 5 steps: Megatron's end_step can be past the last sampled key
    s = MetricSeries.from_json(
        {"start_step": 1, "end_step": 50, "step_interval": 5, "values": {"1": 1.0, "6": 2.0, "46": 3.0}}, "lm loss"
    )
    assert (s.start_step, s.end_step, s.step_interval) == (1, 46, 5)


def test_metric_series_validation_and_immutability():
    with pytest.raises(GoldenFormatError):
        MetricSeries({})
    with pytest.raises(GoldenFormatError):
        MetricSeries({1: 1.0}, step_interval=0)
    with pytest.raises(GoldenFormatError):
        MetricSeries({"1": 1.0})
    with pytest.raises(GoldenFormatError):
        MetricSeries({1: "1.0"})
    src = {2: 2.0, 1: 1.0}
    s = MetricSeries(src)
    src[3] = 3.0  # caller's dict is copied
    assert list(s.values) == [1, 2]
    with pytest.raises(TypeError):
        s.values[5] = 1.0  # type: ignore[index]


# ---------------------------------------------------------------- recorder


def test_recorder_builds_golden():
    r = MetricsRecorder()
    for step in (1, 6, 11):
        r.record(step, {"lm loss": 10.0 - step / 10, "num-zeros": 100})
    r.record(16, {"lm loss": 8.0})
    g = r.golden()
    assert g.metrics["lm loss"].values == {1: 9.9, 6: 9.4, 11: 8.9, 16: 8.0}
    assert g.metrics["lm loss"].step_interval == 5
    assert g.metrics["num-zeros"].end_step == 11
    assert MetricsRecorder().golden() == GoldenValues({})
    single = MetricsRecorder()
    single.record(7, {"x": 1.0})
    assert single.golden().metrics["x"].step_interval == 1


def test_recorder_irregular_steps_interval_is_gcd():
    r = MetricsRecorder()
    for step in (2, 6, 12):
        r.record(step, {"lm loss": 1.0})
    assert r.golden().metrics["lm loss"].step_interval == 2


@pytest.mark.parametrize("second", [3, 2])
def test_recorder_rejects_non_increasing(second):
    r = MetricsRecorder()
    r.record(3, {"lm loss": 1.0})
    with pytest.raises(ValueError, match=r"lm loss.*strictly increasing"):
        r.record(second, {"lm loss": 2.0})


def test_recorder_rejected_call_stores_nothing():
    r = MetricsRecorder()
    r.record(5, {"lm loss": 1.0})
    with pytest.raises(ValueError):
        r.record(4, {"num-zeros": 3, "lm loss": 2.0})  # num-zeros alone would be fine
    assert set(r.golden().metrics) == {"lm loss"}
    r.record(4, {"num-zeros": 3})  # per metric: a different metric may use an earlier step
    assert r.golden().metrics["num-zeros"].values == {4: 3}


def test_recorder_type_checks():
    r = MetricsRecorder()
    with pytest.raises(TypeError):
        r.record(1.0, {"lm loss": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        r.record(1, {"lm loss": "1.0"})  # type: ignore[dict-item]


# ---------------------------------------------------------------- tolerances


def test_default_tolerances():
    det, nondet = default_tolerances(True), default_tolerances(False)
    assert det["lm loss"].exact and not nondet["lm loss"].exact
    assert nondet["lm loss"].rtol == 0.05
    for t in (det, nondet):
        assert t["num-zeros"] == Tolerance(rtol=0.20)
        assert t["iteration-time"] == Tolerance(rtol=0.05, median_window=(5, 20))
        assert t["mem-allocated-bytes"] == t["mem-max-allocated-bytes"] == Tolerance(rtol=0.05)


def test_tolerance_validation():
    with pytest.raises(ValueError):
        Tolerance(rtol=-0.1)
    with pytest.raises(ValueError):
        Tolerance(rtol=math.nan)
    with pytest.raises(ValueError):
        Tolerance(rtol=0.1, median_window=(20, 5))


def test_exact_loss_deterministic():
    e = gv(lm_loss={1: 10.95659, 2: 10.9534})
    assert compare(e, gv(lm_loss={1: 10.95659, 2: 10.9534}), deterministic=True) == []
    one_ulp = math.nextafter(10.9534, math.inf)
    mm = compare(e, gv(lm_loss={1: 10.95659, 2: one_ulp}), deterministic=True)
    assert mm == [Mismatch("lm loss", 2, 10.9534, one_ulp, "exact")]
    # the same 1-ulp change passes the non-deterministic 5% rule
    assert compare(e, gv(lm_loss={1: 10.95659, 2: one_ulp}), deterministic=False) == []


@pytest.mark.parametrize("sign", [1, -1])
def test_loss_rtol_boundary(sign):
    e = 10.0
    edge = e + sign * 0.05 * e  # exactly 5% away: allowed (<=)
    assert compare(gv(lm_loss={1: e}), gv(lm_loss={1: edge}), deterministic=False) == []
    outside = math.nextafter(edge, sign * math.inf)
    mm = compare(gv(lm_loss={1: e}), gv(lm_loss={1: outside}), deterministic=False)
    assert mm == [Mismatch("lm loss", 1, e, outside, "rtol 0.05")]


def test_rtol_negative_expected_uses_abs():
    assert compare(gv(lm_loss={1: -10.0}), gv(lm_loss={1: -10.5}), deterministic=False) == []
    assert compare(gv(lm_loss={1: -10.0}), gv(lm_loss={1: -10.51}), deterministic=False) != []


def test_num_zeros_twenty_percent():
    e = gv(num_zeros={1: 1000, 2: 1000, 3: 1000, 4: 1000})
    a = gv(num_zeros={1: 1200, 2: 800, 3: 1201, 4: 799})
    for det in (True, False):  # 20% applies in both modes
        mm = compare(e, a, deterministic=det)
        assert [(m.step, m.actual, m.rule) for m in mm] == [(3, 1201, "rtol 0.2"), (4, 799, "rtol 0.2")]


def test_zero_expected_requires_zero():
    e = gv(num_zeros={1: 0, 2: 0})
    mm = compare(e, gv(num_zeros={1: 0.0, 2: 1}), deterministic=False)
    assert [(m.step, m.actual) for m in mm] == [(2, 1)]


def _timing(**overrides):
    vals = dict.fromkeys(range(1, 31), 0.4)
    vals[1] = 15.0  # warm-up step, far from steady state
    vals.update(overrides)
    return vals


def test_iteration_time_median_ignores_warmup_outlier():
    e = gv(iteration_time=_timing())
    a = gv(iteration_time={**_timing(), 2: 99.0, 25: 50.0})  # outside 5..20: never matter
    assert compare(e, a, deterministic=True) == []
    # a single spike inside the window also doesn't move the median
    a = gv(iteration_time={**_timing(), 12: 99.0})
    assert compare(e, a, deterministic=True) == []


def test_iteration_time_shifted_median_caught():
    e = gv(iteration_time=_timing())
    slow = dict.fromkeys(range(5, 21), 0.43)  # +7.5% over the whole window
    mm = compare(e, gv(iteration_time={**_timing(), **slow}), deterministic=False)
    assert len(mm) == 1
    m = mm[0]
    assert (m.metric, m.step, m.expected, m.actual) == ("iteration-time", None, 0.40, 0.43)
    assert m.rule == "median steps 5-20, rtol 0.05"
    ok = dict.fromkeys(range(5, 21), 0.419)  # +4.75%: within 5%
    assert compare(e, gv(iteration_time={**_timing(), **ok}), deterministic=False) == []


def test_iteration_time_window_clipped_to_common_steps():
    e = gv(iteration_time=dict.fromkeys(range(1, 11), 1.0))  # expected ends at 10
    a = gv(iteration_time={**dict.fromkeys(range(1, 9), 1.0), **dict.fromkeys(range(9, 31), 9.0)})
    # window 5..20 -> steps 5..10 in both; actual there is [1, 1, 1, 1, 9, 9], median 1.0
    assert compare(e, a, deterministic=False) == []
    a2 = gv(iteration_time=dict.fromkeys(range(7, 31), 2.0))  # actual lacks steps 5, 6
    mm = compare(e, a2, deterministic=False)
    assert [m.rule for m in mm] == ["median steps 7-10, rtol 0.05"]


def test_iteration_time_no_common_steps():
    e = gv(iteration_time={1: 1.0, 2: 1.0})
    mm = compare(e, gv(iteration_time={1: 1.0, 2: 1.0}), deterministic=False)
    assert mm == [Mismatch("iteration-time", None, None, None, "no steps 5-20 in both files")]


def test_iteration_time_nan_in_window_fails():
    e = gv(iteration_time=_timing())
    mm = compare(e, gv(iteration_time={**_timing(), 10: math.nan}), deterministic=True)
    assert len(mm) == 1 and math.isnan(mm[0].actual)


def test_memory_per_step():
    e = gv(mem=dict.fromkeys(range(1, 6), 4000000000), mem_max=dict.fromkeys(range(1, 6), 8000000000))
    a_mem = dict.fromkeys(range(1, 6), 4000000000)
    a_mem[3] = 4_200_000_001  # one step just over 5%: a median would hide it
    a_max = dict.fromkeys(range(1, 6), 8000000000)
    a_max[5] = 7_600_000_000  # exactly 5% below: allowed
    mm = compare(e, gv(mem=a_mem, mem_max=a_max), deterministic=True)
    assert [(m.metric, m.step) for m in mm] == [("mem-allocated-bytes", 3)]
    assert mm[0].rule == "rtol 0.05"


# ---------------------------------------------------------------- missing things, subsets


def test_missing_metric_and_step():
    e = gv(lm_loss={1: 1.0, 2: 2.0, 3: 3.0}, num_zeros={1: 5})
    a = gv(lm_loss={1: 1.0, 3: 3.0, 4: 99.0})  # extra step 4 is ignored
    mm = compare(e, a, deterministic=True)
    assert mm == [
        Mismatch("lm loss", 2, 2.0, None, "missing in actual"),
        Mismatch("num-zeros", None, None, None, "missing in actual"),
    ]


def test_extra_metrics_in_actual_ignored():
    e = gv(lm_loss={1: 1.0})
    assert compare(e, gv(lm_loss={1: 1.0}, num_zeros={1: 7}), deterministic=True) == []


def test_metrics_subset():
    e = gv(lm_loss={1: 1.0}, num_zeros={1: 5})
    a = gv(lm_loss={1: 1.0}, num_zeros={1: 500})
    assert compare(e, a, deterministic=True, metrics=["lm loss"]) == []
    assert len(compare(e, a, deterministic=True, metrics=("num-zeros", "num-zeros"))) == 1
    mm = compare(e, a, deterministic=True, metrics=["lm loss", "mem-allocated-bytes"])
    assert mm == [Mismatch("mem-allocated-bytes", None, None, None, "missing in expected")]


def test_unknown_metric_needs_tolerance():
    e = GoldenValues({"grad-norm": MetricSeries({1: 1.0})})
    with pytest.raises(ValueError, match=r"unknown metric 'grad-norm'.*thresholds for 'lm loss'"):
        compare(e, e, deterministic=True)
    assert compare(e, e, deterministic=True, tolerances={"grad-norm": Tolerance(rtol=0.1)}) == []
    with pytest.raises(ValueError, match="grad-norm"):
        compare(gv(lm_loss={1: 1.0}), e, deterministic=True, metrics=["lm loss", "grad-norm"])


def test_tolerances_override_defaults():
    e, a = gv(lm_loss={1: 10.0}), gv(lm_loss={1: 10.4})
    assert compare(e, a, deterministic=True) != []
    assert compare(e, a, deterministic=True, tolerances={"lm loss": Tolerance(rtol=0.05)}) == []
    # other defaults still apply
    mm = compare(
        gv(lm_loss={1: 1.0}, num_zeros={1: 10}),
        gv(lm_loss={1: 1.0}, num_zeros={1: 20}),
        deterministic=True,
        tolerances={"lm loss": Tolerance(rtol=0.5)},
    )
    assert [m.metric for m in mm] == ["num-zeros"]


# ---------------------------------------------------------------- NaN


def test_nan_exact_both_nan_equal():
    e = gv(lm_loss={1: math.nan, 2: 1.0})
    assert compare(e, gv(lm_loss={1: math.nan, 2: 1.0}), deterministic=True) == []


@pytest.mark.parametrize("ev, av", [(math.nan, 1.0), (1.0, math.nan)])
def test_nan_exact_one_side(ev, av):
    mm = compare(gv(lm_loss={1: ev}), gv(lm_loss={1: av}), deterministic=True)
    assert len(mm) == 1 and mm[0].step == 1


@pytest.mark.parametrize("ev, av", [(math.nan, math.nan), (math.nan, 1.0), (1.0, math.nan)])
def test_nan_rtol_always_mismatch(ev, av):
    mm = compare(gv(lm_loss={1: ev}), gv(lm_loss={1: av}), deterministic=False)
    assert len(mm) == 1 and mm[0].rule == "rtol 0.05"


def test_infinities():
    inf = gv(lm_loss={1: math.inf})
    for det in (True, False):
        assert compare(inf, inf, deterministic=det) == []
        assert compare(inf, gv(lm_loss={1: -math.inf}), deterministic=det) != []
        assert compare(gv(lm_loss={1: 1.0}), inf, deterministic=det) != []


# ---------------------------------------------------------------- report text


def test_mismatch_str():
    assert (
        str(Mismatch("lm loss", 7, 10.95659, 10.95701, "exact"))
        == "lm loss step 7: expected 10.95659, actual 10.95701 (exact)"
    )
    assert (
        str(Mismatch("iteration-time", None, 0.4, 0.43, "median steps 5-20, rtol 0.05"))
        == "iteration-time: expected 0.4, actual 0.43 (median steps 5-20, rtol 0.05)"
    )
    assert (
        str(Mismatch("lm loss", 3, 2.5, None, "missing in actual")) == "lm loss step 3: expected 2.5, missing in actual"
    )
    assert str(Mismatch("num-zeros", None, None, None, "missing in actual")) == "num-zeros: missing in actual"
    # full precision, so a 1-ulp exact mismatch is visible in the log
    x = math.nextafter(1.0, 2.0)
    assert "actual 1.0000000000000002" in str(Mismatch("lm loss", 1, 1.0, x, "exact"))


def test_format_report():
    assert format_report([]) == "golden values match"
    e = gv(lm_loss={1: 10.95659, 7: 10.95659}, num_zeros={1: 100})
    a = gv(lm_loss={1: 10.95659, 7: 10.95701})
    report = format_report(compare(e, a, deterministic=True))
    lines = report.splitlines()
    assert lines[0] == "2 golden value mismatches:"
    assert lines[1].strip() == "lm loss step 7: expected 10.95659, actual 10.95701 (exact)"
    assert lines[2].strip() == "num-zeros: missing in actual"
    one = format_report([Mismatch("lm loss", 1, 1.0, 2.0, "exact")])
    assert one.splitlines()[0] == "1 golden value mismatch:"
    assert format_report(iter([])) == "golden values match"


def test_module_is_pure_python():
    # CI compares golden values on CPU-only runners: importing this must not pull in torch.
    import subprocess

    code = "import sys, megatron_cg_plugin.golden; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
