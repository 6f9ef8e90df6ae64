"""Evaluations during training under graphs: the session records their losses and counts what the
graphed layers did inside them (eager calls, and replays, which must stay none); the evaluation tap
hands Megatron's evaluate result over unchanged; the report carries the counts, also into
TensorBoard (``--cg-log-to-tensorboard``)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_cg_plugin.capture.accounting import ReplayCounter
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.patching import builders
from megatron_cg_plugin.session import CaptureStats, RunSession
from tests.unit.test_session import DeviceScalar, FakeHelper, Reads, step

KEEPS = PluginConfig(metrics_out=Path("unwritten-metrics.json"), print_report=False)


class Layer(torch.nn.Module):
    """A transformer layer as Megatron's TE graph path leaves it: its captured graphs in ``cuda_graphs``."""

    def __init__(self, graphed: bool) -> None:
        super().__init__()
        self.cuda_graphs = [object()] if graphed else []
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def chunk(*layers: Layer) -> torch.nn.Module:
    return torch.nn.Sequential(*layers)


def session_with_replays(probe, clock, config=KEEPS) -> tuple[RunSession, ReplayCounter]:
    session = RunSession(config, probe=probe, clock=clock)
    counter = ReplayCounter(2)
    session.attach_helper(FakeHelper(True, CaptureStats("layer", 2, 2, 0.5, 1024, counter)))
    return session, counter


def test_an_evaluation_counts_the_graphed_layers_eager_calls_only(probe, clock):
    session, _ = session_with_replays(probe, clock)
    model = [chunk(Layer(True), Layer(False)), chunk(Layer(True))]
    x = torch.ones(1, 2)
    with session.evaluating(model):
        for _ in range(3):  # three microbatches through both chunks
            for part in model:
                part(x)
    assert (session.evaluations, session.evaluation_eager_layer_calls, session.evaluation_replays) == (1, 6, 0)
    report = session.report()
    assert (report.evaluations, report.evaluation_eager_layer_calls, report.evaluation_replays) == (1, 6, 0)
    assert "evaluations: 1, graphed layers ran 6 times eagerly in them (0 replays)" in report.format_table()


def test_the_counting_hooks_live_for_the_evaluation_only(probe, clock):
    session, _ = session_with_replays(probe, clock)
    layer = Layer(True)
    with session.evaluating([chunk(layer)]):
        assert len(layer._forward_pre_hooks) == 1
    assert not layer._forward_pre_hooks
    layer(torch.ones(1, 2))  # a training step's call after the evaluation: not counted
    assert session.evaluation_eager_layer_calls == 0


def test_the_hooks_go_when_the_evaluation_raises(probe, clock):
    session, _ = session_with_replays(probe, clock)
    layer = Layer(True)
    with pytest.raises(RuntimeError), session.evaluating([chunk(layer)]):
        raise RuntimeError("evaluation failed")
    assert not layer._forward_pre_hooks


def test_a_replay_inside_an_evaluation_is_counted(probe, clock):
    session, counter = session_with_replays(probe, clock)
    with session.evaluating([chunk(Layer(True))]):
        counter.counts[1] += 2  # a graph replayed while evaluating: the report shows it, the farm refuses it
    assert session.evaluation_replays == 2


def test_validation_losses_are_recorded_at_the_iteration_they_followed_and_read_once(probe, clock, tmp_path):
    config = PluginConfig(metrics_out=tmp_path / "metrics.json", print_report=False)
    session = RunSession(config, probe=probe, clock=clock)
    reads = Reads()
    for iteration in range(1, 7):
        step(session, clock, iteration, 0.5, loss=DeviceScalar(10.0 - iteration, reads))
        if iteration % 3 == 0:
            session.on_evaluation({"lm loss": DeviceScalar(20.0 + iteration, reads)})
    assert reads.total == 0  # kept on the device like the training losses
    reads.open = True
    session.finish(print_fn=lambda _: None)
    metrics = session.metrics().metrics
    assert dict(metrics["lm loss validation"].values) == {3: 23.0, 6: 26.0}
    assert metrics["lm loss validation"].step_interval == 3
    assert reads.total == 8


def test_a_second_validation_set_of_an_iteration_gets_a_suffix(probe, clock):
    session = RunSession(KEEPS, probe=probe, clock=clock)
    step(session, clock, 1, 0.5, loss=1.0)
    session.on_evaluation({"lm loss": 2.0})
    session.on_evaluation({"lm loss": 3.0})
    metrics = session.metrics().metrics
    assert dict(metrics["lm loss validation"].values) == {1: 2.0}
    assert dict(metrics["lm loss validation-1"].values) == {1: 3.0}


def test_validation_losses_are_not_kept_without_a_metrics_file(probe, clock):
    session = RunSession(PluginConfig(print_report=False), probe=probe, clock=clock)
    step(session, clock, 1, 0.5, loss=1.0)
    session.on_evaluation({"lm loss": 2.0})
    assert "lm loss validation" not in session.metrics().metrics


def test_the_evaluation_tap_returns_megatrons_result_and_hands_over_the_losses(probe, clock):
    session, _ = session_with_replays(probe, clock)
    step(session, clock, 5, 0.5, loss=1.0)
    calls = []
    layer = Layer(True)

    def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False):
        calls.append(len(layer._forward_pre_hooks))  # inside: the layer is counted
        layer(torch.ones(1, 2))
        return {"lm loss": 4.5}, None, False

    tap = builders.build_evaluation_tap(evaluate, session)
    result = tap(None, None, [chunk(layer)], None, None)
    assert result == ({"lm loss": 4.5}, None, False)
    assert calls == [1] and session.evaluation_eager_layer_calls == 1
    assert dict(session.metrics().metrics["lm loss validation"].values) == {5: 4.5}


def test_an_evaluation_ended_by_the_time_limit_records_no_loss(probe, clock):
    session, _ = session_with_replays(probe, clock)
    tap = builders.build_evaluation_tap(lambda forward_step_func, data_iterator, model: (None, None, True), session)
    assert tap(None, None, model=[]) == (None, None, True)
    assert session.evaluations == 1 and "lm loss validation" not in session.metrics().metrics


def test_the_report_scalars_carry_the_graph_and_evaluation_figures(probe, clock):
    session, counter = session_with_replays(probe, clock)
    counter.counts[:] = [3, 4]
    counter.rejected[:] = [0, 1]
    with session.evaluating([chunk(Layer(True))]) as _:
        chunk(Layer(True))(torch.ones(1, 2))  # not a graphed layer of the evaluated model: not counted
    scalars = session.report().scalars()
    assert scalars["cuda-graphs/graphs-captured"] == 2.0
    assert scalars["cuda-graphs/replays"] == 7.0 and scalars["cuda-graphs/replays-refused"] == 1.0
    assert scalars["cuda-graphs/pool-bytes"] == 1024.0
    assert scalars["cuda-graphs/evaluation-eager-layer-calls"] == 0.0
    assert "cuda-graphs/eager-step-ms" not in scalars  # no median without steps: left out, not written as 0
    assert all(tag.startswith("cuda-graphs/") and isinstance(v, float) for tag, v in scalars.items())


class Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.flushed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        self.flushed = True


@pytest.fixture
def tensorboard_writer(monkeypatch):
    """Megatron's global TensorBoard writer (``global_vars.get_tensorboard_writer``), faked."""
    writer = Writer()
    module = types.ModuleType("megatron.training.global_vars")
    module.get_tensorboard_writer = lambda: writer
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", module)
    return writer


@pytest.mark.parametrize("asked", [True, False])
def test_the_report_goes_to_tensorboard_when_asked_for(probe, clock, tensorboard_writer, asked):
    session, _ = session_with_replays(probe, clock, PluginConfig(print_report=False, log_to_tensorboard=asked))
    step(session, clock, 7, 0.5)
    train = builders.build_train_end_report(lambda *args, **kwargs: "trained", session)
    assert train(None, [], None) == "trained"
    tags = {tag: (value, at) for tag, value, at in tensorboard_writer.scalars}
    if asked:
        assert tags["cuda-graphs/graphs-captured"] == (2.0, 7) and tensorboard_writer.flushed
    else:
        assert not tags and not tensorboard_writer.flushed


def test_a_rank_without_a_writer_logs_nothing(probe, clock, monkeypatch):
    module = types.ModuleType("megatron.training.global_vars")
    module.get_tensorboard_writer = lambda: None  # Megatron makes the writer on the last rank only
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", module)
    session, _ = session_with_replays(probe, clock, PluginConfig(print_report=False, log_to_tensorboard=True))
    builders.build_train_end_report(lambda *args, **kwargs: None, session)(None, [], None)
