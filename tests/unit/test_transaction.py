"""Tests for megatron_cg_plugin.capture.transaction: restorable snapshots and the capture
transaction that rolls them back (graphs reset newest first, snapshots restored in reverse)."""

from __future__ import annotations

import gc
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.capture.transaction import (
    CaptureTransaction,
    Restorable,
    attribute,
    gc_freeze,
    gc_state,
    megatron_capture_state,
    tensor_grads,
)


class Boom(RuntimeError):
    pass


class Base:
    inherited = "class value"

    def method(self):
        return "base"


class Child(Base):
    pass


class Plain:
    pass


def roundtrip(item: Restorable, mutate) -> None:
    snapshot = item.save()
    mutate()
    item.restore(snapshot)


# ====================================================================== attribute


def test_attribute_restores_an_overwritten_value_by_identity():
    obj, value = Plain(), object()
    obj.x = value
    roundtrip(attribute(obj, "x"), lambda: setattr(obj, "x", object()))
    assert obj.x is value


def test_attribute_restores_a_deleted_attribute():
    obj, value = Plain(), [1]
    obj.x = value
    roundtrip(attribute(obj, "x"), lambda: delattr(obj, "x"))
    assert vars(obj)["x"] is value


def test_attribute_absent_stays_absent():
    obj = Plain()
    roundtrip(attribute(obj, "x"), lambda: setattr(obj, "x", 3))
    assert "x" not in vars(obj)
    roundtrip(attribute(obj, "y"), lambda: None)  # never set: nothing to do
    assert "y" not in vars(obj)


def test_attribute_inherited_class_attribute_is_not_frozen_into_the_subclass():
    original_call = vars(Base)["method"]
    item = attribute(Child, "method")
    snapshot = item.save()
    Child.method = lambda self: "patched"
    assert Child().method() == "patched"
    item.restore(snapshot)
    assert "method" not in vars(Child)
    assert Child().method() == "base"
    Base.method = lambda self: "changed later"  # the subclass follows its base again
    try:
        assert Child().method() == "changed later"
    finally:
        Base.method = original_call


def test_attribute_inherited_instance_attribute():
    obj = Child()
    roundtrip(attribute(obj, "inherited"), lambda: setattr(obj, "inherited", "shadow"))
    assert "inherited" not in vars(obj) and obj.inherited == "class value"


def test_attribute_on_a_module_and_nn_module_class_call():
    module = types.ModuleType("fake_te")
    module.FLAG = False
    flag = module.FLAG
    roundtrip(attribute(module, "FLAG"), lambda: setattr(module, "FLAG", True))
    assert module.FLAG is flag

    class Layer(torch.nn.Module):
        def forward(self, x):
            return x

    roundtrip(attribute(Layer, "__call__"), lambda: setattr(Layer, "__call__", lambda self, *a: "patched"))
    assert "__call__" not in vars(Layer)
    assert Layer.__call__ is torch.nn.Module.__call__
    assert Layer()(5) == 5


def test_attribute_restore_does_not_reassign_an_unchanged_value():
    class Loud:
        def __init__(self):
            self.__dict__["x"] = 1
            self.sets = 0

        def __setattr__(self, name, value):
            if name == "x":
                self.__dict__["sets"] += 1
            object.__setattr__(self, name, value)

    obj = Loud()
    roundtrip(attribute(obj, "x"), lambda: None)
    assert obj.sets == 0


def test_attribute_labels():
    assert attribute(Child, "method").name == "Child.method"
    assert attribute(Plain(), "x").name == "Plain.x"
    assert attribute(Plain(), "x", label="a flag").name == "a flag"


def test_megatron_capture_state_is_back_after_a_failed_capture(unfrozen):
    from megatron.core.transformer import cuda_graphs

    gc.unfreeze()  # the import may have frozen objects
    flag, enabled = cuda_graphs._IS_GRAPH_CAPTURING, gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"), CaptureTransaction(megatron_capture_state()):
        cuda_graphs._IS_GRAPH_CAPTURING = not flag  # what a capture failing part-way leaves set
        gc.disable()
        gc.freeze()
        raise RuntimeError("capture failed")
    assert cuda_graphs._IS_GRAPH_CAPTURING is flag and gc.isenabled() == enabled and gc.get_freeze_count() == 0


# ====================================================================== gc


def test_gc_state_restores_enabled():
    assert gc.isenabled()
    try:
        roundtrip(gc_state(), gc.disable)
        assert gc.isenabled()
    finally:
        gc.enable()


def test_gc_state_restores_disabled():
    gc.disable()
    try:
        roundtrip(gc_state(), gc.enable)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.fixture
def unfrozen():
    """Starts from no frozen objects (something at import time may have frozen some)."""
    previous = gc.get_freeze_count()
    gc.unfreeze()
    yield
    gc.unfreeze()
    if previous:
        gc.freeze()


def test_gc_freeze_undoes_a_freeze_added_by_capture(unfrozen):
    Plain()  # at least one tracked object to freeze
    roundtrip(gc_freeze(), gc.freeze)
    assert gc.get_freeze_count() == 0


def test_gc_freeze_without_a_new_freeze_does_nothing(unfrozen):
    roundtrip(gc_freeze(), lambda: None)
    assert gc.get_freeze_count() == 0


def test_gc_freeze_keeps_objects_frozen_before_capture(unfrozen):
    keep = [Plain() for _ in range(3)]
    gc.freeze()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    roundtrip(gc_freeze(), lambda: None)
    assert gc.get_freeze_count() == frozen  # not unfrozen by the rollback
    del keep


# ====================================================================== tensor_grads


def test_tensor_grads_restores_grad_and_main_grad_by_identity():
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    params[0].grad = torch.zeros(2)
    params[1].main_grad = torch.zeros(2)
    params[2].grad, params[2].main_grad = torch.ones(2), torch.ones(2)
    before = [(p.grad, getattr(p, "main_grad", None)) for p in params]

    def mutate():
        for p in params:
            p.grad = torch.full((2,), 5.0)
            p.main_grad = torch.full((2,), 6.0)

    item = tensor_grads(iter(params))  # any iterable: taken once
    roundtrip(item, mutate)
    for p, (grad, main_grad) in zip(params, before):
        assert p.grad is grad
        if main_grad is not None:
            assert p.main_grad is main_grad
    assert params[1].grad is None
    assert "3 parameters" in item.name


def test_tensor_grads_restores_none_grad():
    p = torch.nn.Parameter(torch.ones(2))
    roundtrip(tensor_grads([p]), lambda: setattr(p, "grad", torch.ones(2)))
    assert p.grad is None


def test_tensor_grads_removes_a_main_grad_added_during_capture():
    p = torch.nn.Parameter(torch.ones(2))
    roundtrip(tensor_grads([p]), lambda: setattr(p, "main_grad", torch.ones(2)))
    assert not hasattr(p, "main_grad")


# ====================================================================== CaptureTransaction


class Graph:
    def __init__(self, name: str, log: list, fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def reset(self) -> None:
        self.log.append(f"reset {self.name}")
        if self.fail:
            raise RuntimeError(f"cannot reset {self.name}")

    def __repr__(self) -> str:
        return f"Graph({self.name})"


def logged(name: str, log: list, *, fail_restore: bool = False, value=None) -> Restorable:
    def save():
        log.append(f"save {name}")
        return value if value is not None else name

    def restore(snapshot):
        log.append(f"restore {name}={snapshot}")
        if fail_restore:
            raise RuntimeError(f"cannot restore {name}")

    return Restorable(name, save, restore)


def test_rollback_on_error_resets_graphs_newest_first_then_restores_in_reverse():
    log: list[str] = []
    transaction = CaptureTransaction([logged("a", log), logged("b", log)])
    with pytest.raises(Boom), transaction:
        transaction.add([logged("c", log)])
        for name in ("g1", "g2", "g3"):
            transaction.track(Graph(name, log))
        raise Boom("capture failed")
    assert log == [
        "save a",
        "save b",
        "save c",
        "reset g3",
        "reset g2",
        "reset g1",
        "restore c=c",
        "restore b=b",
        "restore a=a",
    ]
    assert transaction.rolled_back
    assert transaction.graphs == []
    assert transaction.rollback_errors == []


def test_rollback_continues_past_failures_and_records_them():
    log: list[str] = []
    transaction = CaptureTransaction([logged("a", log), logged("b", log, fail_restore=True), logged("c", log)])
    original = Boom("the real cause")
    with pytest.raises(Boom) as info, transaction:
        transaction.track(Graph("g1", log))
        transaction.track(Graph("g2", log, fail=True))
        transaction.track(Graph("g3", log))
        raise original
    assert info.value is original  # the original error, not a rollback error
    assert log[3:] == ["reset g3", "reset g2", "reset g1", "restore c=c", "restore b=b", "restore a=a"]
    assert transaction.rollback_errors == ["reset of Graph(g2): cannot reset g2", "restore of b: cannot restore b"]


def test_rollback_also_on_base_exceptions():
    transaction = CaptureTransaction([])
    with pytest.raises(KeyboardInterrupt), transaction:
        raise KeyboardInterrupt
    assert transaction.rolled_back


def test_success_changes_nothing():
    log: list[str] = []
    transaction = CaptureTransaction([logged("a", log)])
    with transaction as entered:
        assert entered is transaction
        graph = Graph("g", log)
        transaction.track(graph)
        transaction.add([logged("b", log)])
    assert log == ["save a", "save b"]
    assert not transaction.rolled_back
    assert transaction.graphs == [graph]


def test_snapshots_are_taken_at_enter_not_at_construction():
    obj = Plain()
    obj.x = "at construction"
    transaction = CaptureTransaction([attribute(obj, "x")])
    obj.x = "at enter"
    with pytest.raises(Boom), transaction:
        obj.x = "during"
        raise Boom
    assert obj.x == "at enter"


def test_add_snapshots_at_add_time():
    obj = Plain()
    obj.late = "before capture"
    transaction = CaptureTransaction([])
    with pytest.raises(Boom), transaction:
        obj.late = "changed before add"
        value = obj.late
        transaction.add([attribute(obj, "late")])
        obj.late = "changed after add"
        raise Boom
    assert obj.late is value


def test_real_state_is_rolled_back_end_to_end():
    module = types.ModuleType("fake_te")
    module.CAPTURING = False

    class Layer(torch.nn.Module):
        pass

    p = torch.nn.Parameter(torch.ones(2))
    grad = p.grad = torch.zeros(2)
    items = [attribute(module, "CAPTURING"), attribute(Layer, "__call__"), gc_state(), tensor_grads([p])]
    try:
        with pytest.raises(Boom), CaptureTransaction(items):
            module.CAPTURING = True
            Layer.__call__ = lambda self: None
            gc.disable()
            p.grad = torch.ones(2)
            raise Boom
        assert module.CAPTURING is False
        assert "__call__" not in vars(Layer)
        assert gc.isenabled()
        assert p.grad is grad
    finally:
        gc.enable()


# ====================================================================== property


NAMES = ("a", "b", "c", "inherited")
POOL = [object() for _ in range(4)]

operations = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(NAMES), st.integers(0, len(POOL) - 1)),
        st.tuples(st.just("del"), st.sampled_from(NAMES), st.just(0)),
    ),
    max_size=20,
)


@settings(max_examples=150, deadline=None)
@given(
    initial=st.dictionaries(st.sampled_from(NAMES), st.integers(0, len(POOL) - 1)),
    ops=operations,
    late=st.integers(0, 20),
)
def test_failed_transaction_restores_every_attribute(initial, ops, late):
    obj = Child()
    for name, index in initial.items():
        setattr(obj, name, POOL[index])
    before = dict(vars(obj))

    transaction = CaptureTransaction([attribute(obj, name) for name in NAMES])
    with pytest.raises(Boom), transaction:
        for position, (op, name, index) in enumerate(ops):
            if position == late:  # a late add() snapshots state that is already changed
                transaction.add([attribute(obj, name) for name in NAMES])
            if op == "set":
                setattr(obj, name, POOL[index])
            elif name in vars(obj):
                delattr(obj, name)
        raise Boom

    after = vars(obj)
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert obj.inherited == before.get("inherited", "class value")


def test_te_backend_tracking_reports_graphs_only_inside_and_puts_the_class_back():
    from megatron_cg_plugin.capture.te_backend import TEBackend

    original = torch.cuda.CUDAGraph
    with pytest.raises(Boom), TEBackend().tracking(lambda graph: None):
        tracked = torch.cuda.CUDAGraph
        assert tracked is not original and issubclass(tracked, original)  # what TE constructs now
        raise Boom()
    assert torch.cuda.CUDAGraph is original
