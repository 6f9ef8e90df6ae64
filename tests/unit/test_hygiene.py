"""Tests for megatron_cg_plugin.capture.stale_graphs: finding eager autograd graphs still alive before
capture, naming what holds them, and refusing capture while they exist."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_cg_plugin.capture import stale_graphs
from megatron_cg_plugin.capture.stale_graphs import (
    StaleAutogradGraphError,
    StaleGraph,
    diagnose_failed_capture,
    ensure_no_stale_graphs,
    find_stale_graphs,
)


class Holder:
    pass


@pytest.fixture
def weights():
    return [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]


class CountingCollect:
    def __init__(self, real: bool = True) -> None:
        self.calls = 0
        self.real = real

    def __call__(self):
        self.calls += 1
        return gc.collect() if self.real else 0


# ====================================================================== find_stale_graphs


def test_live_loss_reaching_the_params_is_found(weights):
    w = weights[0]
    loss = (w * 2).sum()
    (stale,) = find_stale_graphs([w])
    assert stale.root == "SumBackward0 output, shape (), torch.float32"
    assert stale.parameters == 1
    assert any(
        h.startswith("local variable 'loss' in test_live_loss_reaching_the_params_is_found() (") and __file__ in h
        for h in stale.holders
    )
    del loss


def test_loss_reaching_other_params_is_not_found(weights):
    w, other = weights[0], weights[1]
    loss = (other * 2).sum()
    assert find_stale_graphs([w]) == []
    assert len(find_stale_graphs([other])) == 1
    del loss


def test_no_graph_no_stale(weights):
    with torch.no_grad():
        out = (weights[0] * 2).sum()
    detached = (weights[0] * 2).detach()
    assert find_stale_graphs(weights) == []
    del out, detached


def test_counts_every_graphed_parameter_reached(weights):
    a, b, c = weights
    loss = (a * b).sum() + c.sum()
    (stale,) = [s for s in find_stale_graphs(weights) if s.root.startswith("AddBackward0")]
    assert stale.parameters == 3
    (partial,) = [s for s in find_stale_graphs([a, b]) if s.root.startswith("AddBackward0")]
    assert partial.parameters == 2
    del loss


def test_holder_attribute_of_an_object(weights):
    holder = Holder()
    holder.out = (weights[0] * 3).mean()
    (stale,) = find_stale_graphs(weights[:1])
    assert "attribute 'out' of Holder" in stale.holders
    assert not any("'holder'" in h for h in stale.holders)  # the local holds the object, not the tensor
    del holder


def test_holder_list_element(weights):
    outputs = [1, (weights[0] * 3).mean(), "x"]
    (stale,) = find_stale_graphs(weights[:1])
    assert "an element of a list of length 3" in stale.holders
    del outputs


def test_every_holder_is_named(weights):
    loss = (weights[0] * 2).sum()
    kept = [loss]
    holder = Holder()
    holder.last_loss = loss
    (stale,) = find_stale_graphs(weights[:1])
    assert any("local variable 'loss'" in h for h in stale.holders)
    assert "an element of a list of length 1" in stale.holders
    assert "attribute 'last_loss' of Holder" in stale.holders
    del loss, kept, holder


def test_objects_argument_limits_the_scan(weights):
    loss = (weights[0] * 2).sum()
    assert find_stale_graphs(weights, objects=[]) == []
    assert len(find_stale_graphs(weights, objects=[loss, 5, "x"])) == 1
    assert len(find_stale_graphs(weights, objects=iter([loss]))) == 1
    del loss


# ====================================================================== ensure_no_stale_graphs


def test_no_stale_graphs_does_not_collect(weights):
    collect = CountingCollect()
    ensure_no_stale_graphs(iter(weights), collect=collect)
    assert collect.calls == 0


def test_graph_held_only_by_a_cycle_is_collected_and_capture_allowed(weights):
    was_enabled = gc.isenabled()
    gc.disable()  # keep the cycle alive until the check collects it
    try:
        cycle = Holder()
        cycle.me = cycle
        cycle.loss = (weights[0] * 2).sum()
        del cycle
        assert len(find_stale_graphs(weights)) == 1  # still alive: only a collection frees it
        collect = CountingCollect()
        ensure_no_stale_graphs(weights, collect=collect)
        assert collect.calls == 1
        assert find_stale_graphs(weights) == []
    finally:
        if was_enabled:
            gc.enable()


def test_live_graph_is_refused_after_one_collection(weights):
    loss = (weights[1] * 2).sum()
    collect = CountingCollect(real=False)
    with pytest.raises(StaleAutogradGraphError) as info:
        ensure_no_stale_graphs(weights, collect=collect)
    assert collect.calls == 1
    error = info.value
    (stale,) = error.stale
    assert isinstance(stale, StaleGraph) and stale.parameters == 1
    message = str(error)
    assert "1 autograd graph(s)" in message
    assert "SumBackward0 output, shape (), torch.float32, reaching 1 graphed parameter(s)" in message
    assert "local variable 'loss' in test_live_graph_is_refused_after_one_collection()" in message
    assert "del loss" in message
    del loss


def test_error_without_holders_says_so():
    error = StaleAutogradGraphError(
        [StaleGraph(root="MulBackward0 output, shape (3,), torch.float32", parameters=2, holders=())]
    )
    assert "no Python referrer found" in str(error)
    assert "reaching 2 graphed parameter(s)" in str(error)


def test_two_stale_graphs_are_both_listed(weights):
    first = (weights[0] * 2).sum()
    second = [(weights[2] * 5).mean()]
    with pytest.raises(StaleAutogradGraphError) as info:
        ensure_no_stale_graphs(weights, collect=CountingCollect(real=False))
    assert len(info.value.stale) == 2
    assert "2 autograd graph(s)" in str(info.value)
    assert "'first'" in str(info.value) and "an element of a list of length 1" in str(info.value)
    del first, second


# -- after a failed capture (the default: the heap is listed only then) -----------------------------


def _failed_capture(weights) -> RuntimeError:
    """A capture that fails after making outputs whose graphs reach the params, as TE's does;
    the error's traceback keeps the frame, and with it ``output``."""

    def capture():
        output = (weights[0] * 3).sum()  # held by this frame, as a failed capture's outputs are
        assert output.requires_grad
        raise RuntimeError("operation would make the legacy stream depend on a capturing blocking stream")

    try:
        capture()
    except RuntimeError as error:
        return error


def test_failure_with_no_eager_graph_is_unrelated_and_collects_nothing(weights):
    collect = CountingCollect()
    assert diagnose_failed_capture(weights, _failed_capture(weights), collect=collect) is None
    assert collect.calls == 0


def test_the_failed_captures_own_outputs_are_not_taken_for_eager_graphs(weights):
    """The traceback's frames are released first; without that their outputs look stale."""
    error = _failed_capture(weights)
    assert len(find_stale_graphs(weights)) == 1  # the output, alive in the traceback's frame
    assert diagnose_failed_capture(weights, error, collect=CountingCollect(real=False)) is None
    assert "legacy stream" in "".join(__import__("traceback").format_exception(error))  # still printable


def test_a_graph_held_by_garbage_does_not_explain_a_failure(weights):
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        cycle = Holder()
        cycle.me, cycle.loss = cycle, (weights[1] * 2).sum()
        del cycle
        collect = CountingCollect()
        assert diagnose_failed_capture(weights, _failed_capture(weights), collect=collect) is None
        assert collect.calls == 1 and find_stale_graphs(weights) == []
    finally:
        if was_enabled:
            gc.enable()


def test_failure_while_a_live_graph_is_held_names_it_from_the_capture_error(weights):
    loss = (weights[2] * 2).sum()
    error = _failed_capture(weights)
    with pytest.raises(StaleAutogradGraphError) as info:
        diagnose_failed_capture(weights, error, collect=CountingCollect(real=False))
    assert info.value.__cause__ is error and info.value.after_failure
    assert str(info.value).startswith("CUDA graph capture failed and was rolled back, and the likely cause")
    assert "local variable 'loss'" in str(info.value)
    (stale,) = info.value.stale
    assert stale.root.startswith("SumBackward0")
    del loss


def test_a_failure_without_cudas_symptoms_is_not_put_on_live_graphs(weights):
    """Another cause (an FP8 error in warmup, on the H200) may leave graphs reaching the params
    behind, held from C++; they must not replace the real error."""
    loss = (weights[0] * 2).sum()
    collect = CountingCollect(real=False)
    error = RuntimeError("FP8 data is required to generate FP8 data transpose")
    assert diagnose_failed_capture(weights, error, collect=collect) is None
    assert collect.calls == 0
    chained = RuntimeError("capture of layer 2 failed")
    chained.__cause__ = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    with pytest.raises(StaleAutogradGraphError):
        diagnose_failed_capture(weights, chained, collect=collect)
    del loss


def test_the_plugins_own_refusal_is_no_cuda_symptom(weights):
    refusal = StaleAutogradGraphError([StaleGraph(root="SumBackward0", parameters=1, holders=())])
    assert "legacy stream depend on a capturing blocking stream" in str(refusal)  # it quotes CUDA
    assert not stale_graphs.shows_stale_graph_symptoms(refusal)
    wrapped = RuntimeError("capture failed")
    wrapped.__cause__ = refusal
    assert not stale_graphs.shows_stale_graph_symptoms(wrapped)


def test_on_the_invalidated_capture_alone_only_graphs_with_a_python_holder_are_named(weights):
    """Any error inside a capture invalidates it, and the failed capture's leftovers have no Python
    holder; CUDA's own stale-graph error names them all."""

    def closure():
        kept = (weights[1] * 2).sum()
        return lambda: kept  # held by a closure cell: no holder to name

    keep = closure()
    invalidated = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    assert diagnose_failed_capture(weights, invalidated, collect=CountingCollect(real=False)) is None
    with pytest.raises(StaleAutogradGraphError, match="no Python referrer found"):
        diagnose_failed_capture(weights, _failed_capture(weights), collect=CountingCollect(real=False))
    assert keep().requires_grad


def test_tolerated_holders_do_not_explain_a_failure():
    weight = torch.nn.Parameter(torch.ones(3))
    dispatcher = MoEAlltoAllTokenDispatcher()
    dispatcher.probs = weight * 2
    error = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    assert diagnose_failed_capture([weight], error, collect=lambda: None) is None
    with pytest.raises(StaleAutogradGraphError):
        diagnose_failed_capture([weight], error, tolerate=False, collect=lambda: None)


# -- graphs Megatron itself keeps (seen harmless on H200) are tolerated, not refused ------------------


class MoEAlltoAllTokenDispatcher:  # the name is what matters: Megatron's dispatchers end in TokenDispatcher
    pass


class SomethingElse:
    pass


def test_graph_held_only_by_a_dispatchers_probs_is_tolerated():
    weight = torch.nn.Parameter(torch.ones(3))
    dispatcher = MoEAlltoAllTokenDispatcher()
    dispatcher.probs = weight * 2
    (graph,) = find_stale_graphs([weight])
    assert graph.tolerated and graph.holders == ("attribute 'probs' of MoEAlltoAllTokenDispatcher",)
    assert ensure_no_stale_graphs([weight], collect=lambda: None) == [graph]


def test_slot_shared_capture_tolerates_no_stale_graph():
    """Its backward capture takes every parameter's gradient, which a dispatcher's stale ``probs``
    broke on H200; graph banks clear that state before capture (capture.scratch)."""
    weight = torch.nn.Parameter(torch.ones(3))
    dispatcher = MoEAlltoAllTokenDispatcher()
    dispatcher.probs = weight * 2
    with pytest.raises(StaleAutogradGraphError, match="attribute 'probs' of MoEAlltoAllTokenDispatcher"):
        ensure_no_stale_graphs([weight], tolerate=False, collect=lambda: None)


@pytest.mark.parametrize("holder", ["other-class", "other-attribute", "also-a-local"])
def test_any_other_holder_is_refused(holder):
    weight = torch.nn.Parameter(torch.ones(3))
    owner = SomethingElse() if holder == "other-class" else MoEAlltoAllTokenDispatcher()
    setattr(owner, "routing_map" if holder == "other-attribute" else "probs", weight * 2)
    # A frame holding it too makes it a real stale graph.
    also_held_here = owner.probs if holder == "also-a-local" else None
    (graph,) = find_stale_graphs([weight])
    assert not graph.tolerated
    with pytest.raises(StaleAutogradGraphError):
        ensure_no_stale_graphs([weight], collect=lambda: None)
    assert also_held_here is None or also_held_here is owner.probs


def test_tensors_in_blocks_and_their_holders_are_named():
    class Dispatcher:
        pass

    dispatcher = Dispatcher()
    dispatcher.routing_map = torch.zeros(16, dtype=torch.bool)
    elsewhere = torch.zeros(4)
    block = {dispatcher.routing_map.untyped_storage().data_ptr(): 16}
    found = stale_graphs.tensors_in(block, objects=[dispatcher.routing_map, elsewhere])
    assert len(found) == 1 and found[0] is dispatcher.routing_map
    holders = stale_graphs.describe_holders(found[0])
    assert "attribute 'routing_map' of Dispatcher" in holders  # held by a local only: nothing above it
    assert "an element of a list of length 1" in holders  # `found` itself
    mask = dispatcher.routing_map
    assert any("local variable 'mask'" in h for h in stale_graphs.describe_holders(mask))
    assert stale_graphs.tensors_in({}, objects=[elsewhere]) == []


class _StoragelessTensor(torch.Tensor):
    """A wrapper subclass without storage, like the fake and functional tensors torch.compile leaves."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_tensors_without_storage_are_passed_over_not_fatal():
    # Seen on GPU: Megatron's gpt3_mcore_te_tp1_pp4_swiglu case died in the teardown measurement.
    held = torch.zeros(8)
    block = {held.untyped_storage().data_ptr(): 32}
    assert stale_graphs.tensors_in(block, objects=[_StoragelessTensor((4,)), held]) == [held]


def test_holders_are_named_through_slots_and_one_level_up():
    import dataclasses

    class Quantizer:
        def __init__(self):
            self.scale = torch.ones(())

    @dataclasses.dataclass(slots=True)
    class BackwardArgs:
        S_quantizer: object = None

    class Ctx:
        pass

    ctx = Ctx()
    ctx.backward_objects = BackwardArgs(Quantizer())
    scale = ctx.backward_objects.S_quantizer.scale
    # Through a slots dataclass (no __dict__), and naming the field the quantizer sits in.
    assert (
        "attribute 'scale' of Quantizer, which is attribute 'S_quantizer' of BackwardArgs"
        in stale_graphs.describe_holders(scale)
    )
