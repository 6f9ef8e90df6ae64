"""Per-forward scratch attributes: put back after each call, resolved from Megatron's dotted names."""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from megatron_cg_plugin.capture.scratch import ScratchAttribute, clear, clearing, moe_dispatcher_scratch, resolve


class Dispatcher:
    def __init__(self) -> None:
        self.probs = torch.zeros(2)
        self.shared_experts = types.SimpleNamespace(cached_fc1_input=None)
        self.cudagraph_attrs = ["probs", "routing_map", "shared_experts.cached_fc1_input"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # what Megatron's dispatcher does per call
        self.probs = x.softmax(0)
        self.routing_map = x > 0
        self.shared_experts.cached_fc1_input = x * 2
        return x + self.probs


def moe_layer(dispatcher=None):
    return types.SimpleNamespace(
        is_moe_layer=True, mlp=types.SimpleNamespace(token_dispatcher=dispatcher or Dispatcher())
    )


def test_a_call_leaves_the_declared_attributes_empty():
    dispatcher = Dispatcher()
    call = clearing(dispatcher.forward, moe_dispatcher_scratch(moe_layer(dispatcher)))
    x = torch.tensor([1.0, -1.0])
    assert torch.equal(call(x), x + x.softmax(0))  # the call's result is untouched
    assert dispatcher.probs is None and dispatcher.routing_map is None
    assert dispatcher.shared_experts.cached_fc1_input is None
    assert dispatcher.cudagraph_attrs  # undeclared attributes are left alone


def test_attributes_are_cleared_when_the_call_raises():
    owner = types.SimpleNamespace(state=1)

    def fail():
        owner.state = 2
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        clearing(fail, (ScratchAttribute(owner, "state"),))()
    assert owner.state is None


def test_clearing_drops_an_eager_steps_autograd_graph():
    """What capture needs before it starts: the state of the last eager step no longer keeps its
    autograd graph (and the AccumulateGrad nodes of the weights) alive."""
    import weakref

    weight = torch.nn.Parameter(torch.ones(2))
    dispatcher = Dispatcher()
    dispatcher.forward(weight * 3)
    held = [weakref.ref(dispatcher.probs), weakref.ref(dispatcher.shared_experts.cached_fc1_input)]
    assert all(ref().grad_fn is not None for ref in held)  # each keeps the step's graph alive
    clear(moe_dispatcher_scratch(moe_layer(dispatcher)))
    assert all(ref() is None for ref in held)


def test_without_attributes_the_callable_is_itself():
    assert clearing(abs, ()) is abs


def test_dotted_names_resolve_to_their_owner():
    dispatcher = Dispatcher()
    attribute = resolve(dispatcher, "shared_experts.cached_fc1_input")
    assert attribute.owner is dispatcher.shared_experts and attribute.name == "cached_fc1_input"
    assert str(resolve(dispatcher, "probs")) == "Dispatcher.probs"


def test_dense_layers_have_no_dispatcher_state():
    assert moe_dispatcher_scratch(types.SimpleNamespace(is_moe_layer=False)) == ()
    assert moe_dispatcher_scratch(object()) == ()


def test_a_dispatcher_without_its_declared_state_is_refused_with_the_scope_to_use():
    dispatcher = types.SimpleNamespace()
    with pytest.raises(RuntimeError, match="--cuda-graph-modules attn"):
        moe_dispatcher_scratch(moe_layer(dispatcher))


def test_megatrons_alltoall_dispatcher_declares_what_its_forward_sets():
    """megatron-core 0.19.2's alltoall dispatcher, built on CPU: the state the farm's MoE capture left
    in the pool (routing probabilities, routing map, permutation map) is declared per forward."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    config = types.SimpleNamespace(
        num_moe_experts=4,
        moe_permute_fusion=False,
        moe_pad_expert_input_to_capacity=True,
        moe_expert_capacity_factor=1.5,
        cuda_graph_impl="transformer_engine",
        cuda_graph_modules=[CudaGraphModule.attn, CudaGraphModule.moe],
    )
    groups = types.SimpleNamespace(ep=None, expt_tp=None, tp_ep=None)
    with mock.patch.object(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object()):  # no CUDA stream on CPU
        dispatcher = MoEAlltoAllTokenDispatcher(4, [0, 1, 2, 3], config, groups)
    names = {str(attribute) for attribute in moe_dispatcher_scratch(moe_layer(dispatcher))}
    assert {
        f"MoEAlltoAllTokenDispatcher.{name}"
        for name in ("probs", "routing_map", "reversed_local_input_permutation_mapping")
    } <= names
