"""Tests for megatron_cg_plugin.capture_lifecycle: the plugin's TECudaGraphHelper subclass (transactional,
fail-closed capture; replay contracts; measured teardown), on CPU fakes of Megatron's helper and of
Transformer Engine's ``make_graphed_callables`` (through the ``GraphBackend`` seam)."""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import re
import time
import types

import pytest
import torch
from megatron.core.transformer import cuda_graphs as mcg

from megatron_cg_plugin import capture_lifecycle
from megatron_cg_plugin.capture import accounting, stale_graphs
from megatron_cg_plugin.capture.accounting import MemoryState, TeardownStats
from megatron_cg_plugin.capture.contracts import CheckedGraph, ContractViolation
from megatron_cg_plugin.capture.stale_graphs import StaleAutogradGraphError
from megatron_cg_plugin.capture.transaction import attribute, gc_state
from megatron_cg_plugin.capture_lifecycle import (
    CaptureFailedError,
    InjectedCaptureFailure,
    PluginHelperMixin,
    _CaptureTracker,
    bind_helper_class,
    scope_label,
)
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.session import RunPrediction, RunSession
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.setups import memory_guard

MiB = 2**20
MISSING = object()
SEQ, MBS, HIDDEN = 8, 2, 4


# ====================================================================== fakes


class Scope(enum.Enum):  # shaped like megatron.core.transformer.enums.CudaGraphModule
    attn = 1
    mlp = 2
    moe_router = 4


class FakeMemory:
    """What ``accounting.memory_state`` would report: each fake CUDA graph adds a private pool
    (2 MiB) and 1 MiB of allocated static buffers; ``reset()`` frees them (unless it leaks)."""

    def __init__(self) -> None:
        self.allocated = 100 * MiB
        self.pools: dict[tuple[int, int], int] = {(1, 0): 3 * MiB}  # a pool older than the capture
        self.pinned = 4096
        self.calls = 0

    def state(self) -> MemoryState:
        self.calls += 1
        return MemoryState(allocated=self.allocated, pools=dict(self.pools), pinned_host=self.pinned)


class FakeCudaGraph:
    """The graph object TE creates per captured callable (a ``torch.cuda.CUDAGraph``)."""

    def __init__(self, index: int, memory: FakeMemory | None, log: list, leak: bool = False) -> None:
        self.index = index
        self.resets = 0
        self._memory = memory
        self._log = log
        self._leak = leak
        self.pool = (100 + index, 1)
        if memory is not None:
            memory.pools[self.pool] = 2 * MiB
            memory.allocated += MiB

    def reset(self) -> None:
        self.resets += 1
        self._log.append(self.index)
        if self._memory is not None and not self._leak and self.pool in self._memory.pools:
            del self._memory.pools[self.pool]
            self._memory.allocated -= MiB

    def __repr__(self) -> str:
        return f"FakeCudaGraph#{self.index}"


class FakeGraphedCallable:
    """What ``make_graphed_callables`` returns per graph: callable (a replay) with ``reset``."""

    def __init__(self, index: int, layer: torch.nn.Module, cuda_graph: FakeCudaGraph) -> None:
        self.index = index
        self.layer = layer
        self.cuda_graph = cuda_graph
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return ("replayed", self.index)

    def reset(self) -> None:
        self.cuda_graph.reset()


def _eager_graph_reaches(params) -> bool:
    """What CUDA sees: a live autograd graph holding a parameter's AccumulateGrad node. Not
    ``find_stale_graphs``, whose holder search refreshes frames' ``f_locals`` snapshots."""
    ids = {id(p) for p in params}
    return any(
        issubclass(type(obj), torch.Tensor)
        and obj.grad_fn is not None
        and any(id(v) in ids for v in stale_graphs._accumulated_variables(obj.grad_fn))
        for obj in gc.get_objects()
    )


class FakeTEBackend:
    """A ``GraphBackend`` emulating TE 2.20's ``make_graphed_callables``: it mutates "TE globals"
    (a capture flag, a new module attribute, ``__call__`` of each module class, GC), warms every
    callable up (not capturing), then captures graph 0..n-1 in Megatron's order (per chunk, per
    microbatch, per layer), running each layer's ``_te_cuda_graph_capture`` while capturing.

    ``fail_at`` (1-based graph number) raises inside that graph's capture, after the layer ran.
    ``graph_first``: the graph object is created (and reported) before its capture as TE does;
    otherwise only once its capture succeeded. ``drop_last`` returns one graphed callable too few.
    ``fail_while_stale`` fails the capture as torch >= 2.9 does while an eager autograd graph
    reaching a captured layer's parameters is alive.
    """

    def __init__(
        self,
        *,
        memory: FakeMemory | None = None,
        fail_at: int | None = None,
        graph_first: bool = True,
        drop_last: bool = False,
        leak_at: int | None = None,
        warmup: bool = True,
        fail_while_stale: bool = False,
    ) -> None:
        self.te = types.ModuleType("fake_transformer_engine_graph")
        self.te._IS_GRAPH_CAPTURING = False
        self.memory = memory
        self.fail_at = fail_at
        self.graph_first = graph_first
        self.drop_last = drop_last
        self.leak_at = leak_at
        self.warmup = warmup
        self.fail_while_stale = fail_while_stale
        self.reset_log: list[int] = []
        self.graphs: list[FakeCudaGraph] = []
        self.captured_layers: list[torch.nn.Module] = []  # the layer run for graph i
        self.warmup_layers: list[torch.nn.Module] = []
        self.capturing_seen: list[bool] = []
        self.calls: list[dict] = []
        self._on_graph = None
        self._capturing = False
        self.tracking_entered = 0
        self.tracking_exited = 0

    # -- GraphBackend ---------------------------------------------------------------------------
    def is_capturing(self) -> bool:
        return self._capturing

    @contextlib.contextmanager
    def tracking(self, on_graph):
        self.tracking_entered += 1
        self._on_graph = on_graph
        try:
            yield
        finally:
            self._on_graph = None
            self.tracking_exited += 1

    def restorables(self, callables, capture_kwargs):
        items = [attribute(self.te, "_IS_GRAPH_CAPTURING"), attribute(self.te, "_capture_state")]
        items += [attribute(cls, "__call__") for cls in {type(c): None for c in callables}]
        return [*items, gc_state()]

    def make_graphed_callables(self, callables, sample_args, **kwargs):
        self.calls.append(dict(kwargs, n=len(sample_args)))
        callables = list(callables)
        order = self._order(callables, len(sample_args), kwargs["_num_layers_per_chunk"])
        sample_kwargs = kwargs.get("sample_kwargs") or [{}] * len(sample_args)

        # TE's globals, changed for the duration of the capture (and not restored on failure).
        self.te._IS_GRAPH_CAPTURING = True
        self.te._capture_state = object()
        for cls in {type(c): None for c in callables}:
            original = cls.__call__

            def patched(module, *args, __original=original, **kw):  # TE's autocast wrapper
                return __original(module, *args, **kw)

            cls.__call__ = patched
        gc.disable()

        if self.warmup:
            for i, layer in enumerate(order):
                self.warmup_layers.append(layer)
                layer._te_cuda_graph_capture(*sample_args[i], **sample_kwargs[i])

        graphed = []
        for i, layer in enumerate(order):
            number = i + 1
            graph = None
            if self.graph_first:
                graph = self._new_graph(i)
            self._capturing = True
            try:
                self.captured_layers.append(layer)
                self.capturing_seen.append(self.is_capturing())
                layer._te_cuda_graph_capture(*sample_args[i], **sample_kwargs[i])
                if self.fail_while_stale and _eager_graph_reaches(layer.parameters()):
                    raise RuntimeError(
                        "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
                    )
                if self.fail_at == number:
                    raise RuntimeError(f"fake CUDA error: capture of graph {number} failed")
            finally:
                self._capturing = False
            if graph is None:
                graph = self._new_graph(i)
            graphed.append(FakeGraphedCallable(i, layer, graph))

        # TE's success path puts its globals back itself.
        self.te._IS_GRAPH_CAPTURING = False
        del self.te._capture_state
        for cls in {type(c): None for c in callables}:
            del cls.__call__
        gc.enable()
        return graphed[:-1] if self.drop_last else graphed

    # -- helpers --------------------------------------------------------------------------------
    def _new_graph(self, index: int) -> FakeCudaGraph:
        graph = FakeCudaGraph(index, self.memory, self.reset_log, leak=self.leak_at == index + 1)
        self.graphs.append(graph)
        if self._on_graph is not None:
            self._on_graph(graph)
        return graph

    @staticmethod
    def _order(callables, n, layers_per_chunk):
        """Graph i -> callable, as TE lays out sample_args: per chunk, per microbatch, per layer."""
        microbatches = n // len(callables)
        order, before = [], 0
        for count in layers_per_chunk:
            for _ in range(microbatches):
                order += callables[before : before + count]
            before += count
        assert len(order) == n
        return order


class FakeLayer(torch.nn.Module):
    """A graphable Megatron layer: a parameter, ``layer_number``, ``cuda_graphs`` and the capture
    entry point ``_te_cuda_graph_capture`` (what runs under TE's capture)."""

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))
        self.layer_number = layer_number
        self.cuda_graphs = []
        self.pg_collection = None
        self.capture_calls = 0

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return hidden_states * self.weight

    def _te_cuda_graph_capture(self, hidden_states, attention_mask=None, **kwargs):
        self.capture_calls += 1
        torch.rand(3)  # capture consumes RNG
        out = hidden_states * self.weight
        # Capture leaves new gradient tensors behind (a rollback must put the old ones back).
        self.weight.grad = torch.full_like(self.weight, 7.0)
        if hasattr(self.weight, "main_grad"):
            self.weight.main_grad = torch.full_like(self.weight, 9.0)
        return out.shape  # no live autograd graph is kept


class FakeLayerWithCall(FakeLayer):
    """A layer class that defines ``__call__`` itself (must be restored to that very function)."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


_WITH_CALL = vars(FakeLayerWithCall)["__call__"]


class FakeChunk(torch.nn.Module):
    def __init__(self, layers) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(layers)


class FakeMegatronHelper:
    """A CPU fake of megatron.core.transformer.cuda_graphs.TECudaGraphHelper (same lifecycle)."""

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=()):
        self.model = model
        self.config = config
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.optimizers = optimizers
        self.num_model_chunks = len(model)
        self.num_microbatches = None  # set in _get_cuda_graph_input_data
        self.callables_per_chunk = [list(chunk.decoder.layers) for chunk in model]
        self.num_layers_per_chunk = [len(layers) for layers in self.callables_per_chunk]
        self.flattened_callables = [layer for layers in self.callables_per_chunk for layer in layers]
        self._capture_finished = False
        self._graphs_created = False
        self.events: list[str] = []
        self.reset_after_capture_calls = 0
        self.manual_hooks_calls = 0
        self.fail_reset_after_capture = False
        self.fail_input_data = False
        self.skip_capture = False  # a release whose create_cudagraphs no longer calls make_graphed_callables
        self.hand_out = list  # the microbatch order graphs are handed to a layer in

    def capture_finished(self):
        return self._capture_finished

    def graphs_created(self):
        return self._graphs_created

    def _start_capturing(self):
        assert not self._capture_finished, "CUDA Graph capture has already been finished."
        mcg._set_capture_start()
        self.events.append("start")
        return time.time()

    def _get_cuda_graph_input_data(self):
        self.num_microbatches = self.config.num_microbatches
        if self.fail_input_data:
            raise ValueError("fake schedule error")
        n = len(self.flattened_callables) * self.num_microbatches
        sample_args = [
            (torch.zeros(self.seq_length, self.micro_batch_size, HIDDEN, requires_grad=True),) for _ in range(n)
        ]
        sample_kwargs = [
            {
                "attention_mask": torch.ones(
                    self.micro_batch_size, 1, self.seq_length, self.seq_length, dtype=torch.bool
                ),
                "rotary_pos_emb": None,
            }
            for _ in range(n)
        ]
        self.sample_args = sample_args  # the static inputs, as TE keeps them
        per_chunk = (
            [1] * len(self.flattened_callables)
            if self.config.overlap_moe_expert_parallel_comm
            else list(self.num_layers_per_chunk)
        )
        kwargs = {
            "sample_kwargs": sample_kwargs,
            "_num_layers_per_chunk": per_chunk,
            "allow_unused_input": True,
            "num_warmup_iters": 1,
            "fp8_enabled": False,
        }
        self.events.append("input data")
        return sample_args, kwargs

    def _reset_after_capture(self):
        self.reset_after_capture_calls += 1
        self.events.append("reset after capture")
        if self.fail_reset_after_capture:
            self.fail_reset_after_capture = False
            raise RuntimeError("fake grad buffer error")

    def _finish_capturing(self, start_time):
        mcg._set_capture_end()
        self._reset_after_capture()
        self._capture_finished = True
        self.events.append("finish")

    def create_cudagraphs(self):
        """Megatron 0.19's: the module's ``make_graphed_callables`` (looked up at call time), graph i
        handed to its layer and microbatch by Megatron's arithmetic (``hand_out`` may reorder)."""
        start_time = self._start_capturing()
        if self.flattened_callables and not self.skip_capture:
            sample_args, kwargs = self._get_cuda_graph_input_data()
            graphs = mcg.make_graphed_callables(tuple(self.flattened_callables), sample_args, **kwargs)
            before = 0
            for layers in self.callables_per_chunk:
                for position, layer in enumerate(layers):
                    layer.cuda_graphs = [
                        graphs[
                            expected_index(
                                before,
                                len(layers),
                                position,
                                mb,
                                self.num_microbatches,
                                self.config.overlap_moe_expert_parallel_comm,
                            )
                        ]
                        for mb in self.hand_out(range(self.num_microbatches))
                    ]
                before += len(layers)
            self._graphs_created = True
        self._finish_capturing(start_time)

    def cuda_graph_set_manual_hooks(self):
        self.manual_hooks_calls += 1

    def delete_cuda_graphs(self):
        assert self._graphs_created, "No CUDA Graphs were created to delete."
        for layers in self.callables_per_chunk:
            for layer in layers:
                for graph in layer.cuda_graphs:
                    graph.reset()
                layer.cuda_graphs = []
                layer.cuda_graph_manual_hooks = []
        self._graphs_created = False
        self.events.append("delete")


class SteppingClock:
    def __init__(self, step: float = 2.5) -> None:
        self.now, self.step = 10.0, step

    def __call__(self) -> float:
        value = self.now
        self.now += self.step
        return value


def make_model(layout: list[int], classes=(FakeLayer,)) -> list[FakeChunk]:
    """``layout``: layers per chunk; layer numbers count from 1 over all chunks (as Megatron's)."""
    model, number = [], 1
    for count in layout:
        layers = []
        for _ in range(count):
            layers.append(classes[(number - 1) % len(classes)](number))
            number += 1
        model.append(FakeChunk(layers))
    return model


def fake_config(modules=(), num_microbatches=1, overlap=False):
    return types.SimpleNamespace(
        cuda_graph_modules=list(modules),
        sequence_parallel=False,
        overlap_moe_expert_parallel_comm=overlap,
        num_microbatches=num_microbatches,
    )


def expected_index(chunk_layers_before: int, layers_in_chunk: int, layer: int, mb: int, m: int, overlap: bool) -> int:
    if overlap:
        return (chunk_layers_before + layer) * m + mb
    return chunk_layers_before * m + mb * layers_in_chunk + layer


def all_layers(model):
    return [layer for chunk in model for layer in chunk.decoder.layers]


def params_of(model):
    return [p for chunk in model for p in chunk.parameters()]


@pytest.fixture(autouse=True)
def collections(monkeypatch):
    """The helper's ``gc.collect()`` calls, counted (a full collection costs ~0.2 s here)."""
    calls = []
    monkeypatch.setattr(capture_lifecycle, "gc", types.SimpleNamespace(collect=lambda: calls.append(1)))
    return calls


def _te_capture_unreached(*args, **kwargs):
    raise AssertionError("Megatron called TE's make_graphed_callables: the plugin's capture call was not in place")


@pytest.fixture(autouse=True)
def _clean_globals(monkeypatch):
    """Whatever a failing test leaves behind must not leak into the next one."""
    monkeypatch.setattr(mcg, "_IS_GRAPH_CAPTURING", False)
    monkeypatch.setattr(mcg, "make_graphed_callables", _te_capture_unreached, raising=False)  # TE's, on a GPU host
    yield
    assert mcg.make_graphed_callables is _te_capture_unreached  # the plugin's stand-in was scoped
    gc.enable()
    if "__call__" in vars(FakeLayer):
        del FakeLayer.__call__
    FakeLayerWithCall.__call__ = _WITH_CALL


@pytest.fixture
def memory(monkeypatch):
    fake = FakeMemory()
    monkeypatch.setattr(accounting, "memory_state", fake.state)
    return fake


@pytest.fixture
def capture_clock(monkeypatch):
    fake = SteppingClock()
    monkeypatch.setattr(capture_lifecycle, "time", types.SimpleNamespace(perf_counter=fake))
    return fake


@pytest.fixture
def cuda_sync(monkeypatch):
    """Teardown synchronizes (and empties the cache) when CUDA is available: pretend it is, and
    record the synchronize calls."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return calls


def build(
    probe,
    *,
    layout=(2,),
    microbatches=1,
    modules=(),
    overlap=False,
    classes=(FakeLayer,),
    backend=None,
    memory=None,
    **config,
):
    """The stale-graph scan walks every Python object (~0.3 s); tests not about it turn it off."""
    config.setdefault("stale_graph_check", "off")
    session = RunSession(PluginConfig(**config), probe=probe)
    backend = backend or FakeTEBackend(memory=memory)
    cls = bind_helper_class(FakeMegatronHelper, session, backend=backend)
    model = make_model(list(layout), classes)
    helper = cls(model, fake_config(modules, microbatches, overlap), SEQ, MBS)
    return session, backend, model, helper


def hidden(requires_grad=True, seq=SEQ, dtype=torch.float32):
    return torch.zeros(seq, MBS, HIDDEN, dtype=dtype, requires_grad=requires_grad)


def mask(seq=SEQ):
    return torch.ones(MBS, 1, seq, seq, dtype=torch.bool)


# ====================================================================== scope_label / binding


@pytest.mark.parametrize(
    "modules, expected",
    [
        ([], "layer"),
        ((), "layer"),
        (None, "layer"),
        ([Scope.attn], "attn"),
        ([Scope.attn, Scope.moe_router], "attn+moe_router"),
        ([Scope.moe_router, Scope.attn], "moe_router+attn"),  # Megatron's order is kept
        (["attn", "mlp"], "attn+mlp"),
        ([types.SimpleNamespace(name="moe_preprocess"), "mlp"], "moe_preprocess+mlp"),
    ],
)
def test_scope_label(modules, expected):
    assert scope_label(modules) == expected


def test_scope_label_with_megatron_enum():
    from megatron.core.transformer.enums import CudaGraphModule

    assert scope_label([CudaGraphModule.attn, CudaGraphModule.moe_router]) == "attn+moe_router"


def test_bind_helper_class_subclasses_the_base(probe):
    session, backend = RunSession(PluginConfig(), probe=probe), FakeTEBackend()
    cls = bind_helper_class(FakeMegatronHelper, session, backend=backend)
    assert cls.__mro__[1:3] == (PluginHelperMixin, FakeMegatronHelper)
    assert cls.session is session and cls.backend is backend
    assert cls.__name__ == "PluginTECudaGraphHelper"
    assert not hasattr(FakeMegatronHelper, "session")  # the base is left untouched


def test_instance_passes_arguments_through_and_attaches(probe):
    session, backend, model, helper = build(probe)
    assert (helper.model, helper.seq_length, helper.micro_batch_size) == (model, SEQ, MBS)
    assert helper.capture_stats is None and helper.teardown_stats is None
    assert session.helpers == [helper]
    assert not helper.graphs_created() and not helper.capture_finished()


# ====================================================================== 1. failed capture: full rollback


LAYOUTS = [((2, 2), 1), ((3,), 2)]  # (layers per chunk, microbatches): 2x2x1 and 1x3x2
FAILURE_CASES = [(layout, m, k) for layout, m in LAYOUTS for k in range(1, sum(layout) * m + 1)]


def _graph_layer_numbers(layout, m):
    """Layer number captured by graph i (per chunk, per microbatch, per layer)."""
    numbers, first = [], 1
    for count in layout:
        for _ in range(m):
            numbers += list(range(first, first + count))
        first += count
    return numbers


class Snapshot:
    """Everything a failed capture must leave exactly as it found it (compared by identity)."""

    def __init__(self, model, backend, helper) -> None:
        self.layers = all_layers(model)
        self.lists = [layer.cuda_graphs for layer in self.layers]
        self.grads = [(p.grad, getattr(p, "main_grad", MISSING)) for p in params_of(model)]
        self.te_flag = backend.te._IS_GRAPH_CAPTURING
        self.classes = {cls: vars(cls).get("__call__", MISSING) for cls in (FakeLayer, FakeLayerWithCall)}
        self.rng = torch.get_rng_state()
        self.gc_enabled = gc.isenabled()
        self.freeze_count = gc.get_freeze_count()
        self.megatron_flag = mcg._IS_GRAPH_CAPTURING
        self.num_microbatches = helper.num_microbatches

    def assert_restored(self, model, backend, helper) -> None:
        assert [layer.cuda_graphs for layer in self.layers] == self.lists
        assert all(now is before for now, before in zip((layer.cuda_graphs for layer in self.layers), self.lists))
        for p, (grad, main_grad) in zip(params_of(model), self.grads):
            assert p.grad is grad and getattr(p, "main_grad", MISSING) is main_grad
        assert backend.te._IS_GRAPH_CAPTURING is self.te_flag is False
        assert "_capture_state" not in vars(backend.te)
        for cls, before in self.classes.items():
            assert vars(cls).get("__call__", MISSING) is before
        assert "__call__" not in vars(FakeLayer)  # absent stays absent (nn.Module's is inherited)
        assert torch.equal(torch.get_rng_state(), self.rng)
        assert gc.isenabled() is True and self.gc_enabled is True
        assert gc.get_freeze_count() == self.freeze_count
        assert mcg._IS_GRAPH_CAPTURING is False and mcg.is_graph_capturing() is False
        for layer in self.layers:
            assert "_te_cuda_graph_capture" not in vars(layer)
            assert layer._te_cuda_graph_capture.__func__ is type(layer)._te_cuda_graph_capture
        assert helper.num_microbatches is self.num_microbatches


def _prepare_grads(model):
    for p in params_of(model):
        p.grad = torch.full_like(p, 1.0)
        p.main_grad = torch.zeros_like(p)


@pytest.mark.parametrize("graph_first", [True, False], ids=["graph-before-capture", "graph-after-capture"])
@pytest.mark.parametrize("mode", ["raise", "eager"])
@pytest.mark.parametrize(
    "layout, microbatches, k",
    FAILURE_CASES,
    ids=[f"{'x'.join(map(str, layout))}-mb{m}-graph{k}" for layout, m, k in FAILURE_CASES],
)
def test_failure_at_every_graph_rolls_everything_back(
    probe, memory, collections, layout, microbatches, k, mode, graph_first
):
    backend = FakeTEBackend(memory=memory, fail_at=k, graph_first=graph_first)
    session, backend, model, helper = build(
        probe,
        layout=layout,
        microbatches=microbatches,
        classes=(FakeLayer, FakeLayerWithCall),
        backend=backend,
        on_capture_error=mode,
    )
    failing_layer = _graph_layer_numbers(layout, microbatches)[k - 1]
    _prepare_grads(model)
    before = Snapshot(model, backend, helper)
    pools_before = dict(memory.pools)

    if mode == "raise":
        with pytest.raises(CaptureFailedError) as info:
            helper.create_cudagraphs()
        error = info.value
        assert isinstance(error.__cause__, RuntimeError)
        assert str(error.__cause__) == f"fake CUDA error: capture of graph {k} failed"
        message = str(error)
        assert re.search(rf"\blayer {failing_layer}\b", message)
        assert f"fake CUDA error: capture of graph {k} failed" in message
        others = set(range(1, sum(layout) + 1)) - {failing_layer}
        assert not any(re.search(rf"\blayer {other}\b", message) for other in others)
    else:
        helper.create_cudagraphs()  # nothing raised: training continues eagerly

    # The capture really got as far as graph k, running the failing layer under capture.
    assert len(backend.captured_layers) == k
    assert backend.captured_layers[-1].layer_number == failing_layer
    # Graphs: those that existed were reset exactly once, newest first; later ones never existed.
    created = k if graph_first else k - 1
    assert [g.index for g in backend.graphs] == list(range(created))
    assert [g.resets for g in backend.graphs] == [1] * created
    assert backend.reset_log == list(reversed(range(created)))
    assert memory.pools == pools_before  # every pool the capture created was released
    assert backend.tracking_entered == backend.tracking_exited == 1

    before.assert_restored(model, backend, helper)
    assert helper.graphs_created() is False
    assert helper.capture_finished() is True
    assert helper.reset_after_capture_calls == 1
    assert "finish" not in helper.events
    assert collections  # garbage collected after the rollback

    stats = helper.capture_stats
    assert stats.graphs == 0 and stats.pool_bytes == 0 and stats.layers == sum(layout)
    assert re.match(
        rf"layer {failing_layer} \(forward\): RuntimeError: fake CUDA error: capture of graph {k} failed$",
        stats.failure,
    )
    (scope,) = session.report().scopes
    assert scope.failure == stats.failure
    assert scope.graphs_captured == 0 and scope.replays == 0

    helper.cuda_graph_set_manual_hooks()  # nothing to hook after a failed capture
    assert helper.manual_hooks_calls == 0


def test_failure_in_warmup_names_the_layer_and_rolls_back(probe, memory):
    backend = FakeTEBackend(memory=memory)
    session, backend, model, helper = build(probe, layout=(3,), backend=backend)
    target = all_layers(model)[1]
    original = FakeLayer._te_cuda_graph_capture

    def failing(self, *args, **kwargs):
        if self is target:
            raise RuntimeError("warmup blew up")
        return original(self, *args, **kwargs)

    before = Snapshot(model, backend, helper)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeLayer, "_te_cuda_graph_capture", failing)
        with pytest.raises(CaptureFailedError, match=r"failed in layer 2 \(forward\): RuntimeError: warmup blew up"):
            helper.create_cudagraphs()
    assert backend.graphs == [] and backend.captured_layers == []
    before.assert_restored(model, backend, helper)


@pytest.mark.parametrize(
    "megatron_flaw, message",
    [
        ("fail_input_data", "before any layer ran: ValueError: fake schedule error"),
        ("skip_capture", "returned without calling make_graphed_callables"),  # a release that captures otherwise
    ],
)
def test_failure_before_any_layer_ran(probe, memory, megatron_flaw, message):
    session, backend, model, helper = build(probe, layout=(2,))
    setattr(helper, megatron_flaw, True)
    before = Snapshot(model, backend, helper)
    with pytest.raises(CaptureFailedError, match=message):
        helper.create_cudagraphs()
    assert helper.events[0] == "start"  # Megatron's capture flag had been set
    before.assert_restored(model, backend, helper)
    assert backend.calls == []


@pytest.mark.parametrize("where", ["install", "finish"])
def test_failure_after_capture_resets_every_graph(probe, memory, where):
    backend = FakeTEBackend(memory=memory, drop_last=where == "install")
    session, backend, model, helper = build(
        probe, layout=(2, 1), microbatches=2, backend=backend, on_capture_error="eager"
    )
    helper.fail_reset_after_capture = where == "finish"
    _prepare_grads(model)
    before = Snapshot(model, backend, helper)
    pools_before = dict(memory.pools)

    helper.create_cudagraphs()

    assert [g.resets for g in backend.graphs] == [1] * 6
    assert memory.pools == pools_before
    before.assert_restored(model, backend, helper)  # layers' cuda_graphs lists included
    assert not helper.graphs_created() and helper.capture_finished()
    assert helper.capture_stats.failure is not None


def test_failure_after_capture_is_not_blamed_on_the_last_layer(probe, memory):
    session, backend, model, helper = build(probe, layout=(3,), on_capture_error="eager")
    helper.fail_reset_after_capture = True
    helper.create_cudagraphs()
    assert "fake grad buffer error" in helper.capture_stats.failure
    assert not helper.capture_stats.failure.startswith("layer 3")


# ====================================================================== 2. success path


@pytest.mark.parametrize(
    "layout, microbatches, overlap", [((2, 1), 3, False), ((3,), 2, False), ((1, 2), 2, True), ((2,), 1, False)]
)
def test_every_layer_gets_its_graphs_in_megatrons_order(probe, memory, layout, microbatches, overlap):
    session, backend, model, helper = build(probe, layout=layout, microbatches=microbatches, overlap=overlap)
    helper.create_cudagraphs()

    returned = {g.index: g for layer in all_layers(model) for w in layer.cuda_graphs for g in [w.graph]}
    assert sorted(returned) == list(range(sum(layout) * microbatches))
    before = 0
    for chunk, count in zip(model, layout):
        for position, layer in enumerate(chunk.decoder.layers):
            assert len(layer.cuda_graphs) == microbatches
            assert all(isinstance(w, CheckedGraph) for w in layer.cuda_graphs)
            for mb, wrapper in enumerate(layer.cuda_graphs):
                index = expected_index(before, count, position, mb, microbatches, overlap)
                assert wrapper.graph.index == index
                # The graph handed to this layer is the one captured by running this layer.
                assert backend.captured_layers[index] is layer
                assert wrapper.graph.layer is layer
        before += count
    assert helper.graphs_created() and helper.capture_finished()
    assert helper.num_microbatches == microbatches


def test_contracts_follow_the_graphs_megatron_hands_out_by_identity(probe, memory):
    """Whatever order Megatron hands a layer its graphs in, each is held to its own sample arguments."""
    session, backend, model, helper = build(probe, layout=(2,), microbatches=3)
    helper.hand_out = lambda microbatches: list(microbatches)[::-1]
    helper.create_cudagraphs()
    for layer in all_layers(model):
        for wrapper in layer.cuda_graphs:
            (_, static), *_ = wrapper.contract.inputs
            assert static.data_ptr == helper.sample_args[wrapper.graph.index][0].data_ptr()
    assert [w.graph.index for w in all_layers(model)[0].cuda_graphs] == [4, 2, 0]


def test_capture_stats_and_cleanup_after_success(probe, memory, capture_clock):
    session, backend, model, helper = build(
        probe, layout=(2, 1), microbatches=2, memory=memory, modules=[Scope.attn, Scope.moe_router]
    )
    helper.create_cudagraphs()

    stats = helper.capture_stats
    assert stats.scope == "attn+moe_router"
    assert (stats.layers, stats.graphs) == (3, 6)
    assert stats.pool_bytes == 6 * 2 * MiB  # the six new pools; the older (1, 0) pool left out
    # The stepping clock: 2.5 s per reading; each phase reads it twice, in between the others' readings.
    assert list(stats.phases) == ["rollback snapshot", "Megatron and TE capture", "replay contracts"]
    assert all(seconds == 2.5 for seconds in stats.phases.values())
    assert stats.seconds == 2.5 * 7
    assert stats.failure is None
    assert stats.replays.counts == [0, 0, 0]
    assert [g.resets for g in backend.graphs] == [0] * 6  # success: nothing rolled back
    assert helper.reset_after_capture_calls == 1 and helper.events[-1] == "finish"
    assert mcg._IS_GRAPH_CAPTURING is False
    for layer in all_layers(model):
        assert "_te_cuda_graph_capture" not in vars(layer)  # wrappers gone after success too
    assert [layer.capture_calls for layer in all_layers(model)] == [4, 4, 4]  # 2 warmup + 2 capture each
    assert gc.isenabled()

    (scope,) = session.report().scopes
    assert (scope.scope, scope.layers, scope.graphs_captured, scope.pool_bytes, scope.failure, scope.rejected) == (
        "attn+moe_router",
        3,
        6,
        12 * MiB,
        None,
        0,
    )


def test_replay_calls_the_right_graph_and_counts_per_layer(probe, memory):
    session, backend, model, helper = build(probe, layout=(2, 1), microbatches=2)
    helper.create_cudagraphs()
    layer0, layer1, layer2 = all_layers(model)

    assert layer1.cuda_graphs[1](hidden(), attention_mask=mask()) == ("replayed", 3)
    layer1.cuda_graphs[0](hidden(), attention_mask=mask())
    layer2.cuda_graphs[0](hidden(), attention_mask=mask(), is_first_microbatch=True)

    assert helper.capture_stats.replays.counts == [0, 2, 1]
    assert len(layer1.cuda_graphs[1].graph.calls) == 1
    (scope,) = session.report().scopes
    assert scope.replays == 3 and scope.replays_per_layer == (0, 2, 1) and scope.rejected == 0


def test_manual_hooks_forwarded_only_with_graphs(probe, memory):
    session, backend, model, helper = build(probe)
    helper.cuda_graph_set_manual_hooks()
    assert helper.manual_hooks_calls == 0
    helper.create_cudagraphs()
    helper.cuda_graph_set_manual_hooks()
    assert helper.manual_hooks_calls == 1


def test_no_graphable_layers_delegates_to_megatron(probe, memory):
    session, backend, model, helper = build(probe, layout=(0, 0))
    helper.create_cudagraphs()
    assert helper.capture_finished() and not helper.graphs_created()
    assert helper.capture_stats is None and backend.calls == []
    assert session.report().scopes == ()


def test_session_sees_graphed_steps_after_capture(probe, memory, cuda_sync):
    session, backend, model, helper = build(probe)
    session.on_training_log(iteration=1, loss_dict={})
    helper.create_cudagraphs()
    session.on_training_log(iteration=2, loss_dict={})
    helper.delete_cuda_graphs()
    session.on_training_log(iteration=3, loss_dict={})
    assert [r.graphed for r in session.iterations] == [False, True, False]


def test_a_capture_ends_the_eager_iteration_before_it(probe, memory, cuda_sync):
    # Megatron captures between the last eager iteration's training_log and the next train_step:
    # the capture's seconds are in no step (the report gives them as capture seconds).
    session, backend, model, helper = build(probe)
    ticks = iter([0.0, 1.0, 2.0, 10.0, 11.0])  # mark, log, capture start, mark, log
    session.clock = lambda: next(ticks)
    session.mark_iteration_start()
    session.on_training_log(iteration=1, loss_dict={})
    helper.create_cudagraphs()
    session.mark_iteration_start()
    session.on_training_log(iteration=2, loss_dict={})
    assert [(r.seconds, r.graphed) for r in session.iterations] == [(2.0, False), (1.0, True)]


# ====================================================================== 3. injected failure


@pytest.mark.parametrize("layout, microbatches, j", [((3,), 2, 1), ((3,), 2, 3), ((2, 2), 1, 3), ((2, 2), 2, 2)])
def test_injected_failure_inside_the_capture_of_callable_j(probe, memory, layout, microbatches, j):
    session, backend, model, helper = build(probe, layout=layout, microbatches=microbatches, inject_capture_failure=j)
    before = Snapshot(model, backend, helper)
    with pytest.raises(CaptureFailedError) as info:
        helper.create_cudagraphs()
    assert isinstance(info.value.__cause__, InjectedCaptureFailure)
    assert f"injected failure inside the capture of layer {j} (forward)" in str(info.value)
    assert re.search(rf"failed in layer {j} \(forward\):", str(info.value))

    # Every warmup call (not capturing) went through, callable j's included.
    n = sum(layout) * microbatches
    assert len(backend.warmup_layers) == n
    # It failed in the first capture of callable j, and only while capturing.
    assert backend.captured_layers[-1].layer_number == j
    assert [layer.layer_number for layer in backend.captured_layers].count(j) == 1
    assert all(backend.capturing_seen)
    assert [g.resets for g in backend.graphs] == [1] * len(backend.captured_layers)
    before.assert_restored(model, backend, helper)


def test_capture_tracker_injects_only_while_capturing():
    layers = all_layers(make_model([3]))
    capturing = [False]
    tracker = _CaptureTracker(layers, inject_at=2, is_capturing=lambda: capturing[0])
    with tracker.installed():
        assert tracker.current is None

        assert layers[1]._te_cuda_graph_capture(hidden(), attention_mask=mask()) == (SEQ, MBS, HIDDEN)  # warmup
        assert tracker.current == "layer 2 (forward)" and layers[1].capture_calls == 1
        capturing[0] = True
        layers[0]._te_cuda_graph_capture(hidden())  # another layer, capturing: runs
        assert tracker.current == "layer 1 (forward)"
        with pytest.raises(InjectedCaptureFailure, match=r"inside the capture of layer 2 \(forward\)"):
            layers[1]._te_cuda_graph_capture(hidden())
        assert tracker.current == "layer 2 (forward)" and layers[1].capture_calls == 1  # the body did not run

    assert all("_te_cuda_graph_capture" not in vars(layer) for layer in layers)


def test_injection_beyond_the_last_callable_never_fires(probe, memory):
    session, backend, model, helper = build(probe, layout=(2,), inject_capture_failure=3)
    helper.create_cudagraphs()
    assert helper.graphs_created() and helper.capture_stats.failure is None


# ====================================================================== 3b. which layer's backward failed


class GradFakeLayer(FakeLayer):
    """A layer whose capture entry returns outputs autograd runs backward from, as Megatron's does:
    a tuple with one output that takes a gradient, one that takes none, and None."""

    def _te_cuda_graph_capture(self, hidden_states, attention_mask=None, **kwargs):
        self.capture_calls += 1
        return hidden_states * self.weight, hidden_states.detach(), None


class BankedGradFakeLayer(GradFakeLayer):
    graph_banks = True  # what banked_layer_class marks


class ForwardsThenBackwardsBackend(FakeTEBackend):
    """TE's capture order: every callable's forward through its capture entry, then their backwards
    in reverse order. ``outputs`` keeps what each forward returned (TE's static outputs)."""

    def make_graphed_callables(self, callables, sample_args, **kwargs):
        order = self._order(list(callables), len(sample_args), kwargs["_num_layers_per_chunk"])
        sample_kwargs = kwargs.get("sample_kwargs") or [{}] * len(sample_args)
        self.outputs = []
        self._capturing = True
        try:
            for i, layer in enumerate(order):
                self._new_graph(i)
                self.outputs.append(layer._te_cuda_graph_capture(*sample_args[i], **sample_kwargs[i]))
            for output in reversed(self.outputs):
                output[0].backward(torch.ones_like(output[0]))
        finally:
            self._capturing = False
        return [FakeGraphedCallable(i, layer, graph) for i, (layer, graph) in enumerate(zip(order, self.graphs))]


def _failing_grad_hook(grad):
    raise RuntimeError("a user's gradient hook raised")


def _hooks_left(outputs) -> list:
    """Tensor hooks still attached to the capture outputs that take a gradient."""
    return [hook for output in outputs for hook in (output[0]._backward_hooks or {}).values()]


@pytest.mark.parametrize("mode", ["raise", "eager"])
def test_a_failure_in_a_backward_capture_names_that_layer_and_leaves_no_hook(probe, memory, mode):
    backend = ForwardsThenBackwardsBackend(memory=memory)
    session, backend, model, helper = build(
        probe, layout=(4,), classes=(GradFakeLayer,), backend=backend, on_capture_error=mode
    )
    handle = all_layers(model)[2].weight.register_hook(_failing_grad_hook)  # in layer 3's backward
    try:
        with pytest.raises(CaptureFailedError) if mode == "raise" else contextlib.nullcontext() as info:
            helper.create_cudagraphs()
    finally:
        handle.remove()
    # Every forward ran before layer 4's backward and layer 3's: the last forward is not blamed.
    assert [layer.capture_calls for layer in all_layers(model)] == [1, 1, 1, 1]
    failure = "layer 3 (backward): RuntimeError: a user's gradient hook raised"
    assert helper.capture_stats.failure == failure
    if mode == "raise":
        assert f"failed in {failure}" in str(info.value)
    assert len(backend.outputs) == 4 and _hooks_left(backend.outputs) == []  # removed with the transaction
    assert all("_te_cuda_graph_capture" not in vars(layer) for layer in all_layers(model))


def test_a_successful_capture_leaves_no_hook_on_its_outputs(probe, memory):
    backend = ForwardsThenBackwardsBackend(memory=memory)
    session, backend, model, helper = build(probe, layout=(2, 1), classes=(GradFakeLayer,), backend=backend)
    helper.create_cudagraphs()
    assert helper.graphs_created() and helper.capture_stats.failure is None
    assert len(backend.outputs) == 3 and _hooks_left(backend.outputs) == []


def test_capture_tracker_names_the_backward_autograd_reaches():
    layers = all_layers(make_model([2], classes=(GradFakeLayer,)))
    tracker = _CaptureTracker(layers, inject_at=None, is_capturing=lambda: True)
    with tracker.installed():
        first, second = (layer._te_cuda_graph_capture(hidden()) for layer in layers)
        assert tracker.current == "layer 2 (forward)"
        first[0].sum().backward()
        assert tracker.current == "layer 1 (backward)"
    second[0].sum().backward()  # the hook is gone: nothing is named any more
    assert tracker.current == "layer 1 (backward)"
    assert _hooks_left([first, second]) == [] and all("_te_cuda_graph_capture" not in vars(layer) for layer in layers)


# ====================================================================== 4. replay contracts


def _captured(probe, **config):
    session, backend, model, helper = build(probe, layout=(2,), microbatches=1, **config)
    helper.create_cudagraphs()
    return session, backend, model, helper


def _refused(wrapper, *args, **kwargs) -> ContractViolation:
    calls = len(wrapper.graph.calls)
    with pytest.raises(ContractViolation) as info:
        wrapper(*args, **kwargs)
    assert len(wrapper.graph.calls) == calls  # the graph was not replayed
    return info.value


def test_replay_with_the_captured_shapes_passes(probe, memory):
    session, backend, model, helper = _captured(probe)
    layer = all_layers(model)[1]
    assert layer.cuda_graphs[0](hidden(), attention_mask=mask()) == ("replayed", 1)
    assert layer.cuda_graphs[0](hidden(), attention_mask=mask(), is_first_microbatch=False) == ("replayed", 1)
    assert helper.capture_stats.replays.counts == [0, 2]


def test_other_sequence_length_is_refused_and_counted(probe, memory):
    session, backend, model, helper = _captured(probe)
    wrapper = all_layers(model)[1].cuda_graphs[0]
    error = _refused(wrapper, hidden(seq=SEQ * 2), attention_mask=mask())
    message = str(error)
    assert "layer 2" in message and "shape" in message
    assert str((SEQ, MBS, HIDDEN)) in message and str((SEQ * 2, MBS, HIDDEN)) in message
    assert error.field == "shape" and error.captured == (SEQ, MBS, HIDDEN)
    counter = helper.capture_stats.replays
    assert counter.rejected == [0, 1] and counter.counts == [0, 0]
    (scope,) = session.report().scopes
    assert scope.rejected == 1 and scope.replays == 0


def test_other_dtype_is_refused(probe, memory):
    session, backend, model, helper = _captured(probe)
    error = _refused(all_layers(model)[0].cuda_graphs[0], hidden(dtype=torch.bfloat16), attention_mask=mask())
    assert error.field == "dtype" and "dtype" in str(error) and "layer 1" in str(error)


def test_layout_checked_only_for_an_input_read_in_place(probe, memory):
    # TE copies an input into the static buffer (any layout will do) unless it is that buffer.
    noncontiguous = torch.zeros(MBS, SEQ, HIDDEN, requires_grad=True).transpose(0, 1)
    assert noncontiguous.shape == (SEQ, MBS, HIDDEN) and not noncontiguous.is_contiguous()
    _, _, model, helper = _captured(probe, contract_check="full")
    assert all_layers(model)[0].cuda_graphs[0](noncontiguous, attention_mask=mask()) == ("replayed", 0)

    static = helper.sample_args[0][0]
    relaid = static.detach().as_strided((SEQ, MBS, HIDDEN), (1, SEQ * HIDDEN, SEQ)).requires_grad_()
    assert relaid.data_ptr() == static.data_ptr() and relaid.stride() != static.stride()
    assert _refused(all_layers(model)[0].cuda_graphs[0], relaid, attention_mask=mask()).field == "stride"
    _, _, model, helper = _captured(probe, contract_check="shapes")
    static = helper.sample_args[0][0]
    relaid = static.detach().as_strided((SEQ, MBS, HIDDEN), (1, SEQ * HIDDEN, SEQ)).requires_grad_()
    assert all_layers(model)[0].cuda_graphs[0](relaid, attention_mask=mask()) == ("replayed", 0)


def test_contract_check_off_runs_no_check(probe, memory):
    session, backend, model, helper = _captured(probe, contract_check="off")
    wrapper = all_layers(model)[0].cuda_graphs[0]
    assert wrapper.contract is None
    assert wrapper(hidden(seq=3)) == ("replayed", 0)  # wrong shape, missing mask: not checked
    assert helper.capture_stats.replays.counts == [1, 0]


def test_missing_tensor_kwarg_is_refused(probe, memory):
    _, _, model, _ = _captured(probe)
    error = _refused(all_layers(model)[0].cuda_graphs[0], hidden())
    assert error.field == "arguments" and "attention_mask" in str(error)


def test_replay_only_kwargs_are_ignored(probe, memory):
    _, _, model, _ = _captured(probe)
    wrapper = all_layers(model)[0].cuda_graphs[0]
    assert wrapper(hidden(), attention_mask=mask(), is_first_microbatch=True) == ("replayed", 0)
    assert wrapper(hidden(), attention_mask=mask(), rotary_pos_emb=None) == ("replayed", 0)


def test_reallocated_parameter_is_refused_in_full(probe, memory):
    _, _, model, helper = _captured(probe)
    layer = all_layers(model)[0]
    layer.weight.data = torch.zeros_like(layer.weight)
    error = _refused(layer.cuda_graphs[0], hidden(), attention_mask=mask())
    assert error.field == "parameter storage" and "weight" in str(error)
    assert all_layers(model)[1].cuda_graphs[0](hidden(), attention_mask=mask()) == ("replayed", 1)

    _, _, model, _ = _captured(probe, contract_check="shapes")
    layer = all_layers(model)[0]
    layer.weight.data = torch.zeros_like(layer.weight)
    assert layer.cuda_graphs[0](hidden(), attention_mask=mask()) == ("replayed", 0)


def test_an_input_that_needs_no_gradient_now_replays(probe, memory):
    # The captured backward computes its gradient; autograd drops it (the reverse is refused: contracts).
    _, _, model, _ = _captured(probe)
    assert all_layers(model)[0].cuda_graphs[0](hidden(requires_grad=False), attention_mask=mask()) == ("replayed", 0)


# ====================================================================== 5. teardown


def test_teardown_resets_every_graph_and_measures(probe, memory, cuda_sync):
    session, backend, model, helper = build(probe, layout=(2, 1), microbatches=2, memory=memory)
    allocated_before = memory.allocated
    helper.create_cudagraphs()
    assert memory.allocated == allocated_before + 6 * MiB
    old_lists = [layer.cuda_graphs for layer in all_layers(model)]

    helper.delete_cuda_graphs()

    assert [g.resets for g in backend.graphs] == [1] * 6
    assert all(layer.cuda_graphs == [] for layer in all_layers(model))
    assert all(now is not old for now, old in zip((layer.cuda_graphs for layer in all_layers(model)), old_lists))
    assert not helper.graphs_created() and not helper.capture_finished()
    assert helper.teardown_stats == TeardownStats(allocated_delta_bytes=0, pool_bytes_left=0, pinned_host_delta_bytes=0)
    assert cuda_sync  # synchronized before measuring
    (scope,) = session.report().scopes
    assert (scope.teardown_allocated_delta_bytes, scope.teardown_pool_bytes_left) == (0, 0)

    calls = memory.calls
    helper.delete_cuda_graphs()  # a second delete is harmless
    assert [g.resets for g in backend.graphs] == [1] * 6
    assert helper.events.count("delete") == 1 and memory.calls == calls


def test_teardown_reports_leaked_pools(probe, memory, cuda_sync):
    backend = FakeTEBackend(memory=memory, leak_at=2)
    session, backend, model, helper = build(probe, layout=(2,), backend=backend)
    helper.create_cudagraphs()
    memory.pinned += 512
    helper.delete_cuda_graphs()
    assert helper.teardown_stats == TeardownStats(
        allocated_delta_bytes=MiB, pool_bytes_left=2 * MiB, pinned_host_delta_bytes=512
    )
    text = session.report().format_table()
    assert "after teardown, allocated +1.00 MiB vs before capture, 2.00 MiB left in graph pools" in text


def test_teardown_names_what_holds_the_pool_blocks_left(probe, memory, cuda_sync, monkeypatch):
    backend = FakeTEBackend(memory=memory, leak_at=2)
    session, backend, model, helper = build(probe, layout=(2,), backend=backend)
    helper.create_cudagraphs()
    kept_after_teardown = torch.zeros(3, 5)  # a capture output some object still holds
    leaked_pool = backend.graphs[1].pool
    block = {"address": kept_after_teardown.untyped_storage().data_ptr(), "size": 60, "state": "active_allocated"}
    monkeypatch.setattr(
        accounting,
        "allocator_segments",
        lambda: [{"segment_pool_id": leaked_pool, "total_size": 2 * MiB, "blocks": [block]}],
    )
    helper.delete_cuda_graphs()
    (holder,) = helper.teardown_stats.pool_holders
    assert holder.startswith("(3, 5) torch.float32 held by") and "kept_after_teardown" in holder
    assert "2.00 MiB left in graph pools ((3, 5) torch.float32 held by" in session.report().format_table()


def test_capture_and_teardown_drop_the_moe_dispatchers_per_forward_state(probe, memory, cuda_sync):
    session, backend, model, helper = build(probe, layout=(2,))
    moe_layer = all_layers(model)[1]
    dispatcher = types.SimpleNamespace(
        cudagraph_attrs=["routing_map", "probs"], routing_map=torch.ones(2), probs=torch.ones(2)
    )
    moe_layer.is_moe_layer, moe_layer.mlp = True, types.SimpleNamespace(token_dispatcher=dispatcher)
    helper.create_cudagraphs()
    assert dispatcher.routing_map is None  # the last eager step's, holding its autograd graph
    dispatcher.routing_map = dispatcher.probs = torch.ones(2)  # what the capture leaves there
    helper.delete_cuda_graphs()
    assert dispatcher.routing_map is None and dispatcher.probs is None  # the last graph's, in its pool


def test_delete_without_graphs_is_harmless(probe, memory, cuda_sync):
    session, backend, model, helper = build(probe)
    helper.delete_cuda_graphs()
    assert helper.teardown_stats is None and helper.events == []


def test_capture_again_after_teardown(probe, memory, cuda_sync):
    session, backend, model, helper = build(probe, layout=(2,), microbatches=2, memory=memory)
    helper.create_cudagraphs()
    all_layers(model)[0].cuda_graphs[0](hidden(), attention_mask=mask())
    first = list(backend.graphs)
    helper.delete_cuda_graphs()

    helper.create_cudagraphs()

    assert helper.graphs_created() and helper.capture_finished()
    second = backend.graphs[len(first) :]
    assert len(second) == 4 and [g.resets for g in second] == [0] * 4
    for layer in all_layers(model):
        assert [w.graph.cuda_graph for w in layer.cuda_graphs] != []
        assert all(isinstance(w.graph, FakeGraphedCallable) for w in layer.cuda_graphs)  # not wrapped twice
        assert all(w.graph.cuda_graph in second for w in layer.cuda_graphs)
        assert "_te_cuda_graph_capture" not in vars(layer)
    assert helper.capture_stats.replays.counts == [0, 0]
    assert helper.capture_stats.pool_bytes == 4 * 2 * MiB
    assert len(session.report().scopes) == 1
    assert all_layers(model)[1].cuda_graphs[1](hidden(), attention_mask=mask()) == ("replayed", 3)


# ====================================================================== 6. stale autograd graphs


def _stale_error(error: BaseException) -> StaleAutogradGraphError | None:
    while error is not None and not isinstance(error, StaleAutogradGraphError):
        error = error.__cause__
    return error


def stale_build(probe, when, **config):
    """``refuse`` looks after a failed capture (the backend fails as CUDA does); ``before`` looks first."""
    return build(probe, layout=(2,), backend=FakeTEBackend(fail_while_stale=True), stale_graph_check=when, **config)


@pytest.mark.parametrize("when", ["refuse", "before"])
def test_live_loss_refuses_capture_and_changes_nothing(probe, when):
    session, backend, model, helper = stale_build(probe, when)
    layer = all_layers(model)[0]
    before = Snapshot(model, backend, helper)
    loss = (layer.weight * 2).sum()

    with pytest.raises(StaleAutogradGraphError) as info:
        helper.create_cudagraphs()

    assert "'loss'" in str(info.value)
    if when == "before":  # refused before anything ran
        assert backend.calls == [] and "start" not in helper.events
        assert info.value.__cause__ is None
    else:  # one attempt, failed on the live graph and rolled back; not tried again
        assert len(backend.calls) == 1 and "legacy stream" in str(info.value.__cause__)
        assert backend.reset_log  # the failed attempt's graphs were reset
    before.assert_restored(model, backend, helper)
    assert not helper.graphs_created()
    assert loss.grad_fn is not None  # the refusal did not touch the user's graph


@pytest.mark.parametrize("when", ["refuse", "before"])
def test_stale_graph_refusal_leaves_the_helper_able_to_capture(probe, when):
    session, backend, model, helper = stale_build(probe, when)
    loss = (all_layers(model)[0].weight * 2).sum()
    with pytest.raises(StaleAutogradGraphError):
        helper.create_cudagraphs()
    assert helper.capture_finished() is False
    # Before: nothing ran. After a failed capture: rolled back and reset as Megatron resets.
    assert helper.reset_after_capture_calls == (1 if when == "refuse" else 0)
    del loss
    # Python 3.12: the holder search read this frame's f_locals, whose snapshot keeps `loss` alive
    # after `del` until the locals are read again, as here (3.13 keeps no snapshot).
    locals()
    helper.create_cudagraphs()
    assert helper.graphs_created()


def test_capture_succeeds_once_the_loss_is_gone(probe, memory):
    session, backend, model, helper = build(probe, layout=(2,), stale_graph_check="refuse")
    loss = (all_layers(model)[1].weight * 2).sum()
    assert loss.requires_grad
    del loss
    helper.create_cudagraphs()
    assert helper.graphs_created()


@pytest.mark.parametrize(
    "when, words", [("refuse", "refused after a failed capture"), ("before", "refused before capture")]
)
def test_stale_graph_in_eager_mode_names_the_holder(probe, when, words):
    session, backend, model, helper = stale_build(probe, when, on_capture_error="eager")
    kept = [(all_layers(model)[1].weight * 3).mean()]
    helper.create_cudagraphs()
    assert words in helper.capture_stats.failure
    assert "an element of a list of length 1" in helper.capture_stats.failure
    assert not helper.graphs_created() and helper.capture_finished()
    del kept


def test_graph_held_by_garbage_is_collected_before_capture_with_the_before_check(probe):
    """The default check needs no collection: Megatron's _start_capturing collects first."""
    session, backend, model, helper = stale_build(probe, "before")
    was_enabled = gc.isenabled()
    gc.disable()  # the cycle lives until a collection
    try:
        cycle = types.SimpleNamespace(loss=(all_layers(model)[0].weight * 2).sum())
        cycle.me = cycle
        del cycle
        helper.create_cudagraphs()
    finally:
        if was_enabled:
            gc.enable()
    assert helper.graphs_created() and helper.capture_stats.failure is None
    assert len(backend.calls) == 1 and "stale-graph check" in helper.capture_stats.phases


def test_the_default_check_lists_the_heap_only_after_a_failure(probe, monkeypatch):
    scans = []
    real = stale_graphs.find_stale_graphs
    monkeypatch.setattr(stale_graphs, "find_stale_graphs", lambda *a, **k: scans.append(1) or real(*a, **k))
    session, backend, model, helper = build(probe, layout=(2,), stale_graph_check="refuse")
    helper.create_cudagraphs()
    assert helper.graphs_created() and scans == [] and "stale-graph check" not in helper.capture_stats.phases


def test_a_failure_with_another_cause_is_reported_as_itself_even_with_a_live_graph(probe, memory):
    session, backend, model, helper = build(
        probe, layout=(2,), backend=FakeTEBackend(memory=memory, fail_at=2), stale_graph_check="refuse"
    )
    loss = (all_layers(model)[0].weight * 2).sum()
    with pytest.raises(CaptureFailedError, match="capture of graph 2 failed") as info:
        helper.create_cudagraphs()
    assert _stale_error(info.value) is None  # not CUDA's stale-graph symptoms: the live graph is not blamed
    assert len(backend.calls) == 1 and not helper.graphs_created()
    del loss


def test_eager_mode_refusal_after_a_failure_keeps_the_layer_and_cudas_error(probe):
    session, backend, model, helper = stale_build(probe, "refuse", on_capture_error="eager")
    loss = (all_layers(model)[0].weight * 2).sum()
    helper.create_cudagraphs()
    failure = helper.capture_stats.failure
    assert failure.startswith(
        "refused after a failed capture (layer 1 (forward): RuntimeError: CUDA error: operation would"
    )
    assert "'loss'" in failure
    del loss


def test_a_diagnosis_that_fails_itself_leaves_the_capture_failure_as_it_came(probe, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("diagnosis blew up")

    monkeypatch.setattr(stale_graphs, "diagnose_failed_capture", broken)
    session, backend, model, helper = stale_build(probe, "refuse", on_capture_error="eager")
    loss = (all_layers(model)[0].weight * 2).sum()
    helper.create_cudagraphs()  # eager mode: training goes on
    assert "legacy stream" in helper.capture_stats.failure and helper.capture_finished()
    del loss


class RefusingBackend(FakeTEBackend):
    """Raises the plugin's own refusal inside the capture, as slot-shared capture's check does."""

    def make_graphed_callables(self, callables, sample_args, **kwargs):
        self.calls.append(dict(kwargs, n=len(sample_args)))
        raise StaleAutogradGraphError(
            [stale_graphs.StaleGraph(root="SumBackward0 output", parameters=1, holders=("local variable 'x'",))]
        )


def test_a_refusal_raised_inside_the_capture_is_that_refusal_without_another_scan(probe, monkeypatch):
    scans = []
    monkeypatch.setattr(stale_graphs, "find_stale_graphs", lambda *a, **k: scans.append(1) or [])
    session, backend, model, helper = build(probe, layout=(2,), backend=RefusingBackend(), stale_graph_check="refuse")
    with pytest.raises(StaleAutogradGraphError, match="local variable 'x'"):
        helper.create_cudagraphs()
    assert scans == []


def test_with_the_check_off_a_live_loss_fails_the_capture_unexplained(probe):
    session, backend, model, helper = stale_build(probe, "off")
    loss = (all_layers(model)[0].weight * 2).sum()
    with pytest.raises(CaptureFailedError, match="legacy stream") as info:
        helper.create_cudagraphs()
    assert _stale_error(info.value) is None and len(backend.calls) == 1
    del loss


def test_stale_graph_check_off_captures_with_a_live_loss(probe, memory):
    session, backend, model, helper = build(probe, layout=(2,), stale_graph_check="off")
    loss = (all_layers(model)[0].weight * 2).sum()
    helper.create_cudagraphs()
    assert helper.graphs_created() and helper.capture_stats.failure is None
    assert loss.grad_fn is not None


def test_stale_graph_unrelated_to_graphed_layers_is_ignored(probe, memory):
    session, backend, model, helper = build(probe, layout=(2,), stale_graph_check="refuse")
    other = torch.nn.Parameter(torch.ones(3))
    loss = (other * 2).sum()
    helper.create_cudagraphs()
    assert helper.graphs_created()
    del loss


def test_failed_capture_shows_in_the_report_table(probe, memory):
    backend = FakeTEBackend(memory=memory, fail_at=2)
    session, backend, model, helper = build(probe, layout=(2,), backend=backend, on_capture_error="eager")
    helper.create_cudagraphs()
    text = session.report().format_table()
    assert (
        "  layer: capture failed and was rolled back: layer 2 (forward): RuntimeError: fake CUDA error: "
        "capture of graph 2 failed"
    ) in text.splitlines()
    assert "after teardown" not in text


# ====================================================================== graph banks (capture is GPU-tested)


class BankedFakeLayer(FakeLayer):
    graph_banks = True  # what banked_layer_class marks


@pytest.fixture
def hybrid_groups(monkeypatch):
    from megatron.core import parallel_state

    group = object()
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda with_context_parallel=False: 2)
    monkeypatch.setattr(parallel_state, "get_hybrid_data_context_parallel_groups", lambda group_size: group)
    return group


def test_banks_need_the_banked_layer_class(probe, hybrid_groups):
    _, _, _, helper = build(probe, graph_banks=True)
    with pytest.raises(CaptureFailedError, match=r"needs the banked layer class .* \[.FakeLayer.\] were built"):
        helper.create_cudagraphs()


@pytest.mark.parametrize("on_error", ["raise", "eager"])
def test_a_failed_bank_capture_is_raised_or_recorded(probe, hybrid_groups, monkeypatch, on_error):
    from megatron_cg_plugin.banks import capture

    seen = {}

    def failing_capture(layers, groups, capacity, **kwargs):
        seen.update(groups=groups, capacity=capacity)
        raise RuntimeError("NCCL went away")

    monkeypatch.setattr(capture, "capture_banks", failing_capture)
    _, _, _, helper = build(
        probe, classes=(BankedFakeLayer,), graph_banks=True, thd_max_seqs=3, on_capture_error=on_error
    )
    helper.config.max_seqlen_per_dp_cp_rank = 256
    if on_error == "raise":
        with pytest.raises(
            CaptureFailedError,
            match="graph bank capture failed in the capture's setup, before any layer ran: "
            "RuntimeError: NCCL went away",
        ):
            helper.create_cudagraphs()
    else:
        helper.create_cudagraphs()
    assert seen["groups"] == {1: None, 2: hybrid_groups}
    assert (seen["capacity"].tokens_per_rank, seen["capacity"].max_seqs) == (256, 3)
    assert not helper.graphs_created() and helper.capture_finished()  # no retry every step
    assert "NCCL went away" in helper.capture_stats.failure and helper.capture_stats.graphs == 0


@pytest.mark.parametrize("stays", [True, False])
def test_bank_contracts_read_parameters_once_a_step_where_the_model_keeps_them(
    probe, hybrid_groups, monkeypatch, stays
):
    from megatron_cg_plugin.banks import capture

    seen = {}

    def capture_banks(layers, groups, capacity, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop after the call")

    monkeypatch.setattr(capture, "capture_banks", capture_banks)
    monkeypatch.setattr(capture_lifecycle, "parameters_stay_within_a_step", lambda model: stays)
    session, _, _, helper = build(
        probe, classes=(BankedFakeLayer,), graph_banks=True, thd_max_seqs=3, on_capture_error="eager"
    )
    helper.config.max_seqlen_per_dp_cp_rank = 256
    helper.create_cudagraphs()
    assert seen["step_marks"] is (session.step_marks if stays else None)


@pytest.mark.parametrize("on_error", ["raise", "eager"])
def test_a_bank_capture_that_fails_part_way_is_rolled_back(probe, hybrid_groups, monkeypatch, collections, on_error):
    # The banks' capture goes through the capture transaction, as TE's does: what it changed before it
    # failed is put back, and the failure ends as every capture's does.
    from megatron_cg_plugin.banks import capture

    def capture_banks(layers, groups, capacity, **kwargs):
        mcg._set_capture_start()  # a patched Megatron global left set
        gc.disable()
        layers[0]._te_cuda_graph_capture(hidden())  # new grads, RNG drawn; names layer 1
        layers[0].cuda_graphs = ["half a bank"]
        vars(layers[0])["_graph_banks"] = "layer 1's banks"  # banked before the failure
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(capture, "capture_banks", capture_banks)
    _, backend, model, helper = build(
        probe, classes=(BankedFakeLayer,), graph_banks=True, thd_max_seqs=3, on_capture_error=on_error
    )
    helper.config.max_seqlen_per_dp_cp_rank = 256
    _prepare_grads(model)
    before = Snapshot(model, backend, helper)
    cause = "layer 1 (forward): RuntimeError: CUDA error: operation not permitted when stream is capturing"
    with pytest.raises(CaptureFailedError) if on_error == "raise" else contextlib.nullcontext() as info:
        helper.create_cudagraphs()
    before.assert_restored(model, backend, helper)
    assert all("_graph_banks" not in vars(layer) for layer in all_layers(model))  # nothing left banked
    assert helper._banks is None and not helper.graphs_created() and helper.capture_finished()  # eager from now on
    assert helper.reset_after_capture_calls == 0  # Megatron's lifecycle never started: nothing of it to reset
    assert helper.capture_stats.failure == cause and helper.capture_stats.graphs == 0 and collections
    if on_error == "raise":
        assert str(info.value).startswith(f"graph bank capture failed in {cause}\nNo layer was left banked.")
        assert isinstance(info.value.__cause__, RuntimeError)
    layer = all_layers(model)[0]
    assert torch.equal(layer(hidden(requires_grad=False)), hidden(requires_grad=False) * layer.weight)  # eager


def test_a_failed_bank_capture_names_the_layer_and_phase(probe, hybrid_groups, monkeypatch):
    from megatron_cg_plugin.banks import capture

    outputs = []

    def capture_banks(layers, groups, capacity, **kwargs):  # each layer's forward and backward back to back
        for layer in layers:
            outputs.append(layer._te_cuda_graph_capture(hidden()))
            outputs[-1][0].sum().backward()

    monkeypatch.setattr(capture, "capture_banks", capture_banks)
    _, _, model, helper = build(probe, layout=(3,), classes=(BankedGradFakeLayer,), graph_banks=True, thd_max_seqs=3)
    helper.config.max_seqlen_per_dp_cp_rank = 256
    handle = all_layers(model)[1].weight.register_hook(_failing_grad_hook)
    try:
        with pytest.raises(
            CaptureFailedError,
            match=r"graph bank capture failed in layer 2 \(backward\): "
            "RuntimeError: a user's gradient hook raised",
        ):
            helper.create_cudagraphs()
    finally:
        handle.remove()
    assert helper.capture_stats.failure == "layer 2 (backward): RuntimeError: a user's gradient hook raised"
    assert len(outputs) == 2 and _hooks_left(outputs) == []
    assert all("_te_cuda_graph_capture" not in vars(layer) for layer in all_layers(model))


def test_capture_shows_the_session_the_built_models_config_first(probe):
    # A script may set TransformerConfig fields no flag has (FP8 attention): the report's prediction follows them.
    session, backend, _, helper = build(probe)
    events = []
    session.predict(RunPrediction(repredict=lambda config: events.append(("config", config))))
    capture = backend.make_graphed_callables
    backend.make_graphed_callables = lambda *a, **k: events.append(("capture", None)) or capture(*a, **k)
    helper.create_cudagraphs()
    assert events[:2] == [("config", helper.config), ("capture", None)] and helper.graphs_created()


# ====================================================================== held state once a step


def test_only_megatrons_ddp_counts_as_keeping_parameters_in_place_within_a_step():
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

    ddp, megatron_fsdp, torch_fsdp2 = (
        cls.__new__(cls) for cls in (DistributedDataParallel, FullyShardedDataParallel, TorchFullyShardedDataParallel)
    )
    assert capture_lifecycle.parameters_stay_within_a_step([ddp, ddp])
    assert not capture_lifecycle.parameters_stay_within_a_step([ddp, megatron_fsdp])
    assert not capture_lifecycle.parameters_stay_within_a_step([torch_fsdp2])
    assert not capture_lifecycle.parameters_stay_within_a_step([torch.nn.Linear(2, 2)])  # unwrapped: not known


@pytest.mark.parametrize("stays", [True, False])
def test_a_model_that_keeps_its_parameters_has_them_read_once_a_step(probe, memory, monkeypatch, stays):
    monkeypatch.setattr(capture_lifecycle, "parameters_stay_within_a_step", lambda model: stays)
    session, _, model, _ = _captured(probe)
    layer = all_layers(model)[0]

    def replay(first):
        return layer.cuda_graphs[0](hidden(), attention_mask=mask(), is_first_microbatch=first)

    with session.step_marks:  # as the train-step-timer patch enters them
        assert replay(True) == replay(False) == ("replayed", 0)
        layer.weight.data = torch.zeros_like(layer.weight)
        if stays:  # the same step: read at its first microbatch
            assert replay(False) == ("replayed", 0)
        else:
            assert (
                _refused(layer.cuda_graphs[0], hidden(), attention_mask=mask(), is_first_microbatch=False).field
                == "parameter storage"
            )
    # after the step, a forward of one's own (marked as a later microbatch) reads them
    assert (
        _refused(layer.cuda_graphs[0], hidden(), attention_mask=mask(), is_first_microbatch=False).field
        == "parameter storage"
    )


# ====================================================================== memory guard before capture

# A dense GPT the rules accept, whose whole-layer graphs the planner predicts at several GiB.
GUARDED = RunSettings(
    cuda_graph_impl="transformer_engine",
    num_layers=8,
    hidden_size=2048,
    ffn_hidden_size=8192,
    num_attention_heads=16,
    seq_length=2048,
    max_position_embeddings=2048,
    micro_batch_size=4,
    position_embedding_type="rope",
)


def guarded_build(probe, monkeypatch, *, free_device, **config):
    """``build`` for a run whose settings the rules passed (the planner predicts its capture), with
    ``read_free_memory`` faked: ``free_device`` bytes free on the GPU; the budgets it was asked with are
    recorded."""
    session, backend, model, helper = build(probe, **config)
    session.take_settings(GUARDED)
    asked = []

    def read_free_memory(budget_gib):
        asked.append(budget_gib)
        return memory_guard.FreeMemory(device=free_device, host=None)

    monkeypatch.setattr(capture_lifecycle, "read_free_memory", read_free_memory)
    return session, backend, model, helper, asked


def _predicted(session) -> memory_guard.CaptureNeed:
    return memory_guard.CaptureNeed.of(session.prediction.graph_memory)


GUARD_LOG = "megatron_cg_plugin.capture_lifecycle"


def test_a_capture_that_would_not_fit_is_refused_before_anything_is_captured(probe, memory, monkeypatch):
    session, backend, model, helper, asked = guarded_build(probe, monkeypatch, free_device=3 * 2**30)
    need = _predicted(session)
    free = memory_guard.FreeMemory(device=3 * 2**30)
    assert memory_guard.judge(need, free) is memory_guard.Fit.DOES_NOT_FIT
    fitting = memory_guard.fitting_setups(GUARDED, session.config, free)
    assert fitting  # a smaller scope fits in 3 GiB
    with pytest.raises(capture_lifecycle.CaptureWontFitError) as info:
        helper.create_cudagraphs()
    assert isinstance(info.value, CaptureFailedError) and asked == [None]
    message = str(info.value)
    assert message.startswith(
        f"CUDA graph capture (layer) would not fit in memory, so nothing was captured: the planner predicts "
        f"{memory_guard.gib(need.device_bytes)} on the GPU (graph pool {memory_guard.gib(need.graph_pool)}) "
        "against 3.00 GiB free"
    )
    assert "  --cuda-graph-modules attn  (" in message
    assert all(f"  {setup.command_line}  (" in message for setup in fitting)
    # Nothing ran: no capture, not even Megatron's capture start; the phase stays open for another try.
    assert backend.calls == [] and helper.events == [] and memory.calls == 0
    assert all(layer.capture_calls == 0 for layer in all_layers(model))
    assert not helper.graphs_created() and not helper.capture_finished()


def test_with_eager_fallback_a_capture_that_would_not_fit_trains_on_without_graphs(probe, memory, monkeypatch, caplog):
    session, backend, model, helper, _ = guarded_build(
        probe, monkeypatch, free_device=3 * 2**30, on_capture_error="eager"
    )
    with caplog.at_level(logging.WARNING, logger=GUARD_LOG):
        helper.create_cudagraphs()  # nothing raised
    assert backend.calls == [] and not helper.graphs_created() and helper.capture_finished()  # eager from now on
    (record,) = [r for r in caplog.records if r.name == GUARD_LOG]
    assert "would not fit in memory" in record.getMessage() and "--cuda-graph-modules attn  (" in record.getMessage()
    assert record.getMessage().endswith("training continues eagerly (--cg-on-capture-error eager).")
    failure = helper.capture_stats.failure
    assert failure.startswith("refused before capture: CUDA graph capture (layer) would not fit in memory")
    assert failure.removeprefix("refused before capture: ") in record.getMessage()  # the same message
    (scope,) = session.report().scopes
    assert scope.failure == failure and scope.graphs_captured == 0
    assert "capture failed and was rolled back: refused before capture: CUDA graph capture (layer) would not fit" in (
        session.report().format_table()
    )
    layer = all_layers(model)[0]
    assert torch.equal(layer(hidden(requires_grad=False)), hidden(requires_grad=False) * layer.weight)  # eager


@pytest.mark.parametrize("rank0", [True, False])
def test_a_capture_close_to_the_limit_warns_once_on_rank_0_and_captures(
    probe, memory, monkeypatch, caplog, cuda_sync, rank0
):
    probe.rank0 = rank0
    session, backend, model, helper, _ = guarded_build(probe, monkeypatch, free_device=0)
    need = _predicted(session)
    monkeypatch.setattr(
        capture_lifecycle, "read_free_memory", lambda budget: memory_guard.FreeMemory(device=need.device_bytes + 2**29)
    )
    with caplog.at_level(logging.WARNING, logger=GUARD_LOG):
        helper.create_cudagraphs()
        helper.delete_cuda_graphs()
        helper.create_cudagraphs()  # a second capture: no second warning
    assert helper.graphs_created() and len(backend.calls) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == GUARD_LOG]
    assert len(warnings) == (1 if rank0 else 0)
    if rank0:
        assert "CUDA graph capture (layer) is close to the memory limit" in warnings[0]


def test_a_capture_that_fits_captures_without_a_word(probe, memory, monkeypatch, caplog):
    _, backend, _, helper, _ = guarded_build(probe, monkeypatch, free_device=200 * 2**30)
    with caplog.at_level(logging.WARNING, logger=GUARD_LOG):
        helper.create_cudagraphs()
    assert helper.graphs_created() and backend.calls
    assert [r for r in caplog.records if r.name == GUARD_LOG] == []


def test_the_budget_flag_replaces_the_free_memory(probe, memory, monkeypatch):
    # The real reading: with a budget the GPU is not read (this host has none), the host is.
    session, backend, _, helper = build(probe, memory_budget_gib=0.5)
    session.take_settings(GUARDED)
    with pytest.raises(
        capture_lifecycle.CaptureWontFitError, match=r"against 0\.50 GiB free \(--cg-memory-budget-gib 0\.5\)"
    ):
        helper.create_cudagraphs()
    assert backend.calls == []
    _, _, _, helper, asked = guarded_build(probe, monkeypatch, free_device=200 * 2**30, memory_budget_gib=150.0)
    helper.create_cudagraphs()
    assert asked == [150.0] and helper.graphs_created()


def test_without_a_reading_of_the_gpu_the_capture_is_not_guarded(probe, memory):
    # This host has no CUDA: the GPU's free memory is unknown, and a capture goes ahead.
    session, backend, _, helper = build(probe)
    session.take_settings(GUARDED)
    assert capture_lifecycle.read_free_memory(None).device is None
    helper.create_cudagraphs()
    assert helper.graphs_created() and backend.calls


def _reading_refused(budget):
    raise AssertionError("free memory was read for a run the planner did not predict")


@pytest.mark.parametrize("predicted", [False, True])
def test_a_run_without_a_prediction_is_not_guarded(probe, memory, monkeypatch, predicted):
    session, backend, _, helper = build(probe)
    if predicted:  # the rules saw the run, but the planner does not model it
        session.take_settings(GUARDED)
        session.predict(RunPrediction())
    monkeypatch.setattr(capture_lifecycle, "read_free_memory", _reading_refused)
    helper.create_cudagraphs()
    assert helper.graphs_created()
