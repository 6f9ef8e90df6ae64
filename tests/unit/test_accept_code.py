"""Tests for megatron_cg_plugin.capture.accept_code: the quick accept compiled for a learned call
takes that call's like again, and takes no call the full check refuses, whatever the call's layout
(how many positional and keyword values, of which kinds, in which order)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from megatron_cg_plugin.capture import accept_code
from megatron_cg_plugin.capture.contracts import FIRST_MICROBATCH, ContractViolation, ReplayContract
from megatron_cg_plugin.config import ContractCheck

KINDS = ("tensor", "tensor with grad", "vector", "none", "int", "str")


def sample(kind: str):
    """A fresh value of ``kind``, equal in metadata (tensors) or value (controls) each time."""
    return {"tensor": lambda: torch.zeros(4, 2, 3),
            "tensor with grad": lambda: torch.zeros(4, 2, 3, requires_grad=True),
            "vector": lambda: torch.zeros(5, dtype=torch.float64), "none": lambda: None, "int": lambda: 3,
            "str": lambda: "causal"}[kind]()


class Call:
    """A graph's call of a drawn layout; the capture's sample tensors are kept as TE keeps its
    static buffers (alive as long as the graph)."""

    def __init__(self, positional: list[str], keywords: list[str], replay_only: bool) -> None:
        self.positional, self.keywords, self.replay_only = positional, keywords, replay_only
        self.captured = self.fresh(first=None)
        self.contract = ReplayContract.record("g", *self.captured, step_marks=None)

    def fresh(self, first=False):
        args = tuple(sample(kind) for kind in self.positional)
        kwargs = {f"k{index}": sample(kind) for index, kind in enumerate(self.keywords)}
        if self.replay_only and first is not None:
            kwargs[FIRST_MICROBATCH] = first
        return list(args), kwargs

    def static(self, place: tuple[str, int | str], value: torch.Tensor) -> torch.Tensor:
        """The static buffer captured at ``place``; ``value`` where a tensor was not captured there."""
        where, key = place
        captured = self.captured[0] if where == "args" else self.captured[1]
        found = (captured[key] if key < len(captured) else None) if where == "args" else captured.get(key)
        return found if isinstance(found, torch.Tensor) else value


def _places(call: Call, args: list, kwargs: dict) -> list[tuple[str, int | str]]:
    return [("args", index) for index in range(len(args))] + [("kwargs", key) for key in kwargs]


def _get(args, kwargs, place):
    return args[place[1]] if place[0] == "args" else kwargs[place[1]]


def _set(args, kwargs, place, value):
    if place[0] == "args":
        args[place[1]] = value
    else:
        kwargs[place[1]] = value


class Subclass(torch.Tensor):
    pass


def _changed_tensor(value: torch.Tensor, change: str, static: torch.Tensor):
    """``value`` with one thing changed; some changes are benign (the full check passes them)."""
    if change == "shape":
        return torch.zeros(*value.shape[:-1], value.shape[-1] + 1, dtype=value.dtype)
    if change == "dtype":
        return value.to(torch.float16)
    if change == "gradient":
        return value.detach().requires_grad_(not value.requires_grad)
    if change == "device":
        return torch.zeros(value.shape, dtype=value.dtype, device="meta")
    if change == "subclass":
        return value.detach().as_subclass(Subclass)
    if change == "in place":  # the static buffer itself: read where it is
        return static
    if change == "in place, relaid":  # at the static buffer's address, another layout
        return static.as_strided(static.shape, tuple(reversed(static.stride())))
    if change == "inside a static buffer" and static.numel() > 1:  # in a static buffer's memory, past its start
        return static.detach().as_strided(static.shape, (0,) * static.dim(), 1)
    return {"none": None, "int": 3, "inside a static buffer": static}[change]


TENSOR_CHANGES = ("shape", "dtype", "gradient", "device", "subclass", "in place", "in place, relaid",
                  "inside a static buffer", "none", "int")
CONTROL_CHANGES = ("other value", "same value", "bool for int", "tensor", "none")
CALL_CHANGES = ("keyword dropped", "keyword renamed", "keyword added", "keywords reordered", "positional added",
                "positional dropped", "first microbatch", "first microbatch None")


def _mutated(call: Call, data, args: list, kwargs: dict):
    places = _places(call, args, kwargs)
    change = data.draw(st.sampled_from(("value",) * 3 + CALL_CHANGES), label="change")
    if change == "value" and places:
        place = data.draw(st.sampled_from(places), label="place")
        value = _get(args, kwargs, place)
        if place == ("kwargs", FIRST_MICROBATCH):
            _set(args, kwargs, place, data.draw(st.sampled_from((True, False, None, 1))))
        elif isinstance(value, torch.Tensor):
            _set(args, kwargs, place, _changed_tensor(value, data.draw(st.sampled_from(TENSOR_CHANGES)),
                                                      call.static(place, value)))
        else:
            control = data.draw(st.sampled_from(CONTROL_CHANGES), label="control change")
            _set(args, kwargs, place, {"other value": "other" if isinstance(value, str) else 4,
                                       "same value": value, "bool for int": True, "tensor": torch.zeros(2),
                                       "none": None}[control])
    elif change == "keyword dropped" and kwargs:
        kwargs.pop(data.draw(st.sampled_from(sorted(kwargs))))
    elif change == "keyword renamed" and kwargs:
        key = data.draw(st.sampled_from(sorted(kwargs)))
        kwargs[key + "_renamed"] = kwargs.pop(key)
    elif change == "keyword added":
        kwargs["extra"] = data.draw(st.sampled_from((None, 1, "x"))) if data.draw(st.booleans()) else torch.zeros(1)
    elif change == "keywords reordered":
        kwargs = dict(reversed(list(kwargs.items())))
    elif change == "positional added":
        args.append(torch.zeros(4, 2, 3))
    elif change == "positional dropped" and args:
        args.pop()
    elif change.startswith("first microbatch"):
        kwargs[FIRST_MICROBATCH] = None if change.endswith("None") else True
    return args, kwargs


@given(positional=st.lists(st.sampled_from(KINDS), max_size=3),
       keywords=st.lists(st.sampled_from(KINDS), max_size=4), replay_only=st.booleans(),
       mode=st.sampled_from((ContractCheck.FULL, ContractCheck.SHAPES)), data=st.data())
@settings(max_examples=400, deadline=None)
def test_the_compiled_accept_takes_its_learned_call_and_nothing_the_full_check_refuses(
        positional, keywords, replay_only, mode, data):
    call = Call(positional, keywords, replay_only)
    full = mode == ContractCheck.FULL
    quick = call.contract.quick
    assert not quick.accepts(*call.fresh(), full)  # nothing learned yet
    call.contract.check(*call.fresh(), mode=mode)
    assert quick.accepts(*call.fresh(), full)  # its like, with fresh tensors
    args, kwargs = call.fresh()
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        args, kwargs = _mutated(call, data, args, kwargs)
    if quick.accepts(args, kwargs, full):
        call.contract._check_in_full(args, kwargs, full=full)  # must not raise


def test_a_call_learned_in_shapes_mode_vouches_for_no_full_check():
    call = Call(["tensor"], ["int"], replay_only=False)
    call.contract.check(*call.fresh(), mode=ContractCheck.SHAPES)
    assert call.contract.quick.accepts(*call.fresh(), False)
    assert not call.contract.quick.accepts(*call.fresh(), True)


def test_the_replay_check_refuses_through_the_compiled_accept_and_names_the_field():
    call = Call(["tensor"], ["tensor with grad", "int"], replay_only=True)
    check = call.contract.replay_check(ContractCheck.FULL)
    for _ in range(2):
        check(*call.fresh())
    args, kwargs = call.fresh()
    kwargs["k1"] = 4
    with pytest.raises(ContractViolation) as info:
        check(args, kwargs)
    assert info.value.field == "control"


def test_a_layout_is_compiled_once():
    layout = accept_code.AcceptLayout(1, 1, (0, 1), (0,), (1,), True, reads_storages=True, step_marked=False,
                                          storage_by_offset=(True,))
    assert accept_code._maker(layout) is accept_code._maker(layout)
    first, second = Call(["tensor"], ["int"], False), Call(["tensor"], ["int"], False)
    for call in (first, second):
        call.contract.check(*call.fresh(), mode=ContractCheck.FULL)
    assert first.contract.quick.accept.__code__ is second.contract.quick.accept.__code__
    assert first.contract.quick.accepts(*first.fresh(), True) and second.contract.quick.accepts(*second.fresh(), True)


def test_keywords_in_another_order_are_refused_even_where_each_value_fits_a_place():
    # The values are unpacked by place: b's value read where a's was learned would pass a's tests.
    static_a, static_b = torch.zeros(4, 2, 3), torch.zeros(4, 2, 3)
    contract = ReplayContract.record("g", (), {"a": static_a, "b": static_b}, step_marks=None)
    for _ in range(2):
        contract.check((), {"a": torch.zeros(4, 2, 3), "b": torch.zeros(4, 2, 3)}, mode=ContractCheck.FULL)
    swapped = {"b": static_a, "a": torch.zeros(4, 2, 3)}  # a's static buffer given as b
    assert not contract.quick.accepts((), swapped, True)
    with pytest.raises(ContractViolation) as info:
        contract.check((), swapped, mode=ContractCheck.FULL)
    assert info.value.field == "alias"


class OddKey(str):
    """A keyword whose ``repr`` is code that runs, were it pasted into the accept's source."""

    def __repr__(self) -> str:
        return f"__import__('builtins').__dict__.setdefault({RAN!r}, 'mask')"


RAN = "odd_key_repr_ran"


@pytest.mark.parametrize("key", [OddKey("mask"), "it's\n\"odd\"", "\\"], ids=["repr is code", "quotes", "backslash"])
def test_any_keyword_name_is_taken_as_a_value_not_as_source(key):
    import builtins

    static = torch.zeros(2)  # kept, as TE keeps its static buffers: a fresh tensor cannot land at its address
    contract = ReplayContract.record("g", (static,), {key: 3}, step_marks=None)
    for _ in range(2):
        contract.check((torch.zeros(2),), {key: 3}, mode=ContractCheck.FULL)
    # a name of a str subclass is left to the full check (its == may say anything): not learned
    assert contract.quick.accepts((torch.zeros(2),), {key: 3}, True) is (type(key) is str)
    assert not contract.quick.accepts((torch.zeros(2),), {key + "x": 3}, True)
    assert vars(builtins).pop(RAN, None) is None
