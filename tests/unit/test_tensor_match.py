"""The quick accept's tensor test: both implementations refuse every difference the contract checks."""

import gc
import sys
import weakref

import pytest
import torch

from megatron_cg_plugin.capture import tensor_match as tm


def example(*shape, dtype=torch.float32, requires_grad=True, device="cpu"):
    return torch.zeros(*(shape or (4, 2, 3)), dtype=dtype, requires_grad=requires_grad, device=device)


DIFFERING = {
    "shape": lambda: example(4, 2, 4),
    "rank": lambda: example(4, 6),
    "dtype": lambda: example(dtype=torch.float64),
    "requires_grad": lambda: example(requires_grad=False),
    "device": lambda: example(device="meta"),
    "type": lambda: torch.nn.Parameter(example()),
    "not a tensor": lambda: None,
}

IMPLEMENTATIONS = {"chosen": tm.tensor_match, "python": tm._python_match}


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("difference", sorted(DIFFERING))
def test_a_match_refuses_each_difference_in_any_place(implementation, difference):
    matches = IMPLEMENTATIONS[implementation]((example(), example(5, 1)))
    assert matches(example(), example(5, 1))
    assert not matches(DIFFERING[difference](), example(5, 1))
    assert not matches(example(), DIFFERING[difference]())


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_a_match_ignores_strides_and_holds_no_tensor(implementation):
    first = example()
    held = weakref.ref(first)
    matches = IMPLEMENTATIONS[implementation]((first,))
    del first
    gc.collect()
    assert held() is None  # a match never keeps a step's activations alive
    assert matches(example(2, 4, 3).transpose(0, 1))  # another layout: copied in, any is fine


def test_torch_guards_are_used_where_they_hold():
    if not tm._torch_guards_hold():
        pytest.skip(f"torch {torch.__version__}: its tensor guards fail the probe, the Python match is used")
    assert type(tm.tensor_match((example(),))) is not type(tm._python_match((example(),)))


def test_without_torch_guards_the_python_match_is_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch._C._dynamo.guards", None)  # the import fails
    tm._torch_guards_hold.cache_clear()
    try:
        assert not tm._torch_guards_hold()
        matches = tm.tensor_match((example(),))
        assert matches(example()) and not matches(example(requires_grad=False))
        assert matches.__qualname__.startswith("_python_match")
    finally:
        tm._torch_guards_hold.cache_clear()


def test_guards_that_ignore_a_difference_fail_the_probe(monkeypatch):
    class Careless:  # a torch whose guards stopped comparing requires_grad
        def __init__(self, *tensors, **_):
            self.shapes = [tuple(t.shape) for t in tensors]

        def check(self, *tensors):
            return all(isinstance(t, torch.Tensor) and tuple(t.shape) == s for t, s in zip(tensors, self.shapes))

    import torch._C._dynamo.guards as guards

    monkeypatch.setattr(guards, "TensorGuards", Careless)
    tm._torch_guards_hold.cache_clear()
    try:
        assert not tm._torch_guards_hold()
        assert not tm.tensor_match((example(),))(example(requires_grad=False))
    finally:
        tm._torch_guards_hold.cache_clear()
