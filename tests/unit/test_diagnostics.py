"""Tests for megatron_cg_plugin.capture.accounting (pool bytes, replay counters, medians) and
megatron_cg_plugin.report (the run report table and JSON)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_cg_plugin.capture import accounting
from megatron_cg_plugin.capture.accounting import ReplayCounter, new_pool_bytes, pool_bytes_by_id, steady_median
from megatron_cg_plugin.capture.contracts import CheckedGraph
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.report import RunReport, ScopeReport

MiB = 2**20


def segment(size: int, pool=None, **extra) -> dict:
    """One entry shaped like ``torch.cuda.memory_snapshot()``'s segments."""
    seg = {
        "device": 0,
        "address": 0x7F0000000000,
        "total_size": size,
        "allocated_size": 0,
        "active_size": 0,
        "stream": 0,
        "segment_type": "large",
        "blocks": [],
        **extra,
    }
    if pool is not None:
        seg["segment_pool_id"] = pool
    return seg


# ---------------------------------------------------------------- pool bytes


def test_pool_bytes_excludes_the_ordinary_pool():
    segments = [segment(1000, (0, 0)), segment(2000, (0, 0)), segment(64, (1, 0))]
    assert pool_bytes_by_id(segments) == {(1, 0): 64}


def test_pool_bytes_without_pool_id_counts_as_ordinary():
    assert pool_bytes_by_id([segment(4096)]) == {}


def test_pool_bytes_sums_segments_of_one_pool():
    segments = [
        segment(2 * MiB, (3, 1)),
        segment(20 * MiB, (0, 0)),
        segment(6 * MiB, (3, 1)),
        segment(1 * MiB, (4, 0)),
        segment(5, (3, 1)),
    ]
    assert pool_bytes_by_id(segments) == {(3, 1): 8 * MiB + 5, (4, 0): MiB}


def test_pool_bytes_accepts_list_pool_ids_as_tuples():
    # A snapshot that went through JSON has lists where torch gives tuples.
    segments = [segment(10, [2, 7]), segment(5, (2, 7)), segment(99, [0, 0])]
    assert pool_bytes_by_id(segments) == {(2, 7): 15}


def test_pool_bytes_empty_snapshot():
    assert pool_bytes_by_id([]) == {}


def test_new_pool_bytes_counts_only_new_pools():
    before = {(1, 0): 100, (2, 0): 7}
    after = {(1, 0): 300, (2, 0): 7, (5, 0): 40, (6, 1): 2}
    assert new_pool_bytes(before, after) == 42  # (1, 0) grew but existed before


def test_new_pool_bytes_from_nothing_and_to_nothing():
    assert new_pool_bytes({}, {(1, 0): 3, (2, 0): 4}) == 7
    assert new_pool_bytes({(1, 0): 3}, {}) == 0
    assert new_pool_bytes({(1, 0): 3}, {(1, 0): 3}) == 0


def test_before_and_after_snapshots_end_to_end():
    before = pool_bytes_by_id([segment(512, (0, 0)), segment(MiB, (1, 0))])
    after = pool_bytes_by_id(
        [
            segment(512, (0, 0)),
            segment(2 * MiB, (1, 0)),
            segment(3 * MiB, (9, 0)),
            segment(MiB, (9, 0)),
            segment(MiB, (10, 2)),
        ]
    )
    assert new_pool_bytes(before, after) == 5 * MiB


_pools = st.sampled_from([(0, 0), (1, 0), (1, 1), (2, 0), (7, 3)])


@given(st.lists(st.tuples(_pools, st.integers(0, 2**40))))
def test_pool_bytes_property(entries):
    totals = pool_bytes_by_id([segment(size, pool) for pool, size in entries])
    assert (0, 0) not in totals
    assert sum(totals.values()) == sum(size for pool, size in entries if pool != (0, 0))
    for pool, total in totals.items():
        assert total == sum(size for p, size in entries if p == pool)
    assert new_pool_bytes({}, totals) == sum(totals.values())
    assert new_pool_bytes(totals, totals) == 0


def test_allocator_segments_empty_without_cuda():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized here; the CPU-only path is what this test checks")
    assert accounting.allocator_segments() == []


# ---------------------------------------------------------------- replay counters


class FakeGraph:
    """A TE graphed callable: callable, with ``reset`` and ``backward_dw`` methods."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.calls: list[tuple[tuple, dict]] = []
        self.resets = 0
        self.backward_dw_calls = 0

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return (self.tag, args, kwargs)

    def reset(self) -> None:
        self.resets += 1

    def backward_dw(self) -> str:
        self.backward_dw_calls += 1
        return f"dw-{self.tag}"


def wrap(counter, graph, slot):
    """A graph counted and held to no contract (``--cg-contract-check off``)."""
    return CheckedGraph(graph, None, ContractCheck.OFF, counter, slot)


def test_counting_graph_counts_per_slot_and_forwards_calls():
    counter = ReplayCounter(3)
    graphs = [FakeGraph(f"g{i}") for i in range(3)]
    wrapped = [wrap(counter, graph, slot) for slot, graph in enumerate(graphs)]

    assert wrapped[0](1, 2, key="v") == ("g0", (1, 2), {"key": "v"})
    wrapped[2]("x")
    wrapped[2]("y")
    wrapped[2]()

    assert counter.counts == [1, 0, 3]
    assert counter.total == 4
    assert graphs[0].calls == [((1, 2), {"key": "v"})]
    assert [args for args, _ in graphs[2].calls] == [("x",), ("y",), ()]
    assert graphs[1].calls == []


def test_counting_graph_shares_a_slot_between_microbatch_graphs():
    counter = ReplayCounter(2)
    layer_graphs = [wrap(counter, FakeGraph(f"mb{mb}"), 1) for mb in range(4)]
    for graph in layer_graphs:
        graph()
    assert counter.counts == [0, 4]


def test_counting_graph_forwards_attributes_without_counting():
    counter = ReplayCounter(1)
    graph = FakeGraph("g")
    wrapped = wrap(counter, graph, 0)

    wrapped.reset()
    wrapped.reset()
    assert wrapped.backward_dw() == "dw-g"
    assert wrapped.tag == "g"
    assert wrapped.graph is graph
    assert graph.resets == 2
    assert graph.backward_dw_calls == 1
    assert counter.counts == [0]  # only forward replays count


def test_counting_graph_missing_attribute_raises_attribute_error():
    wrapped = wrap(ReplayCounter(1), lambda: None, 0)
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute
    assert not hasattr(wrapped, "reset")  # Megatron probes hasattr(graph, ...) on old TE graphs


def test_counting_graph_propagates_exceptions():
    def broken(*_):
        raise RuntimeError("replay failed")

    wrapped = wrap(ReplayCounter(1), broken, 0)
    with pytest.raises(RuntimeError, match="replay failed"):
        wrapped()


def test_replay_counter_starts_at_zero():
    counter = ReplayCounter(5)
    assert counter.counts == [0] * 5
    assert counter.total == 0
    assert ReplayCounter(0).total == 0


def test_counting_graph_check_runs_before_each_replay():
    counter = ReplayCounter(2)
    graph = FakeGraph("g")
    seen = []

    class Contract:
        def check(self, args, kwargs, mode):
            seen.append((args, kwargs))
            if kwargs.get("bad"):
                raise ValueError("refused")

    wrapped = CheckedGraph(graph, Contract(), ContractCheck.FULL, counter, 1)
    assert wrapped(1, key="v") == ("g", (1,), {"key": "v"})
    with pytest.raises(ValueError, match="refused"):
        wrapped(2, bad=True)
    assert seen == [((1,), {"key": "v"}), ((2,), {"bad": True})]
    assert graph.calls == [((1,), {"key": "v"})]  # a refused replay never reaches the graph
    assert counter.counts == [0, 1] and counter.rejected == [0, 1]
    assert counter.total == 1 and counter.total_rejected == 1


def test_counting_graph_without_check_never_rejects():
    counter = ReplayCounter(1)
    wrapped = wrap(counter, FakeGraph("g"), 0)
    wrapped()
    assert counter.rejected == [0] and counter.total_rejected == 0


def test_replay_counter_rejected_starts_at_zero():
    counter = ReplayCounter(3)
    assert counter.rejected == [0, 0, 0] and counter.total_rejected == 0


def test_memory_state_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only path")
    state = accounting.memory_state()
    assert state.allocated == 0 and state.pools == {}
    assert state.pinned_host is None or isinstance(state.pinned_host, int)


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy])
def test_counting_graph_can_be_copied(copier):
    counter = ReplayCounter(1)
    original = wrap(counter, FakeGraph("g"), 0)
    clone = copier(original)
    clone()
    assert isinstance(clone, CheckedGraph)


# ---------------------------------------------------------------- steady_median


@pytest.mark.parametrize(
    "seconds, skip_first, expected",
    [
        ([], 1, None),
        ([9.0], 1, None),
        ([9.0, 1.0], 1, 1.0),
        ([9.0, 1.0, 3.0, 2.0], 1, 2.0),
        ([9.0, 1.0, 3.0, 2.0, 4.0], 1, 2.5),
        ([9.0, 1.0, 3.0], 0, 3.0),
        ([9.0, 8.0, 1.0, 3.0], 2, 2.0),
        ([9.0, 8.0], 2, None),
    ],
)
def test_steady_median(seconds, skip_first, expected):
    assert steady_median(seconds, skip_first=skip_first) == expected


def test_steady_median_default_drops_only_the_first():
    assert steady_median([1.0, 5.0, 7.0, 9.0]) == 7.0  # skip 0 -> 6.0, skip 2 -> 8.0
    assert steady_median((100.0, 2.0, 4.0)) == 3.0  # any sequence


# ---------------------------------------------------------------- report


def scope(name="attn+moe_router", **overrides) -> ScopeReport:
    fields = dict(
        scope=name,
        layers=4,
        graphs_captured=8,
        replays=120,
        capture_seconds=1.234,
        pool_bytes=64 * MiB,
        replays_per_layer=(30, 30, 30, 30),
    )
    fields.update(overrides)
    return ScopeReport(**fields)


def run_report(**overrides) -> RunReport:
    fields = dict(
        preset="tiny-moe",
        iterations=20,
        scopes=(scope(),),
        eager_steps=5,
        graphed_steps=15,
        eager_step_ms=10.0,
        graphed_step_ms=7.5,
    )
    fields.update(overrides)
    return RunReport(**fields)


def table_rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()[1:-1]]


def test_format_table_has_a_row_per_scope():
    report = run_report(
        scopes=(
            scope("attn", layers=2, graphs_captured=4, replays=36, capture_seconds=0.5, pool_bytes=3 * MiB),
            scope("layer", layers=12, graphs_captured=24, replays=1000, capture_seconds=12.345, pool_bytes=MiB // 2),
        )
    )
    text = report.format_table()
    assert text.splitlines()[0] == "megatron-cg-plugin run report"
    rows = table_rows(text)
    assert rows[0] == ["scope", "layers", "graphs", "replays", "rejected", "capture", "s", "pool", "MiB"]
    assert rows[1] == ["attn", "2", "4", "36", "0", "0.50", "3.0"]
    assert rows[2] == ["layer", "12", "24", "1000", "0", "12.35", "0.5"]
    assert len(rows) == 3  # no failure or teardown lines without failures or teardown
    assert "(no graphs captured)" not in text


def test_format_table_shows_rejected_replays():
    text = run_report(scopes=(scope("attn", replays=10, rejected=3),)).format_table()
    header, row = table_rows(text)
    assert row[header.index("rejected")] == "3"
    assert row[:5] == ["attn", "4", "8", "10", "3"]


def test_format_table_reports_a_rolled_back_capture():
    failure = "layer 3: RuntimeError: CUDA error: operation not permitted when stream is capturing"
    text = run_report(
        scopes=(scope("attn", graphs_captured=0, replays=0, pool_bytes=0, failure=failure), scope("layer")),
        graphed_steps=0,
        graphed_step_ms=None,
    ).format_table()
    lines = text.splitlines()
    assert f"  attn: capture failed and was rolled back: {failure}" in lines
    assert sum("capture failed" in line for line in lines) == 1  # only the failed scope
    assert lines[-1].startswith("  steady-state step time")
    assert lines.index(f"  attn: capture failed and was rolled back: {failure}") > 3  # after the table rows


def test_format_table_reports_teardown():
    text = run_report(
        scopes=(
            scope("attn", teardown_allocated_delta_bytes=3 * MiB // 2, teardown_pool_bytes_left=MiB // 4),
            scope("moe", teardown_allocated_delta_bytes=-MiB, teardown_pool_bytes_left=0),
            scope("layer"),
        )
    ).format_table()
    lines = text.splitlines()
    assert "  attn: after teardown, allocated +1.50 MiB vs before capture, 0.25 MiB left in graph pools" in lines
    assert "  moe: after teardown, allocated -1.00 MiB vs before capture, 0.00 MiB left in graph pools" in lines
    assert not any(line.startswith("  layer: after teardown") for line in lines)  # never torn down


def test_to_json_has_the_new_scope_fields():
    data = run_report(
        scopes=(scope(rejected=2, failure="layer 1: X", teardown_allocated_delta_bytes=0, teardown_pool_bytes_left=5),)
    ).to_json()
    fields = data["scopes"][0]
    assert (
        fields["rejected"],
        fields["failure"],
        fields["teardown_allocated_delta_bytes"],
        fields["teardown_pool_bytes_left"],
    ) == (2, "layer 1: X", 0, 5)
    defaults = run_report().to_json()["scopes"][0]
    assert (
        defaults["rejected"],
        defaults["failure"],
        defaults["teardown_allocated_delta_bytes"],
        defaults["teardown_pool_bytes_left"],
    ) == (0, None, None, None)


def test_format_table_columns_line_up():
    text = run_report(scopes=(scope("a"), scope("attn+moe_router+moe_preprocess"))).format_table()
    header, first, second = text.splitlines()[1:4]
    column = header.index("layers")
    assert first[column - 2 : column] == "  " and second[column - 2 : column] == "  "
    assert first[column] != " " and second[column] != " "


def test_format_table_without_scopes():
    text = run_report(scopes=(), graphed_steps=0, graphed_step_ms=None).format_table()
    assert "(no graphs captured)" in text
    assert "graphed - ms (0 steps)" in text
    assert "% less" not in text


def test_format_table_reduction_percentage():
    text = run_report(eager_step_ms=10.0, graphed_step_ms=7.5).format_table()
    last = text.splitlines()[-1]
    assert "eager 10.00 ms (5 steps)" in last
    assert "graphed 7.50 ms (15 steps)" in last
    assert last.endswith(", 25.0% less")


def test_format_table_graphed_slower_says_more():
    last = run_report(eager_step_ms=10.0, graphed_step_ms=12.5).format_table().splitlines()[-1]
    assert last.endswith(", 25.0% more")


def test_format_table_without_eager_steps():
    text = run_report(eager_steps=0, eager_step_ms=None).format_table()
    assert "eager - ms (0 steps)" in text
    assert "% less" not in text


@pytest.mark.parametrize(
    "eager, graphed, expected",
    [
        (10.0, 7.5, 0.25),
        (8.0, 8.0, 0.0),
        (4.0, 5.0, -0.25),
        (None, 5.0, None),
        (0.0, 5.0, None),
        (10.0, None, None),
    ],
)
def test_step_time_reduction(eager, graphed, expected):
    assert run_report(eager_step_ms=eager, graphed_step_ms=graphed).step_time_reduction == expected


def test_to_json_fields():
    data = run_report().to_json()
    assert data["step_time_reduction"] == 0.25
    assert data["preset"] == "tiny-moe"
    assert data["iterations"] == 20
    assert data["eager_step_ms"] == 10.0 and data["graphed_step_ms"] == 7.5
    assert data["scopes"][0]["scope"] == "attn+moe_router"
    assert data["scopes"][0]["pool_bytes"] == 64 * MiB
    assert list(data["scopes"][0]["replays_per_layer"]) == [30, 30, 30, 30]
    json.dumps(data)  # serializable as is


def test_to_json_reduction_none_without_timing():
    assert run_report(graphed_step_ms=None).to_json()["step_time_reduction"] is None


def test_save_writes_valid_json(tmp_path):
    report = run_report()
    path = tmp_path / "nested" / "dir" / "report.json"
    report.save(path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(report.to_json()))
    assert loaded["step_time_reduction"] == 0.25
    assert loaded["scopes"][0]["replays_per_layer"] == [30, 30, 30, 30]


def test_save_accepts_a_string_path(tmp_path):
    path = tmp_path / "r.json"
    run_report(scopes=()).save(str(path))
    assert json.loads(path.read_text())["scopes"] == []


def test_the_report_sets_the_planners_prediction_beside_the_measured_pool():
    text = run_report(predicted_pool_bytes=48 * MiB, prediction_leaves_out=("FP8 (quantized saves)",)).format_table()
    assert (
        "graph pool: predicted 48 MiB, measured 64 MiB (0.75x); the prediction leaves out FP8 (quantized saves)" in text
    )
    assert "graph pool: predicted" not in run_report().format_table()  # nothing predicted, nothing said
    data = run_report(predicted_pool_bytes=48 * MiB).to_json()
    assert data["predicted_pool_bytes"] == 48 * MiB


def test_capture_phases_are_printed_per_scope():
    text = run_report(
        scopes=(scope(capture_phases={"stale-graph check": 0.25, "Megatron and TE capture": 1.5}),)
    ).format_table()
    assert "attn+moe_router: capture phases: stale-graph check 0.25 s, Megatron and TE capture 1.50 s" in text


def test_the_report_sets_the_predicted_host_arenas_beside_the_measured_ones():
    slotted = scope(arena_bytes=6 * MiB, host_arena_bytes=3 * MiB // 2, offloaded_bytes=300 * MiB)
    text = run_report(scopes=(slotted,), predicted_host_arena_bytes=3 * MiB // 2).format_table()
    assert "pinned host arenas: predicted 1.5 MiB, measured 1.5 MiB" in text
    assert (
        "GPU arenas 6.0 MiB, pinned host arenas 1.5 MiB, offloaded 300.0 MiB in all, 20.0 MiB per graphed step" in text
    )
    assert "pinned host arenas: predicted" not in run_report(predicted_host_arena_bytes=MiB).format_table()


def test_the_report_sets_the_predicted_arenas_and_boundary_buffers_beside_the_measured_ones():
    slotted = scope(arena_bytes=6 * MiB, host_arena_bytes=0, boundary_bytes=7 * MiB // 2)
    text = run_report(
        scopes=(slotted, slotted), predicted_arena_bytes=13 * MiB, predicted_boundary_bytes=7 * MiB
    ).format_table()
    assert "GPU arenas: predicted 13.0 MiB, measured 12.0 MiB" in text  # every scope's, summed
    assert "boundary buffers: predicted 7.0 MiB, measured 7.0 MiB" in text
    assert "GPU arenas: predicted" not in run_report(predicted_arena_bytes=MiB).format_table()  # nothing measured
    assert (
        run_report(scopes=(slotted,), predicted_boundary_bytes=MiB).to_json()["scopes"][0]["boundary_bytes"]
        == 7 * MiB // 2
    )
