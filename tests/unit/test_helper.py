"""Tests for megatron_cg_plugin.helper: the plugin's TECudaGraphHelper subclass, on a CPU fake of
Megatron's helper."""

from __future__ import annotations

import enum
import types

import pytest

from megatron_cg_plugin import diagnostics
from megatron_cg_plugin import helper as helper_module
from megatron_cg_plugin.diagnostics import CountingGraph
from megatron_cg_plugin.helper import PluginHelperMixin, bind_helper_class, scope_label
from megatron_cg_plugin.session import RunSession

MiB = 2**20


class Scope(enum.Enum):  # shaped like megatron.core.transformer.enums.CudaGraphModule
    attn = 1
    mlp = 2
    moe_router = 4


class FakeGraph:
    def __init__(self, layer: int, microbatch: int) -> None:
        self.layer, self.microbatch = layer, microbatch
        self.calls = 0
        self.resets = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return ("out", self.layer, self.microbatch, args, kwargs)

    def reset(self) -> None:
        self.resets += 1


class FakeLayer:
    def __init__(self, number: int) -> None:
        self.number = number
        self.cuda_graphs: list = []


class FakeAllocator:
    """What ``diagnostics.allocator_segments`` would see: one graph pool appears per capture."""

    def __init__(self) -> None:
        self.pools: list[tuple[tuple[int, int], int]] = [((0, 0), 50 * MiB), ((1, 0), 3 * MiB)]
        self.snapshots = 0

    def capture(self, pool_id: tuple[int, int], sizes: list[int]) -> None:
        self.pools += [(pool_id, size) for size in sizes]
        self.pools.append(((0, 0), 7 * MiB))  # ordinary allocations during capture

    def segments(self) -> list[dict]:
        self.snapshots += 1
        return [{"segment_pool_id": pool, "total_size": size} for pool, size in self.pools]


class FakeTECudaGraphHelper:
    """A small fake of megatron.core.transformer.cuda_graphs.TECudaGraphHelper (same lifecycle)."""

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=[]):
        self.model = model
        self.config = config
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.optimizers = optimizers
        self.num_microbatches = config.num_microbatches
        self.callables_per_chunk = [list(chunk) for chunk in model]
        self._capture_finished = False
        self._graphs_created = False
        self.allocator = config.allocator
        self.clock = config.clock

    def create_cudagraphs(self):
        layers = [layer for chunk in self.callables_per_chunk for layer in chunk]
        if layers:
            for layer in layers:
                layer.cuda_graphs = [FakeGraph(layer.number, mb) for mb in range(self.num_microbatches)]
            if self.allocator is not None:
                self.allocator.capture((9, 1), [2 * MiB, 6 * MiB])
            self._graphs_created = True
        if self.clock is not None:
            self.clock.now += 2.5  # capture takes 2.5 s
        self._capture_finished = True

    def capture_finished(self):
        return self._capture_finished

    def graphs_created(self):
        return self._graphs_created

    def cuda_graph_set_manual_hooks(self):
        pass

    def delete_cuda_graphs(self):
        assert self._graphs_created, "No CUDA Graphs were created to delete."
        for layers in self.callables_per_chunk:
            for layer in layers:
                for graph in layer.cuda_graphs:
                    graph.reset()
                layer.cuda_graphs = []
        self._graphs_created = False


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_config(modules=(), num_microbatches=2, allocator=None, clock=None):
    return types.SimpleNamespace(cuda_graph_modules=list(modules), num_microbatches=num_microbatches,
                                 allocator=allocator, clock=clock)


@pytest.fixture
def session(probe, clock):
    return RunSession(None, probe=probe, clock=clock)


@pytest.fixture
def allocator(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(diagnostics, "allocator_segments", fake.segments)
    return fake


@pytest.fixture
def capture_clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(helper_module, "time", types.SimpleNamespace(perf_counter=fake))
    return fake


def two_chunk_model():
    return [[FakeLayer(0), FakeLayer(1)], [FakeLayer(2)]]


# ---------------------------------------------------------------- scope_label


@pytest.mark.parametrize("modules, expected", [
    ([], "layer"),
    ((), "layer"),
    (None, "layer"),
    ([Scope.attn], "attn"),
    ([Scope.attn, Scope.moe_router], "attn+moe_router"),
    ([Scope.moe_router, Scope.attn], "moe_router+attn"),  # Megatron's order is kept
    (["attn", "mlp"], "attn+mlp"),
    ([types.SimpleNamespace(name="moe_preprocess"), "mlp"], "moe_preprocess+mlp"),
])
def test_scope_label(modules, expected):
    assert scope_label(modules) == expected


def test_scope_label_with_megatron_enum():
    from megatron.core.transformer.enums import CudaGraphModule

    assert scope_label([CudaGraphModule.attn, CudaGraphModule.moe_router]) == "attn+moe_router"
    assert scope_label(iter([CudaGraphModule.mlp])) == "mlp"


# ---------------------------------------------------------------- binding


def test_bind_helper_class_subclasses_the_base(session):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    assert issubclass(cls, FakeTECudaGraphHelper)
    assert issubclass(cls, PluginHelperMixin)
    assert cls.session is session
    assert cls.__name__ == "PluginTECudaGraphHelper"
    assert cls.__mro__[1:3] == (PluginHelperMixin, FakeTECudaGraphHelper)
    assert not hasattr(FakeTECudaGraphHelper, "session")  # the base is left untouched


def test_each_binding_reports_to_its_own_session(probe, clock):
    first, second = RunSession(None, probe=probe, clock=clock), RunSession(None, probe=probe, clock=clock)
    cls_a = bind_helper_class(FakeTECudaGraphHelper, first)
    cls_b = bind_helper_class(FakeTECudaGraphHelper, second)
    a = cls_a(two_chunk_model(), fake_config(), 128, 1)
    b = cls_b(two_chunk_model(), fake_config(), 128, 1)
    assert first.helpers == [a] and second.helpers == [b]


def test_instance_passes_arguments_through_and_attaches(session):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    model, config, optimizers = two_chunk_model(), fake_config(), [object()]
    instance = cls(model, config, seq_length=256, micro_batch_size=4, optimizers=optimizers)
    assert (instance.model, instance.config, instance.seq_length, instance.micro_batch_size,
            instance.optimizers) == (model, config, 256, 4, optimizers)
    assert instance.capture_stats is None
    assert session.helpers == [instance]
    assert instance.graphs_created() is False


# ---------------------------------------------------------------- create_cudagraphs


def test_create_cudagraphs_wraps_every_layer_graph(session, allocator, capture_clock):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    model = two_chunk_model()
    instance = cls(model, fake_config([Scope.attn, Scope.moe_router], num_microbatches=3), 128, 1)
    instance.create_cudagraphs()

    layers = [layer for chunk in model for layer in chunk]
    for layer in layers:
        assert len(layer.cuda_graphs) == 3
        assert all(isinstance(graph, CountingGraph) for graph in layer.cuda_graphs)
        assert [graph.graph.microbatch for graph in layer.cuda_graphs] == [0, 1, 2]
        assert {graph.graph.layer for graph in layer.cuda_graphs} == {layer.number}
    assert instance.graphs_created() and instance.capture_finished()


def test_replays_are_counted_per_layer_in_the_report(session, allocator, capture_clock):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    model = two_chunk_model()
    instance = cls(model, fake_config(num_microbatches=2), 128, 1)
    instance.create_cudagraphs()
    layer0, layer1 = model[0]
    (layer2,) = model[1]

    assert layer1.cuda_graphs[1]("hidden", mask=None) == ("out", 1, 1, ("hidden",), {"mask": None})
    layer1.cuda_graphs[0]("hidden")
    layer2.cuda_graphs[0]("hidden")

    stats = instance.capture_stats
    assert stats.replays.counts == [0, 2, 1]  # slots follow callables_per_chunk, chunks flattened
    (scope,) = session.report().scopes
    assert scope.replays == 3
    assert scope.replays_per_layer == (0, 2, 1)
    assert layer1.cuda_graphs[1].graph.calls == 1


def test_capture_stats_fields(session, allocator, capture_clock):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    instance = cls(two_chunk_model(), fake_config([Scope.attn, Scope.moe_router], num_microbatches=4,
                                                  allocator=allocator, clock=capture_clock), 128, 1)
    instance.create_cudagraphs()

    stats = instance.capture_stats
    assert stats.scope == "attn+moe_router"
    assert stats.layers == 3
    assert stats.graphs == 12
    assert stats.seconds == 2.5
    assert stats.pool_bytes == 8 * MiB  # the new pool (9, 1): two segments; old pool and (0, 0) left out
    assert allocator.snapshots == 2  # before and after the capture
    assert stats.replays.counts == [0, 0, 0]

    (scope,) = session.report().scopes
    assert (scope.scope, scope.layers, scope.graphs_captured, scope.capture_seconds, scope.pool_bytes) == (
        "attn+moe_router", 3, 12, 2.5, 8 * MiB)


def test_whole_layer_scope_label(session, allocator, capture_clock):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    instance = cls(two_chunk_model(), fake_config([]), 128, 1)
    instance.create_cudagraphs()
    assert instance.capture_stats.scope == "layer"


def test_pool_bytes_zero_without_cuda_snapshots(session, capture_clock, monkeypatch):
    monkeypatch.setattr(diagnostics, "allocator_segments", lambda: [])
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    instance = cls(two_chunk_model(), fake_config(), 128, 1)
    instance.create_cudagraphs()
    assert instance.capture_stats.pool_bytes == 0


def test_no_graphs_created_leaves_capture_stats_none(session, allocator, capture_clock):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    instance = cls([[], []], fake_config([Scope.attn]), 128, 1)  # no graphable layers
    instance.create_cudagraphs()
    assert instance.capture_finished() and not instance.graphs_created()
    assert instance.capture_stats is None
    assert session.report().scopes == ()


def test_session_sees_graphed_steps_after_capture(session, allocator, capture_clock, clock):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    instance = cls(two_chunk_model(), fake_config(), 128, 1)
    session.on_training_log(iteration=1, loss_dict={})
    instance.create_cudagraphs()
    session.on_training_log(iteration=2, loss_dict={})
    instance.delete_cuda_graphs()
    session.on_training_log(iteration=3, loss_dict={})
    assert [r.graphed for r in session.iterations] == [False, True, False]


def test_megatron_teardown_resets_the_wrapped_graphs(session, allocator, capture_clock):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    model = two_chunk_model()
    instance = cls(model, fake_config(num_microbatches=2), 128, 1)
    instance.create_cudagraphs()
    underlying = [graph.graph for chunk in model for layer in chunk for graph in layer.cuda_graphs]
    instance.delete_cuda_graphs()  # base calls graph.reset() on every (wrapped) graph
    assert [graph.resets for graph in underlying] == [1] * 6
    assert all(layer.cuda_graphs == [] for chunk in model for layer in chunk)
    assert instance.capture_stats.replays.total == 0  # resets are not replays


def test_recapture_replaces_stats_with_a_fresh_counter(session, allocator, capture_clock):
    cls = bind_helper_class(FakeTECudaGraphHelper, session)
    model = two_chunk_model()
    instance = cls(model, fake_config(num_microbatches=1), 128, 1)
    instance.create_cudagraphs()
    model[0][0].cuda_graphs[0]()
    instance.delete_cuda_graphs()
    instance.create_cudagraphs()
    assert all(isinstance(g.graph, FakeGraph) for chunk in model for layer in chunk
               for g in layer.cuda_graphs)  # wrapped once, not wrappers of wrappers
    assert instance.capture_stats.replays.counts == [0, 0, 0]
    assert len(session.report().scopes) == 1
