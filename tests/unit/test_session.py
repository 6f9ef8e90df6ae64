"""Tests for megatron_cg_plugin.session.RunSession, driven by a fake device probe and clock."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_cg_plugin.capture.accounting import ReplayCounter
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.golden import GoldenValues
from megatron_cg_plugin.planner.graph_memory import GraphMemoryPlan
from megatron_cg_plugin.session import CaptureStats, CudaProbe, IterationRecord, RunPrediction, RunSession

ALLOC, MAX_ALLOC = 1_339_286_016, 3_418_015_744


class FakeHelper:
    def __init__(self, created: bool = False, capture_stats: CaptureStats | None = None) -> None:
        self.created = created
        self.capture_stats = capture_stats

    def graphs_created(self) -> bool:
        return self.created


class NoStatsHelper:
    def graphs_created(self) -> bool:
        return True


# A run that writes its metrics: each iteration's values are kept (never written here: no finish()).
KEEPS = PluginConfig(metrics_out=Path("unwritten-metrics.json"), print_report=False)


def make_session(probe, clock, config=None) -> RunSession:
    return RunSession(config, probe=probe, clock=clock)


def step(session, clock, iteration, seconds, loss=None, **kwargs):
    """One training iteration: forward step(s) mark the start, the training_log tap ends it."""
    session.mark_iteration_start()
    clock.advance(seconds)
    session.on_training_log(iteration=iteration, loss_dict={} if loss is None else {"lm loss": loss}, **kwargs)


def metric(session, name) -> dict[int, float]:
    series = session.metrics().metrics.get(name)
    return {} if series is None else dict(series.values)


# ---------------------------------------------------------------- iteration bookkeeping


def test_mark_iteration_start_is_idempotent_within_an_iteration(probe, clock):
    session = make_session(probe, clock)
    clock.now = 10.0
    session.mark_iteration_start()
    clock.advance(1.0)
    reads = clock.calls
    session.mark_iteration_start()  # second microbatch: must not move the start
    clock.advance(0.5)
    session.mark_iteration_start()
    assert clock.calls == reads  # later marks do not read the clock
    clock.advance(1.0)
    session.on_training_log(iteration=1, loss_dict={})
    assert metric(session, "iteration-time") == {1: 2.5}
    assert session.iterations == [IterationRecord(1, 2.5, False)]


def test_an_iteration_runs_from_its_start_to_the_next_start(probe, clock):
    # Megatron's interval timer: what runs between training_log and the next train_step (the loop's
    # own work) is part of the iteration; the last one ends at its training_log.
    session = make_session(probe, clock)
    step(session, clock, 1, 2.0)
    clock.advance(100.0)
    step(session, clock, 2, 0.75)
    clock.advance(0.25)
    step(session, clock, 3, 0.25)
    clock.advance(7.0)  # after the last training_log: the run's teardown, in no iteration
    assert metric(session, "iteration-time") == {1: 102.0, 2: 1.0, 3: 0.25}
    assert [r.seconds for r in session.iterations] == [102.0, 1.0, 0.25]
    assert dict(session.finish(print_fn=lambda _: None).to_json())["eager_step_ms"] == 625.0  # median(1.0, 0.25)


def test_a_capture_between_iterations_ends_the_one_before(probe, clock):
    session = make_session(probe, clock)
    step(session, clock, 1, 1.0)
    clock.advance(0.5)
    session.mark_capture_start()  # the helper's create_cudagraphs
    clock.advance(30.0)
    step(session, clock, 2, 0.25)
    session.mark_capture_start()  # right after iteration 2's training_log: it ends there
    clock.advance(2.0)
    session.mark_iteration_start()  # so the next start does not move its end
    clock.advance(1.0)
    session.mark_capture_start()  # inside an iteration (none in Megatron's loop): its time
    clock.advance(1.0)
    session.on_training_log(iteration=3, loss_dict={})
    assert [r.seconds for r in session.iterations] == [1.5, 0.25, 2.0]


def test_the_step_path_reads_only_the_host_clock(clock):
    events = []

    class HostOnlyProbe:  # no synchronize: the session must not need one
        def allocated_bytes(self):
            events.append("allocated")
            return 0, 0

    def ticking_clock():
        events.append("clock")
        return clock()

    def one_step(config):
        events.clear()
        session = RunSession(config, probe=HostOnlyProbe(), clock=ticking_clock)
        session.mark_iteration_start()
        session.on_training_log(iteration=1, loss_dict={"lm loss": 2.0})
        return list(events), session

    assert one_step(KEEPS)[0] == ["clock", "allocated", "clock"]
    # Without --cg-metrics-out no value is kept: the times alone, for the printed report or --cg-report-out.
    for config in (None, PluginConfig(report_out=Path("unwritten-report.json"), print_report=False)):
        seen, session = one_step(config)
        assert seen == ["clock", "clock"] and session._logged[0].values == {}
    # Nothing asked for (no files, --cg-no-report): the step path does nothing at all.
    seen, session = one_step(PluginConfig(print_report=False))
    assert seen == [] and session.iterations == []


def test_the_cuda_probe_reads_the_allocator_once_without_flattening_it(monkeypatch):
    """torch.cuda.memory_allocated() flattens and sorts every allocator statistic (a large cost for
    it and max_memory_allocated() per logged step on a GPU host); the probe reads the nested counters once for both."""
    import torch

    reads = []

    def nested(device=None):
        reads.append(device)
        return {"allocated_bytes": {"all": {"current": 5, "peak": 9}, "large_pool": {"current": 4, "peak": 8}}}

    def flattening(*args, **kwargs):
        raise AssertionError("the probe flattened every allocator statistic")

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested)
    for name in ("memory_stats", "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, flattening)
    assert CudaProbe().allocated_bytes() == (5, 9) and len(reads) == 1


class DeviceScalar:
    """A device value as the session sees one: reading it (``item``, ``float``, ``tolist``,
    ``cpu``) is a device synchronization, so it counts the reads and fails while ``reads.open``
    is False."""

    def __init__(self, value: float, reads: Reads) -> None:
        self.value, self.reads = value, reads

    def detach(self) -> DeviceScalar:
        return self  # a view of the same value: reads nothing

    def item(self) -> float:
        self.reads.count()
        return self.value

    def __float__(self) -> float:
        return self.item()

    def tolist(self):
        return self.item()

    def cpu(self):
        self.reads.count()
        return self

    def __sub__(self, other):  # the MTP tap's difference of two totals stays on the device
        return DeviceScalar(self.value - float(getattr(other, "value", other)), self.reads)


class Reads:
    def __init__(self) -> None:
        self.open = False
        self.total = 0

    def count(self) -> None:
        if not self.open:
            raise AssertionError("a device value was read on the step path")
        self.total += 1


def test_no_step_synchronizes_the_device(probe, clock):
    session = make_session(probe, clock, PluginConfig(print_report=False))
    for iteration in range(1, 6):
        step(session, clock, iteration, 0.5, loss=10.0 - iteration, num_zeros_in_grad=100.0 * iteration)
    assert probe.synchronize_calls == 0  # the session before synchronized twice a step
    session.finish(print_fn=lambda _: None)
    assert probe.synchronize_calls == 0


def test_no_step_reads_a_device_value(probe, clock, tmp_path):
    session = make_session(probe, clock, PluginConfig(metrics_out=tmp_path / "metrics.json", print_report=False))
    reads = Reads()
    for iteration in range(1, 6):
        step(
            session,
            clock,
            iteration,
            0.5,
            loss=DeviceScalar(10.0 - iteration, reads),
            num_zeros_in_grad=DeviceScalar(100.0 * iteration, reads),
        )
    assert reads.total == 0  # the session before called .item() on the loss every step
    reads.open = True
    session.finish(print_fn=lambda _: None)
    assert reads.total == 10  # read once each, when the run ended


def test_kept_device_values_become_the_metrics_when_the_run_ends(probe, clock, tmp_path):
    config = PluginConfig(metrics_out=tmp_path / "metrics.json", print_report=False)
    session = make_session(probe, clock, config)
    reads = Reads()
    for iteration, loss in enumerate([10.5, 10.25, 10.125], start=1):
        session.on_mtp_losses({"mtp_1 loss": DeviceScalar(loss + 1.0, reads)})
        step(
            session,
            clock,
            iteration,
            0.25,
            loss=DeviceScalar(loss, reads),
            num_zeros_in_grad=DeviceScalar(float(iteration), reads),
        )
    reads.open = True
    session.finish()
    golden = GoldenValues.load(config.metrics_out)
    assert dict(golden.metrics["lm loss"].values) == {1: 10.5, 2: 10.25, 3: 10.125}
    assert dict(golden.metrics["mtp_1 loss"].values) == {1: 11.5, 2: 11.25, 3: 11.125}
    assert dict(golden.metrics["num-zeros"].values) == {1: 1.0, 2: 2.0, 3: 3.0}
    assert reads.total == 9
    assert session.metrics().to_json() == golden.to_json() and reads.total == 9  # read once, kept as numbers


def test_kept_values_are_read_in_batches_of_read_every(probe, clock):
    session = RunSession(KEEPS, probe=probe, clock=clock, read_every=3)
    reads = Reads()
    for iteration in (1, 2):
        step(session, clock, iteration, 0.5, loss=DeviceScalar(1.0, reads))
    reads.open = True
    step(session, clock, 3, 0.5, loss=DeviceScalar(1.0, reads))
    assert reads.total == 3  # the three kept so far, in one go
    reads.open = False
    step(session, clock, 4, 0.5, loss=DeviceScalar(2.0, reads))
    reads.open = True
    assert metric(session, "lm loss") == {1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0} and reads.total == 4


def test_read_every_must_be_positive(probe):
    with pytest.raises(ValueError, match="read_every=0: read the kept device values every 1 or more"):
        RunSession(None, probe=probe, read_every=0)


def test_kept_tensors_are_detached(probe, clock):
    session = make_session(probe, clock, KEEPS)
    weight = torch.ones(1, requires_grad=True)
    session.on_training_log(iteration=1, loss_dict={"lm loss": (weight * 3).sum()})
    assert not session._logged[0].values["lm loss"].requires_grad  # no autograd graph kept alive
    assert metric(session, "lm loss") == {1: 3.0}


def test_iterations_must_increase(probe, clock):
    session = make_session(probe, clock)
    session.on_training_log(iteration=2, loss_dict={})
    with pytest.raises(ValueError, match="training_log at iteration 2 after iteration 2: iterations must increase"):
        session.on_training_log(iteration=2, loss_dict={})


def test_iteration_without_marked_start_has_no_time(probe, clock):
    session = make_session(probe, clock, KEEPS)
    session.on_training_log(iteration=1, loss_dict={"lm loss": 3.0})
    step(session, clock, 2, 0.5, loss=2.0)
    session.on_training_log(iteration=3, loss_dict={"lm loss": 1.0})
    assert metric(session, "iteration-time") == {2: 0.5}
    assert metric(session, "lm loss") == {1: 3.0, 2: 2.0, 3: 1.0}
    assert [r.seconds for r in session.iterations] == [None, 0.5, None]


@pytest.mark.parametrize(
    "loss, expected",
    [
        (torch.tensor(2.5), 2.5),
        (torch.tensor([1.25]), 1.25),
        (torch.tensor(10.95659, dtype=torch.float32), float(np.float32(10.95659))),
        (3.25, 3.25),
        (7, 7.0),
        (np.float64(0.125), 0.125),
    ],
)
def test_lm_loss_from_tensor_or_number(probe, clock, loss, expected):
    session = make_session(probe, clock, KEEPS)
    session.on_training_log(iteration=4, loss_dict={"lm loss": loss, "other loss": 99.0})
    values = metric(session, "lm loss")
    assert values == {4: expected}
    assert type(values[4]) is float
    assert "other loss" not in session.metrics().metrics


def test_no_lm_loss_key_records_no_loss(probe, clock):
    session = make_session(probe, clock, KEEPS)
    session.on_training_log(iteration=1, loss_dict={"loss": 1.0})
    assert "lm loss" not in session.metrics().metrics


@pytest.mark.parametrize(
    "zeros, expected",
    [
        (torch.tensor(56862.0), 56862.0),
        (56922, 56922.0),
        (0, 0.0),  # zero zeros is a value, not "absent"
        (0.0, 0.0),
    ],
)
def test_num_zeros_when_given(probe, clock, zeros, expected):
    session = make_session(probe, clock, KEEPS)
    session.on_training_log(iteration=2, loss_dict={}, num_zeros_in_grad=zeros)
    assert metric(session, "num-zeros") == {2: expected}


def test_num_zeros_absent_when_none(probe, clock):
    session = make_session(probe, clock, KEEPS)
    session.on_training_log(iteration=1, loss_dict={}, num_zeros_in_grad=None)
    session.on_training_log(iteration=2, loss_dict={})
    assert "num-zeros" not in session.metrics().metrics


def test_memory_bytes_every_iteration(probe, clock):
    session = make_session(probe, clock, KEEPS)
    session.on_training_log(iteration=1, loss_dict={})
    probe.allocated, probe.max_allocated = 5, 4096
    session.on_training_log(iteration=2, loss_dict={})
    assert metric(session, "mem-allocated-bytes") == {1: float(ALLOC), 2: 5.0}
    assert metric(session, "mem-max-allocated-bytes") == {1: float(MAX_ALLOC), 2: 4096.0}


def test_graphed_flag_follows_attached_helpers(probe, clock):
    session = make_session(probe, clock)
    step(session, clock, 1, 1.0)  # no helpers: eager
    first, second = FakeHelper(), FakeHelper()
    session.attach_helper(first)
    session.attach_helper(second)
    step(session, clock, 2, 1.0)
    second.created = True  # any helper with graphs makes the step graphed
    step(session, clock, 3, 1.0)
    second.created = False  # graphs deleted
    step(session, clock, 4, 1.0)
    assert [r.graphed for r in session.iterations] == [False, False, True, False]
    assert session.helpers == [first, second]


# ---------------------------------------------------------------- report


def test_report_steady_medians_skip_first_step_of_each_phase(probe, clock):
    session = make_session(probe, clock, PluginConfig(preset="tiny-gpt"))
    helper = FakeHelper()
    session.attach_helper(helper)
    for iteration, seconds in enumerate([8.0, 1.0, 1.5, 1.25], start=1):
        step(session, clock, iteration, seconds)
    session.on_training_log(iteration=5, loss_dict={})  # unmarked: counts as an iteration only
    helper.created = True
    for iteration, seconds in enumerate([4.0, 0.5, 0.75, 0.25, 1.0], start=6):
        step(session, clock, iteration, seconds)

    report = session.report()
    assert report.preset == "tiny-gpt"
    assert report.iterations == 10
    assert report.eager_steps == 4
    assert report.graphed_steps == 5
    assert report.eager_step_ms == 1250.0  # median(1.0, 1.5, 1.25); 8.0 dropped
    assert report.graphed_step_ms == 625.0  # median(0.5, 0.75, 0.25, 1.0); 4.0 dropped
    assert report.step_time_reduction == 0.5
    assert report.scopes == ()


def test_report_without_steps(probe, clock):
    report = make_session(probe, clock).report()
    assert report.iterations == 0
    assert report.eager_step_ms is None and report.graphed_step_ms is None
    assert report.preset is None


def test_report_single_step_per_phase_has_no_median(probe, clock):
    session = make_session(probe, clock)
    helper = FakeHelper()
    session.attach_helper(helper)
    step(session, clock, 1, 1.0)
    helper.created = True
    step(session, clock, 2, 0.5)
    report = session.report()
    assert (report.eager_steps, report.graphed_steps) == (1, 1)
    assert report.eager_step_ms is None and report.graphed_step_ms is None


def test_report_scopes_from_helpers_capture_stats(probe, clock):
    session = make_session(probe, clock)
    attn_counter, layer_counter = ReplayCounter(2), ReplayCounter(3)
    attn_counter.counts[:] = [4, 6]
    layer_counter.counts[:] = [1, 2, 3]
    session.attach_helper(FakeHelper(True, CaptureStats("attn+moe_router", 2, 4, 1.5, 2048, attn_counter)))
    session.attach_helper(FakeHelper(True, None))  # helper that captured nothing
    session.attach_helper(NoStatsHelper())  # helper without the attribute at all
    session.attach_helper(FakeHelper(True, CaptureStats("layer", 3, 6, 0.25, 0, layer_counter)))

    scopes = session.report().scopes
    assert [s.scope for s in scopes] == ["attn+moe_router", "layer"]
    attn, layer = scopes
    assert (
        attn.layers,
        attn.graphs_captured,
        attn.replays,
        attn.capture_seconds,
        attn.pool_bytes,
        attn.replays_per_layer,
    ) == (2, 4, 10, 1.5, 2048, (4, 6))
    assert (layer.replays, layer.replays_per_layer) == (6, (1, 2, 3))

    layer_counter.counts[0] += 10  # the report reads the live counter when built
    assert session.report().scopes[1].replays == 16


def test_report_sums_the_slot_layers_memory_and_sets_the_plan_beside_it(probe, clock):
    from megatron_cg_plugin.slot_sharing.megatron_backend import LayerSlotStats

    session = make_session(probe, clock)
    counter = ReplayCounter(2)
    counter.counts[:] = [3, 5]
    layers = (
        LayerSlotStats(arena_bytes=10, host_arena_bytes=4, offloaded_bytes=2, boundary_bytes=7),
        LayerSlotStats(arena_bytes=20, host_arena_bytes=0, offloaded_bytes=1, boundary_bytes=3),
    )
    session.attach_helper(
        FakeHelper(True, CaptureStats("layer (slot-shared)", 2, 4, 1.0, 0, counter, slot_layers=lambda: layers))
    )
    session.predict(
        RunPrediction(
            GraphMemoryPlan(
                graphs=2, pool_bytes=0, peak_live_bytes=0, host_arena_bytes=4, arena_bytes=31, boundary_bytes=9
            )
        )
    )
    report = session.report()
    scope = report.scopes[0]
    assert (scope.arena_bytes, scope.host_arena_bytes, scope.boundary_bytes, scope.offloaded_bytes) == (30, 4, 10, 11)
    assert (report.predicted_arena_bytes, report.predicted_boundary_bytes, report.predicted_host_arena_bytes) == (
        31,
        9,
        4,
    )


def test_report_lists_graph_banks_live(probe, clock):
    session = make_session(probe, clock)
    banks = [{"cp_size": 1, "replays": 3, "rejected": 0}, {"cp_size": 2, "replays": 5, "rejected": 1}]
    counter = ReplayCounter(2)
    session.attach_helper(
        FakeHelper(
            True, CaptureStats("layer (banks CP 1/2)", 2, 8, 1.0, 0, counter, banks=lambda: [dict(b) for b in banks])
        )
    )
    report = session.report()
    assert report.scopes[0].banks == tuple(banks)
    table = report.format_table()
    assert "layer (banks CP 1/2): bank CP 1: 3 replays, 0 rejected" in table
    assert "layer (banks CP 1/2): bank CP 2: 5 replays, 1 rejected" in table
    assert report.to_json()["scopes"][0]["banks"][1] == {"cp_size": 2, "replays": 5, "rejected": 1}
    banks[0]["replays"] = 7
    assert session.report().scopes[0].banks[0]["replays"] == 7


# ---------------------------------------------------------------- config


def test_config_defaults(probe, clock):
    assert make_session(probe, clock).config == PluginConfig()


def test_deferred_config_is_resolved_once_on_first_use(probe, clock):
    calls = []

    def source():
        calls.append(1)
        return PluginConfig(preset="tiny-moe")

    session = make_session(probe, clock, source)
    assert calls == []  # constructing the session does not resolve it
    assert session.config.preset == "tiny-moe"
    assert session.report().preset == "tiny-moe"
    assert calls == [1]


# ---------------------------------------------------------------- finish


def run_three_steps(session, clock):
    step(session, clock, 1, 2.0, loss=torch.tensor(10.5), num_zeros_in_grad=torch.tensor(56862.0))
    step(session, clock, 2, 0.5, loss=10.25, num_zeros_in_grad=56922.0)
    step(session, clock, 3, 0.25, loss=torch.tensor(10.125), num_zeros_in_grad=0)


def test_finish_on_rank0_writes_metrics_and_report(probe, clock, tmp_path):
    config = PluginConfig(
        preset="tiny-gpt", metrics_out=tmp_path / "out" / "metrics.json", report_out=tmp_path / "out" / "report.json"
    )
    session = make_session(probe, clock, config)
    run_three_steps(session, clock)
    printed = []

    report = session.finish(print_fn=printed.append)

    golden = GoldenValues.load(config.metrics_out)
    assert set(golden.metrics) == {
        "lm loss",
        "num-zeros",
        "iteration-time",
        "mem-allocated-bytes",
        "mem-max-allocated-bytes",
    }
    assert dict(golden.metrics["lm loss"].values) == {1: 10.5, 2: 10.25, 3: 10.125}
    assert dict(golden.metrics["num-zeros"].values) == {1: 56862.0, 2: 56922.0, 3: 0.0}
    assert dict(golden.metrics["iteration-time"].values) == {1: 2.0, 2: 0.5, 3: 0.25}
    assert dict(golden.metrics["mem-allocated-bytes"].values) == {1: ALLOC, 2: ALLOC, 3: ALLOC}
    assert dict(golden.metrics["mem-max-allocated-bytes"].values) == dict.fromkeys((1, 2, 3), MAX_ALLOC)
    for series in golden.metrics.values():
        assert (series.start_step, series.end_step, series.step_interval) == (1, 3, 1)

    saved = json.loads(config.report_out.read_text())
    assert saved == json.loads(json.dumps(report.to_json()))
    assert saved["preset"] == "tiny-gpt"
    assert saved["iterations"] == 3
    assert saved["eager_step_ms"] == 375.0  # median(0.5, 0.25) after the first step

    assert printed == [report.format_table()]
    assert "eager 375.00 ms (3 steps)" in printed[0]


def test_finish_on_rank0_respects_missing_paths_and_print_flag(probe, clock, tmp_path):
    session = make_session(probe, clock, PluginConfig(print_report=False))
    run_three_steps(session, clock)
    printed = []
    report = session.finish(print_fn=printed.append)
    assert printed == []
    assert report.iterations == 0  # nothing asked for: nothing recorded per step
    assert list(tmp_path.iterdir()) == []


def test_finish_off_rank0_writes_nothing(probe, clock, tmp_path):
    config = PluginConfig(metrics_out=tmp_path / "metrics.json", report_out=tmp_path / "report.json")
    probe.rank0 = False
    session = make_session(probe, clock, config)
    run_three_steps(session, clock)
    printed = []
    report = session.finish(print_fn=printed.append)
    assert printed == []
    assert not config.metrics_out.exists() and not config.report_out.exists()
    assert list(tmp_path.iterdir()) == []
    assert report.iterations == 3  # the report is still returned


def test_finish_runs_once_per_run(probe, clock, tmp_path):
    # Megatron's train() ends the run (the train-end-report patch); a script's own finish() after it
    # must neither print the report again nor rewrite the files.
    config = PluginConfig(metrics_out=tmp_path / "metrics.json")
    session = make_session(probe, clock, config)
    run_three_steps(session, clock)
    printed = []
    first = session.finish(print_fn=printed.append)
    config.metrics_out.unlink()
    assert session.finish(print_fn=printed.append) is first
    assert len(printed) == 1 and not config.metrics_out.exists()


def test_resolve_config_takes_the_flags_unless_a_config_was_given(probe, clock):
    deferred = RunSession(lambda: PluginConfig(contract_check="off"), probe=probe, clock=clock)
    assert not deferred.config_resolved
    deferred.resolve_config(PluginConfig(contract_check="shapes"))
    assert deferred.config.contract_check == "shapes"
    deferred.resolve_config(PluginConfig(contract_check="full"))  # resolved once: kept
    assert deferred.config.contract_check == "shapes"
    explicit = RunSession(PluginConfig(print_report=False), probe=probe, clock=clock)
    explicit.resolve_config(PluginConfig())
    assert explicit.config == PluginConfig(print_report=False)


def test_the_model_config_a_script_changed_redoes_the_prediction_the_report_prints(probe, clock):
    session = make_session(probe, clock, PluginConfig())
    flags_plan, config_plan = object(), object()
    session.predict(RunPrediction(graph_memory=flags_plan))
    session.model_config_seen(object())  # no check ran (no repredictor): the prediction stays
    assert session.prediction.graph_memory is flags_plan
    config = object()
    session.predict(
        RunPrediction(graph_memory=flags_plan, repredict=lambda seen: config_plan if seen is config else None)
    )
    session.model_config_seen(config)
    assert session.prediction.graph_memory is config_plan
    session.model_config_seen(object())  # None: the prediction could not be redone, so the report shows none
    assert session.prediction.graph_memory is None


def test_the_report_reads_the_prediction_the_session_was_given(probe, clock):
    from megatron_cg_plugin.moe.capacity import MoeCapacityPlan, uniform_load

    session = make_session(probe, clock)
    assert session.report().predicted_pool_bytes is None and session.report().moe_planned_capacity is None
    plan = MoeCapacityPlan(tokens_per_rank=512, topk=2, num_experts=8, capacity_factor=1.0)
    memory = GraphMemoryPlan(pool_bytes=3 * 2**20, peak_live_bytes=2**20, graphs=2, unpredicted=("pipeline",))
    session.predict(RunPrediction(graph_memory=memory, moe_capacity=plan))
    session.record_moe_drops(0.25)
    report = session.report()
    assert (report.predicted_pool_bytes, report.prediction_leaves_out, report.predicted_arena_bytes) == (
        3 * 2**20,
        ("pipeline",),
        None,
    )
    assert report.moe_planned_capacity == plan.capacity
    assert report.moe_uniform_dropped_fraction == plan.dropped_fraction(uniform_load(8))
    assert report.moe_dropped_fraction == 0.25
