"""Tests for megatron_cg_plugin.capture.contracts: what a graph was captured for, checked before
every replay (on CPU tensors)."""

from __future__ import annotations

import gc
import types
import warnings
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from megatron_cg_plugin.capture import contracts
from megatron_cg_plugin.capture.contracts import (
    REPLAY_ONLY_KWARGS,
    ContractViolation,
    ReplayContract,
    TensorSpec,
    process_groups_of,
)
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.capture.step_marks import StepMarks

FULL, SHAPES = ContractCheck.FULL, ContractCheck.SHAPES

GRAPH = "layer 7 microbatch 1"


def x(*shape, dtype=torch.float32, requires_grad=False):
    return torch.zeros(*(shape or (4, 2, 3)), dtype=dtype, requires_grad=requires_grad)


# A contract records where its static buffers live; TE keeps them alive as long as the graph. Here
# the tests keep them, so a later tensor cannot land at a freed buffer's address (a false "alias").
STATIC_BUFFERS: list = []


def record(args=None, kwargs=None, params=(), module=None):
    args = (x(),) if args is None else args
    STATIC_BUFFERS.append((args, kwargs))
    return ReplayContract.record(GRAPH, args, kwargs or {}, params=params, module=module)


def violation(contract, args, kwargs=None, mode=FULL) -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        contract.check(args, kwargs or {}, mode=mode)
    return info.value


def process_group():
    import torch.distributed as dist

    return dist.ProcessGroup(dist.HashStore(), 0, 1)


class Layer(torch.nn.Module):
    """A Megatron-shaped layer: parameters in submodules, process groups in ``pg_collection``."""

    def __init__(self, **groups) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.pg_collection = types.SimpleNamespace(**groups)


def assert_message(error: ContractViolation, field: str, captured, actual, where: str = "") -> None:
    message = str(error)
    assert (error.graph, error.field, error.captured, error.actual) == (GRAPH, field, captured, actual)
    assert message.startswith(f"CUDA graph replay refused for {GRAPH}: {field}")
    assert repr(captured) in message and repr(actual) in message
    assert contracts._HINTS[field] in message
    if where:
        assert f"({where})" in message
    assert "--cg-contract-check off" in message


# ====================================================================== record


def test_record_specs_and_flattening():
    a, mask = x(requires_grad=True), x(2, 1, 4, 4, dtype=torch.bool)
    contract = ReplayContract.record(GRAPH, (a, 3), {"mask": mask, "z": None, "is_first_microbatch": True,
                                                     "flag": "causal"})
    assert [name for name, _ in contract.inputs] == ["arg0", "arg1", "flag=", "mask="]
    assert contract.inputs[0][1].spec == TensorSpec((4, 2, 3), torch.float32, (6, 3, 1), torch.device("cpu"), True)
    assert contract.inputs[0][1].data_ptr == a.data_ptr()
    assert contract.inputs[1] == ("arg1", 3)
    assert contract.inputs[2] == ("flag=", "causal")
    assert contract.parameters == () and contract.process_groups == ()


def test_nested_arguments_are_flattened_and_named_by_place():
    contract = record((x(), [x(2), 5]), {"extra": {"k": x(3)}})
    assert [name for name, _ in contract.inputs] == ["arg0", "arg1[0]", "arg1[1]", "extra=['k']"]


def test_a_tensor_in_a_list_is_checked_like_any_other():
    contract = record((x(), [x(2)]))
    contract.check((x(), [x(2)]), {}, mode=FULL)
    assert_message(violation(contract, (x(), [x(2, dtype=torch.float16)]), mode=SHAPES), "dtype",
                   torch.float32, torch.float16, "arg1[0]")
    assert_message(violation(contract, (x(), [x(3)])), "shape", (2,), (3,), "arg1[0]")


def test_a_list_of_another_length_is_refused_not_truncated():
    contract = record((x(), [x(2), x(2)]))
    error = violation(contract, (x(), [x(2)]))
    assert error.field == "arguments"
    assert error.captured == ["arg0", "arg1[0]", "arg1[1]"] and error.actual == ["arg0", "arg1[0]"]


def test_a_control_value_holding_tensors_is_compared_without_raising():
    class Params:  # like PackedSeqParams: == on it compares tensors
        def __init__(self, t):
            self.t = t

        def __eq__(self, other):
            return bool(self.t == other.t)

    captured = Params(torch.arange(3))
    contract = record((x(), captured))
    contract.check((x(), captured), {}, mode=FULL)  # the same object
    assert violation(contract, (x(), Params(torch.arange(4)))).field == "control"


def test_matching_replay_passes_in_every_mode():
    p = torch.nn.Parameter(torch.ones(3))
    layer = Layer(tp=process_group())  # held, as the model holds its layers (the contract does not)
    contract = record((x(requires_grad=True), 2), {"mask": x(1, 1)}, [("w", p)], layer)
    for mode in ContractCheck:
        contract.check((x(requires_grad=True), 2), {"mask": x(1, 1)}, mode=mode)


# ====================================================================== per field


def test_shape():
    error = violation(record(), (x(8, 2, 3),))
    assert_message(error, "shape", (4, 2, 3), (8, 2, 3), "arg0")


def test_shape_in_kwargs_names_the_kwarg():
    error = violation(record(kwargs={"mask": x(1, 4)}), (x(),), {"mask": x(1, 5)}, mode=SHAPES)
    assert_message(error, "shape", (1, 4), (1, 5), "mask=")


def test_dtype():
    error = violation(record(), (x(dtype=torch.float16),), mode=SHAPES)
    assert_message(error, "dtype", torch.float32, torch.float16, "arg0")


def test_a_copied_input_may_have_any_layout():
    # TE copies an input that is not its static buffer into it: copy_ honours any layout.
    contract = record()
    contract.check((x(2, 4, 3).transpose(0, 1),), {}, mode=FULL)


def test_stride_of_an_input_read_in_place():
    static = x()
    contract = record((static,))
    contract.check((static,), {}, mode=FULL)
    same_place = static.as_strided((4, 2, 3), (1, 4, 8))  # the static buffer's address, another layout
    contract.check((same_place,), {}, mode=SHAPES)
    assert_message(violation(contract, (same_place,)), "stride", (6, 3, 1), (1, 4, 8), "arg0")


def test_size_one_dimensions_strides_are_ignored():
    # Megatron at --micro-batch-size 1: hidden states [s, 1, h] whose batch stride means nothing
    # (the refusal a 24-layer GPT hit at its first replay: (2048, 2048, 1) vs (2048, 4194304, 1)).
    static = torch.zeros(4, 1, 3)
    contract = record((static,))
    assert static.stride() == (3, 3, 1)
    in_place = static.as_strided((4, 1, 3), (3, 12, 1))
    contract.check((in_place,), {}, mode=FULL)


def test_a_copied_input_inside_a_static_buffer_is_refused():
    first, second = x(4, 3), x(4, 3)
    contract = record((first, second))
    assert_message(violation(contract, (second, first)), "alias", "separate memory", "a static buffer's memory",
                   "arg0")
    contract.check((first, second), {}, mode=FULL)  # each in its own buffer: read in place
    contract.check((x(4, 3), x(4, 3)), {}, mode=FULL)
    shared = x(4, 3)
    contract.check((shared, shared), {}, mode=FULL)  # both copied from one tensor: harmless
    contract.check((second.clone(), first.clone()), {}, mode=SHAPES)


def test_device_with_meta_tensors():
    contract = record()
    meta = torch.zeros(4, 2, 3, device="meta")
    contract.check((meta,), {}, mode=SHAPES)
    assert_message(violation(contract, (meta,)), "device", torch.device("cpu"), torch.device("meta"), "arg0")


def test_requires_grad():
    contract = record((x(),))
    contract.check((x(requires_grad=True),), {}, mode=SHAPES)
    assert_message(violation(contract, (x(requires_grad=True),)), "requires_grad", False, True, "arg0")
    # A gradient the capture computes but the replay does not need is dropped by autograd: fine.
    record((x(requires_grad=True),)).check((x(),), {}, mode=FULL)


def test_kind_tensor_versus_non_tensor():
    contract = record((x(), 1))
    assert_message(violation(contract, (x(), x())), "kind", "int", "Tensor", "arg1")
    assert_message(violation(contract, (5, 1), mode=SHAPES), "kind", "TensorSpec", "int", "arg0")


def test_off_checks_nothing_and_a_mode_other_than_shapes_checks_everything():
    """The mode comes parsed from the config (``ContractCheck``); a value that is none of its modes
    is held to the full contract rather than to less (fail closed)."""
    contract = record((x(), 2))
    contract.check((x(2), 3), {}, mode=ContractCheck.OFF)
    assert violation(contract, (x(), 3), mode="strict").field == "control"  # SHAPES would let it through


def test_control_values():
    contract = record((x(), 2), {"mode": "causal"})
    contract.check((x(), 3), {"mode": "padding"}, mode=SHAPES)  # not checked in shapes
    assert_message(violation(contract, (x(), 3), {"mode": "causal"}), "control", 2, 3, "arg1")
    assert_message(violation(contract, (x(), 2), {"mode": "padding"}), "control", "causal", "padding", "mode=")


@pytest.mark.parametrize("args, kwargs, actual", [
    ((), {"mask": "m"}, ["mask="]),  # a positional argument missing
    (("t", "t2"), {"mask": "m"}, ["arg0", "arg1", "mask="]),  # one too many
    (("t",), {}, ["arg0"]),  # a tensor kwarg missing
    (("t",), {"mask": "m", "extra": "e"}, ["arg0", "extra=", "mask="]),  # an unexpected kwarg
])
def test_arguments(args, kwargs, actual):
    tensors = {"t": x(), "t2": x(), "m": x(1), "e": x(1)}
    contract = record((x(),), {"mask": x(1)})
    args = tuple(tensors[a] for a in args)
    kwargs = {k: tensors[v] for k, v in kwargs.items()}
    for mode in ("full", "shapes"):
        assert_message(violation(contract, args, kwargs, mode=mode), "arguments", ["arg0", "mask="], actual)


def test_parameter_storage():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    contract = record(params=[("w", p), ("b", q)])
    contract.check((x(),), {}, mode=FULL)
    p.data.copy_(torch.full((3,), 2.0))  # in place: same storage, fine
    contract.check((x(),), {}, mode=FULL)
    old = hex(q.data_ptr())
    q.data = torch.zeros(2)  # a checkpoint loaded into new tensors
    error = violation(contract, (x(),))
    assert_message(error, "parameter storage", old, hex(q.data_ptr()), "b")
    contract.check((x(),), {}, mode=SHAPES)


def test_a_layers_parameters_are_found_again_where_they_live():
    layer = Layer()
    contract = record(module=layer)
    assert [held.name for held in contract.parameters] == ["linear.weight", "linear.bias", "norm.weight", "norm.bias"]
    contract.check((x(),), {}, mode=FULL)
    old = hex(layer.norm.bias.data_ptr())
    layer.norm.bias = torch.nn.Parameter(torch.zeros(3))  # replaced by a new parameter object
    assert_message(violation(contract, (x(),)), "parameter storage", old, hex(layer.norm.bias.data_ptr()), "norm.bias")
    layer.norm.bias = None
    assert_message(violation(contract, (x(),)), "parameter storage", old, "gone", "norm.bias")


def test_held_state_is_checked_on_every_replay_whichever_microbatch_it_is():
    # Megatron-FSDP frees and regathers parameters around each forward: a later microbatch may find them
    # moved. The default (held_every_replay) is what every model but one wrapped in Megatron's DDP gets.
    layer = Layer(tp=process_group())
    contract = record(module=layer)
    groups_only = ReplayContract.of_inputs(GRAPH, contract.inputs, (), contract.process_groups)
    old = hex(layer.norm.bias.data_ptr())
    layer.norm.bias = torch.nn.Parameter(torch.zeros(3))
    layer.pg_collection.tp = process_group()
    for kwargs in ({"is_first_microbatch": True}, {"is_first_microbatch": False}, {}):
        assert_message(violation(contract, (x(),), kwargs), "parameter storage", old,
                       hex(layer.norm.bias.data_ptr()), "norm.bias")
        assert violation(groups_only, (x(),), kwargs).field == "process group"


def test_a_layers_process_groups_are_read_from_its_collection_once_per_check():
    reads = []

    class Collection:
        def __init__(self, **groups):
            vars(self).update(groups)

        def __getattribute__(self, name):
            if name == "__dict__":
                reads.append(name)
            return object.__getattribute__(self, name)

    tp, dp = process_group(), process_group()
    layer = Layer()
    layer.pg_collection = Collection(tp=tp, dp=dp)
    contract = record(module=layer)
    reads.clear()
    contract.check((x(),), {}, mode=FULL)  # the full check, then the quick one learns the collection
    assert reads == ["__dict__", "__dict__"] and len(contract.process_groups) == 2
    reads.clear()
    contract.check((x(),), {}, mode=FULL)  # the quick one accepts
    assert reads == ["__dict__"]
    layer.pg_collection.dp = process_group()
    assert violation(contract, (x(),)).field == "process group"


def test_process_groups_by_identity():
    tp, dp = process_group(), process_group()
    layer = Layer(dp=dp, tp=tp, sizes=[1, 2])
    contract = record(module=layer)
    assert [held.name for held in contract.process_groups] == ["dp", "tp"]
    contract.check((x(),), {}, mode=FULL)
    layer.pg_collection.tp = lookalike = process_group()  # a re-created communicator
    error = violation(contract, (x(),))
    assert_message(error, "process group", contracts.group_label(tp), contracts.group_label(lookalike), "tp")
    assert f"{id(tp):#x}" in str(error) and f"{id(lookalike):#x}" in str(error)
    contract.check((x(),), {}, mode=SHAPES)
    layer.pg_collection = types.SimpleNamespace(dp=dp, tp=tp)  # a new collection of the same groups: fine
    contract.check((x(),), {}, mode=FULL)


# ====================================================================== modes and ignored kwargs


def test_off_checks_nothing():
    p = torch.nn.Parameter(torch.ones(1))
    contract = record((x(requires_grad=True), 1), {"mask": x(1)}, [("w", p)])
    p.data = torch.zeros(1)
    contract.check((), {"other": 5}, mode="off")
    contract.check(("not a tensor",), {}, mode="off")


def test_shapes_checks_only_shape_dtype_kind_and_arguments():
    base = torch.zeros(8, 3)
    p = torch.nn.Parameter(torch.ones(1))
    layer = Layer(tp=process_group())
    contract = record((base[:4], base[4:], 1), params=[("w", p)], module=layer)
    p.data = torch.zeros(1)
    layer.pg_collection.tp = process_group()
    contract.check((base[4:], base[:4].requires_grad_(), 2), {}, mode=SHAPES)
    assert violation(contract, (x(4, 3), x(4, 4), 1), mode=SHAPES).field == "shape"


@pytest.mark.parametrize("name", sorted(REPLAY_ONLY_KWARGS))
def test_replay_only_kwargs_are_ignored(name):
    contract = record()
    contract.check((x(),), {name: object()}, mode=FULL)
    at_capture = record((x(),), {name: True})
    at_capture.check((x(),), {}, mode=FULL)
    assert REPLAY_ONLY_KWARGS == {"is_first_microbatch", "cuda_graph_stream", "cuda_graph_event"}


def test_none_kwargs_are_ignored():
    contract = record(kwargs={"rotary_pos_emb": None, "mask": x(1)})
    contract.check((x(),), {"mask": x(1)}, mode=FULL)
    contract.check((x(),), {"mask": x(1), "rotary_pos_emb": None, "packed_seq_params": None}, mode=FULL)


def test_hint_for_every_field_exists():
    for field in ("shape", "dtype", "stride", "device", "requires_grad", "kind", "alias", "control",
                  "arguments", "parameter storage", "process group"):
        assert contracts._HINTS[field]
        assert contracts._HINTS[field] in str(ContractViolation("g", field, 1, 2))


# ====================================================================== process_groups_of


def test_process_groups_of_without_collection():
    assert process_groups_of(types.SimpleNamespace()) == ()
    assert process_groups_of(types.SimpleNamespace(pg_collection=None)) == ()


def test_process_groups_of_keeps_only_groups_sorted_by_name():
    import torch.distributed as dist

    tp = dist.ProcessGroup(dist.HashStore(), 0, 1)
    ep = dist.ProcessGroup(dist.HashStore(), 0, 1)
    collection = types.SimpleNamespace(tp=tp, ep=ep, pp=None, sizes=[1, 2])
    assert process_groups_of(types.SimpleNamespace(pg_collection=collection)) == (("ep", ep), ("tp", tp))


def test_a_freed_static_buffer_neither_reads_in_place_nor_aliases():
    # TE keeps its static buffers alive; once one is gone, a tensor landing at its address is
    # copied in like any other, so neither its layout nor its memory is held against it.

    from megatron_cg_plugin.capture.contracts import StaticInput

    here = x()  # stands for a new tensor at the address where the static buffer was
    relaid = here.as_strided((4, 2, 3), (1, 4, 8))
    second = x()
    gone = x()
    dead = weakref.ref(gone)
    del gone

    def contract_with(buffer):
        static = StaticInput(TensorSpec.of(here), here.data_ptr(), here.untyped_storage().data_ptr(), buffer)
        return ReplayContract.of_inputs(GRAPH, (("arg0", static), ("arg1", StaticInput.of(second))))

    alive = contract_with(weakref.ref(here))
    assert violation(alive, (relaid, second)).field == "stride"  # read in place, another layout
    assert violation(alive, (x(), here[:, :1].expand(4, 2, 3))).field == "alias"  # inside arg0's buffer
    freed = contract_with(dead)
    assert not freed.inputs[0][1].alive
    freed.check((relaid, second), {}, mode=FULL)  # copied: any layout
    freed.check((x(), here[:, :1].expand(4, 2, 3)), {}, mode=FULL)  # that memory is no buffer now


def test_two_static_inputs_in_one_storage_guard_it_while_either_is_alive():

    from megatron_cg_plugin.capture.contracts import StaticInput

    storage = torch.zeros(2, 4, 2, 3)
    first, second = storage[0], storage[1]  # TE's static buffers may be views of one allocation
    gone = x()
    dead = weakref.ref(gone)
    del gone
    live_first = StaticInput.of(first)
    dead_second = StaticInput(TensorSpec.of(second), second.data_ptr(), storage.untyped_storage().data_ptr(), dead)
    contract = ReplayContract.of_inputs(GRAPH, (("arg0", live_first), ("arg1", dead_second)))
    assert contract.static_storages() == {storage.untyped_storage().data_ptr()}
    inside = storage.view(-1)[1:25].view(4, 2, 3)  # neither buffer's address, but their memory
    assert violation(contract, (x(), inside)).field == "alias"


# ====================================================================== the quick accept
#
# After a call the full check passed, the contract's quick accept takes calls of the same shape. It
# must accept only what the full check passes: each case below is refused by the full check, so the
# quick accept has to turn it down too (each is what one of its comparisons is there for), and the
# property test combines them.


class MegatronCall:
    """A layer replayed as Megatron does: hidden states positional, keywords that are tensors or None,
    ``is_first_microbatch`` added at replay; one control value, a parameter owner and a group."""

    def __init__(self) -> None:
        self.layer = Layer(tp=process_group(), dp=process_group())
        self.hidden, self.rope = x(requires_grad=True), x(4, 1, 1, 2)
        STATIC_BUFFERS.append((self.hidden, self.rope))
        self.contract = ReplayContract.record(GRAPH, (self.hidden,), self.kwargs(self.rope), module=self.layer)

    @staticmethod
    def kwargs(rope, **changes):
        return {"attention_mask": None, "rotary_pos_emb": rope, "window": 4, "packed_seq_params": None,
                "is_first_microbatch": False, **changes}

    def fresh(self, **changes):
        return (x(requires_grad=True),), self.kwargs(x(4, 1, 1, 2), **changes)


def _relaid_in_place(call):  # the static buffer itself, another layout: read in place, so refused
    return (call.hidden.detach().as_strided((4, 2, 3), (1, 4, 8)).requires_grad_(),), call.kwargs(x(4, 1, 1, 2))


def _inside_a_static_buffer(call):  # a copied input starting inside rope's buffer
    return (x(requires_grad=True),), call.kwargs(call.rope.as_strided((4, 1, 1, 2), (0, 0, 0, 1), 1))


def _inside_one_read_in_place(call):  # hidden read in place, rope copied from inside hidden's buffer
    return (call.hidden,), call.kwargs(call.hidden.detach().as_strided((4, 1, 1, 2), (0, 0, 0, 1), 1))


class EqualsAnything(str):
    """A name whose ``==`` says yes to anything (hashed as its text, so a dict finds only its text)."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = str.__hash__


def _group_under_a_name_equal_to_anything(call):
    held = vars(call.layer.pg_collection)
    renamed = {(EqualsAnything("tq") if name == "tp" else name): value for name, value in held.items()}
    held.clear()
    held.update(renamed)
    return call.fresh()


def _new_parameter(call):
    call.layer.norm.bias = torch.nn.Parameter(torch.zeros(3))
    return call.fresh()


def _moved_parameter(call):
    call.layer.linear.weight.data = torch.zeros(3, 2)
    return call.fresh()


def _swapped_group(call):
    call.layer.pg_collection.dp = process_group()
    return call.fresh()


def _exchanged_groups(call):  # the same objects, each under the other's name (whatever the names are now)
    held = vars(call.layer.pg_collection)
    first, second = list(held)[:2]
    held[first], held[second] = held[second], held[first]
    return call.fresh()


def _renamed_group(call):  # the same objects in the same order, one under another name
    held = vars(call.layer.pg_collection)
    renamed = {("tq" if name == "tp" else name): value for name, value in held.items()}
    held.clear()
    held.update(renamed)
    return call.fresh()


def _renamed_keyword(call):  # the same values in the same places, one under another name
    args, kwargs = call.fresh()
    return args, {("rotary_emb" if key == "rotary_pos_emb" else key): value for key, value in kwargs.items()}


REFUSED = {
    "shape": lambda call: ((x(8, 2, 3, requires_grad=True),), call.kwargs(x(4, 1, 1, 2))),
    "dtype": lambda call: ((x(dtype=torch.float64, requires_grad=True),), call.kwargs(x(4, 1, 1, 2))),
    "requires_grad": lambda call: call.fresh(rotary_pos_emb=x(4, 1, 1, 2, requires_grad=True)),
    "device": lambda call: ((torch.zeros(4, 2, 3, device="meta", requires_grad=True),), call.kwargs(x(4, 1, 1, 2))),
    "arguments (a keyword added)": lambda call: call.fresh(attention_mask=x(1, 1)),
    "arguments (a keyword None)": lambda call: call.fresh(rotary_pos_emb=None),
    "arguments (a keyword gone)": lambda call: (call.fresh()[0], {k: v for k, v in call.fresh()[1].items()
                                                                  if k != "rotary_pos_emb"}),
    "arguments (a keyword renamed)": _renamed_keyword,
    "arguments (a positional added)": lambda call: ((x(requires_grad=True), x()), call.kwargs(x(4, 1, 1, 2))),
    "arguments (a list)": lambda call: (([x(requires_grad=True)],), call.kwargs(x(4, 1, 1, 2))),
    "kind": lambda call: call.fresh(window=x()),
    "control": lambda call: call.fresh(window=5),
    "stride": _relaid_in_place,
    "alias": _inside_a_static_buffer,
    "alias (beside an input read in place)": _inside_one_read_in_place,
    "parameter storage (a new parameter)": _new_parameter,
    "parameter storage (moved)": _moved_parameter,
    "process group (swapped)": _swapped_group,
    "process group (renamed)": _renamed_group,
    "process group (exchanged)": _exchanged_groups,
    "process group (under a name equal to anything)": _group_under_a_name_equal_to_anything,
    "arguments (a keyword equal to anything)": lambda call: (call.fresh()[0], {
        (EqualsAnything("rotary_emb") if key == "rotary_pos_emb" else key): value
        for key, value in call.fresh()[1].items()}),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_quick_accept_turns_down_what_the_full_check_refuses(case):
    call = MegatronCall()
    contract = call.contract
    for _ in range(2):  # learns from the first, accepts the second
        contract.check(*call.fresh(), mode=FULL)
    assert contract.quick.accepts(*call.fresh(), full=True)
    args, kwargs = REFUSED[case](call)
    assert not contract.quick.accepts(args, kwargs, full=True)
    assert violation(contract, args, kwargs).field == case.split(" (")[0]


def test_the_quick_accept_takes_a_replay_like_the_learned_one_and_leaves_the_rest_to_the_full_check():
    call = MegatronCall()
    contract = call.contract
    assert not contract.quick.accepts(*call.fresh(), full=True)  # nothing learned yet
    contract.check(*call.fresh(), mode=FULL)
    assert contract.quick.accepts(*call.fresh(), full=True)
    assert contract.quick.accepts(*call.fresh(is_first_microbatch=True), full=True)
    args, kwargs = call.fresh()
    in_place = ((call.hidden,), kwargs)  # the static buffer itself, as captured
    assert contract.quick.accepts(*in_place, full=True)
    no_gradient = ((x(),), kwargs)  # fine (the capture computed one): the full check passes it, and
    assert not contract.quick.accepts(*no_gradient, full=True)
    contract.check(*no_gradient, mode=FULL)
    assert contract.quick.accepts((x(),), call.fresh()[1], full=True)  # the quick accept learns it


def test_the_quick_accept_in_shapes_mode_compares_shape_and_dtype_only():
    call = MegatronCall()
    contract = call.contract
    contract.check(*call.fresh(), mode=SHAPES)
    _swapped_group(call)
    assert contract.quick.accepts(*call.fresh(window=5), full=False)  # neither is checked in shapes
    assert not contract.quick.accepts(*REFUSED["shape"](call), full=False)
    assert not contract.quick.accepts(*REFUSED["dtype"](call), full=False)


def test_a_freed_static_buffers_address_is_left_to_the_full_check():
    call = MegatronCall()
    contract = call.contract
    contract.check(*call.fresh(), mode=FULL)
    static = contract.quick.state.statics[0]
    dead = contracts.StaticInput(static.spec, static.data_ptr, static.storage_ptr, lambda: None)
    contract.quick.state.statics = (dead, *contract.quick.state.statics[1:])
    assert not contract.quick.accepts((call.hidden,), call.fresh()[1], full=True)


BENIGN = {
    "first microbatch": lambda call, args, kwargs: (args, {**kwargs, "is_first_microbatch": True}),
    "no gradient": lambda call, args, kwargs: (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                                               kwargs),
    "in place": lambda call, args, kwargs: ((call.hidden,), kwargs),
    "another None keyword": lambda call, args, kwargs: (args, {**kwargs, "inference_context": None}),
}


@given(refused=st.lists(st.sampled_from(sorted(REFUSED)), max_size=2),
       benign=st.lists(st.sampled_from(sorted(BENIGN)), max_size=3))
@settings(max_examples=150, deadline=None)
def test_the_quick_accept_never_takes_a_call_the_full_check_refuses(refused, benign):
    call = MegatronCall()
    contract = call.contract
    contract.check(*call.fresh(), mode=FULL)
    args, kwargs = call.fresh()
    for case in refused:
        args, kwargs = REFUSED[case](call)
    for case in benign:
        args, kwargs = BENIGN[case](call, args, kwargs)
    if contract.quick.accepts(args, kwargs, full=True):
        contract._check_in_full(args, kwargs, full=True)  # must not raise


def test_the_quick_accept_reads_held_parameters_given_by_name_too():
    # Slot-shared capture holds its parameters as given, not through an owner's _parameters.
    p = torch.nn.Parameter(torch.ones(3))
    contract = record((x(),), params=[("w", p)])
    for _ in range(2):
        contract.check((x(),), {}, mode=FULL)
    assert contract.quick.accepts((x(),), {}, full=True)
    p.data = torch.ones(3)
    assert not contract.quick.accepts((x(),), {}, full=True)
    assert violation(contract, (x(),)).field == "parameter storage"


def test_a_freed_static_buffers_memory_stops_sending_replays_to_the_full_check():

    from megatron_cg_plugin.capture.contracts import StaticInput

    storage = torch.zeros(2, 4, 2, 3)
    gone = x()
    dead = weakref.ref(gone)
    del gone
    freed = StaticInput(TensorSpec.of(storage[0]), storage[0].data_ptr(), storage.untyped_storage().data_ptr(), dead)
    contract = ReplayContract.of_inputs(GRAPH, (("arg0", freed),))
    landed = storage[1]  # a new input where the freed buffer's memory was
    for _ in range(2):
        contract.check((landed,), {}, mode=FULL)  # the full check holds nothing against it
    assert contract.quick.accepts((landed,), {}, full=True)


def test_the_quick_accept_compares_control_values_as_the_full_check_does():
    class AtMost:  # an __eq__ that is not symmetric: the captured value's decides, as in the full check
        def __init__(self, limit):
            self.limit = limit

        def __eq__(self, other):
            return self.limit <= other.limit

    contract = record((x(), AtMost(2)))
    for _ in range(2):
        contract.check((x(), AtMost(2)), {}, mode=FULL)
    assert not contract.quick.accepts((x(), AtMost(1)), {}, full=True)
    assert violation(contract, (x(), AtMost(1))).field == "control"


def test_an_input_in_a_larger_storage_at_a_static_buffers_address_is_left_to_the_full_check():
    # Two storages over one allocation (torch.frombuffer, or a CUDA block resized in place): the
    # input starts past the static buffer's bytes, but in a storage at the same address, which the
    # full check refuses as an alias. A test by address range alone would accept it.
    memory = bytearray(2 * 24 * 4)
    static = torch.frombuffer(memory, dtype=torch.float32, count=24).view(4, 2, 3)
    beyond = torch.frombuffer(memory, dtype=torch.float32, count=48)[24:].view(4, 2, 3)
    contract = record((static,))
    for _ in range(2):
        contract.check((x(),), {}, mode=FULL)
    assert contract.quick.accepts((x(),), {}, full=True)
    assert not contract.quick.accepts((beyond,), {}, full=True)
    assert violation(contract, (beyond,)).field == "alias"


@pytest.mark.parametrize("kind", [torch.Tensor, torch.nn.Parameter])
def test_an_input_at_an_offset_inside_a_static_buffer_is_refused(kind):
    # A plain tensor's storage address is computed from its own address and offset: it must find the
    # static buffer's storage at offset 1 of 4-byte elements.
    def of_kind(tensor):
        return torch.nn.Parameter(tensor) if kind is torch.nn.Parameter else tensor

    static = x()
    contract = record((of_kind(static),))
    for _ in range(2):
        contract.check((of_kind(x()),), {}, mode=FULL)
    assert contract.quick.accepts((of_kind(x()),), {}, full=True)
    inside = of_kind(static.as_strided((4, 2, 3), (0, 0, 1), 1))
    assert not contract.quick.accepts((inside,), {}, full=True)
    assert violation(contract, (inside,)).field == "alias"


class OwnStorage(torch.Tensor):
    """A tensor type whose storage is its own business (``claims``, where set): its address minus its
    offset need not be its storage's, so both checks read the storage through the type."""

    def untyped_storage(self):
        return getattr(self, "claims", None) or super().untyped_storage()


class EqualsAnyType(type(torch.Tensor)):
    """A metaclass whose classes say they equal any type (``in`` a tuple of types compares with ==)."""

    def __eq__(cls, other):
        return True

    __hash__ = type.__hash__


class PosesAsTensor(OwnStorage, metaclass=EqualsAnyType):
    pass


def _offset_view(static, kind):
    return static.as_strided((4, 2, 3), (0, 0, 1), 1)


def _claiming(static, kind):  # memory of its own, in the static buffer's storage by its type
    inside = x().as_subclass(kind)
    inside.claims = static.untyped_storage()
    return inside


def _with_instance_attribute(make, name, value):
    def disguised(static, kind):
        inside = make(static, kind)
        setattr(inside, name, value)
        return inside

    return disguised


# disguise: (the input type, the input in a static buffer's storage)
DISGUISES = {
    "an instance's storage_offset": (torch.Tensor, _with_instance_attribute(_offset_view, "storage_offset", lambda: 0)),
    "an instance's untyped_storage": (torch.Tensor, _with_instance_attribute(
        _offset_view, "untyped_storage", x().untyped_storage)),
    "a type with its own storage": (OwnStorage, _claiming),
    "a type with its own storage and an instance's": (OwnStorage, _with_instance_attribute(
        _claiming, "untyped_storage", x().untyped_storage)),
    "a type equal to torch.Tensor": (PosesAsTensor, _claiming),
}


@pytest.mark.parametrize("disguise", sorted(DISGUISES))
def test_an_input_in_a_static_buffers_storage_is_refused_in_any_disguise(disguise):
    # Both checks read a tensor's offset and storage through its type, never through the instance,
    # and the quick accept computes the storage only for exactly torch.Tensor or Parameter (by identity).
    kind, disguised = DISGUISES[disguise]
    static = x()
    contract = record((static.as_subclass(kind),))
    for _ in range(2):
        contract.check((x().as_subclass(kind),), {}, mode=FULL)
    assert contract.quick.accepts((x().as_subclass(kind),), {}, full=True)
    inside = disguised(static, kind)
    assert not contract.quick.accepts((inside,), {}, full=True)
    assert violation(contract, (inside,)).field == "alias"


class OwnPointer(torch.nn.Parameter):
    """A parameter whose ``data_ptr`` is another tensor's (a quantized parameter's data, say)."""

    def data_ptr(self) -> int:
        return self.inner.data_ptr()


def test_a_parameter_type_with_its_own_data_ptr_is_left_to_the_full_check():
    p = OwnPointer(torch.ones(3))
    p.inner = p.detach()  # at capture, the parameter's own memory
    contract = record((x(),), params=[("w", p)])
    for _ in range(2):
        contract.check((x(),), {}, mode=FULL)
    p.inner = torch.ones(3)  # torch.Tensor.data_ptr(p) is unchanged, p.data_ptr() is not
    assert not contract.quick.accepts((x(),), {}, full=True)
    assert violation(contract, (x(),)).field == "parameter storage"


def test_a_parameter_replaced_by_one_of_another_type_is_left_to_the_full_check():
    layer = Layer()
    contract = ReplayContract.record(GRAPH, (x(),), {}, module=layer)
    STATIC_BUFFERS.append(contract)
    for _ in range(2):
        contract.check((x(),), {}, mode=FULL)
    assert contract.quick.accepts((x(),), {}, full=True)
    weight = layer.linear.weight
    replaced = OwnPointer(weight.detach())
    replaced.inner = torch.ones(3, 2)  # at the old parameter's address by torch.Tensor.data_ptr only
    layer.linear._parameters["weight"] = replaced
    assert not contract.quick.accepts((x(),), {}, full=True)
    assert violation(contract, (x(),)).field == "parameter storage"


class OwnInputPointer(torch.Tensor):
    """An input whose ``data_ptr`` claims the static buffer's address: the full check reads it in place."""

    static_ptr = 0

    def data_ptr(self) -> int:
        return self.static_ptr


def test_an_input_type_with_its_own_data_ptr_is_left_to_the_full_check():
    contract = record((x(),))
    contract.check((x(),), {}, mode=FULL)
    relaid = x(2, 4, 3).transpose(0, 1).as_subclass(OwnInputPointer)  # another layout, as if in place
    relaid.static_ptr = contract.quick.state.statics[0].data_ptr
    assert not contract.quick.accepts((relaid,), {}, full=True)
    assert violation(contract, (relaid,)).field == "stride"
    contract.check((x().as_subclass(OwnInputPointer),), {}, mode=FULL)  # passes, and is not learned
    assert not contract.quick.accepts((relaid,), {}, full=True)


class LogicalDtype(torch.Tensor):
    """An input whose Python-level ``dtype`` and ``requires_grad`` are its own (a quantized tensor's
    logical dtype, say): the full check reads these attributes, so the quick accept must too."""

    @property
    def dtype(self):
        return getattr(self, "logical", torch.float32)

    @property
    def requires_grad(self):
        return getattr(self, "wants_grad", False)


@pytest.mark.parametrize("mode, attribute, value, field", [
    (FULL, "logical", torch.bfloat16, "dtype"), (SHAPES, "logical", torch.bfloat16, "dtype"),
    (FULL, "wants_grad", True, "requires_grad")])  # shapes mode does not check requires_grad
def test_the_quick_accept_reads_metadata_as_the_full_check_does(mode, attribute, value, field):
    contract = record((x(),))
    for _ in range(2):
        contract.check((x().as_subclass(LogicalDtype),), {}, mode=mode)
    assert contract.quick.accepts((x().as_subclass(LogicalDtype),), {}, mode == FULL)
    changed = x().as_subclass(LogicalDtype)
    setattr(changed, attribute, value)
    assert not contract.quick.accepts((changed,), {}, mode == FULL)
    assert violation(contract, (changed,), mode=mode).field == field


def test_a_nested_tensor_where_a_dense_one_was_learned_raises_in_python():
    # torch's C++ tensor guards (tried once for a quicker check) abort the whole process on a strided nested tensor.
    contract = record((x(),))
    for _ in range(2):
        contract.check((x(),), {}, mode=FULL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(RuntimeError):
        contract.check((nested,), {}, mode=FULL)


# ---------------------------------------------------------------------- held state once a step
#
# Under Megatron's DDP parameters and groups stay put between a step's first microbatch and its end; with
# the run's step marks given, the quick accept then reads them on the first microbatch's replay only.


class SteppedCall(MegatronCall):
    """A layer replayed step by step: ``steps`` are the run's marks (None: none given)."""

    def __init__(self, steps: StepMarks | None) -> None:
        self.layer = Layer(tp=process_group(), dp=process_group())
        self.hidden, self.rope = x(requires_grad=True), x(4, 1, 1, 2)
        STATIC_BUFFERS.append((self.hidden, self.rope))
        self.contract = ReplayContract.record(GRAPH, (self.hidden,), self.kwargs(self.rope), module=self.layer,
                                              step_marks=steps)

    def replay(self, first):
        self.contract.check(*self.fresh(is_first_microbatch=first), mode=FULL)

    def accepts(self, first):
        return self.contract.quick.accepts(*self.fresh(is_first_microbatch=first), full=True)


MOVES = {"parameter storage": _moved_parameter, "process group": _swapped_group}


@pytest.mark.parametrize("field", sorted(MOVES))
def test_held_state_is_read_on_a_steps_first_microbatch_and_not_again_in_that_step(field):
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        for first in (True, False, False):
            call.replay(first)
    with steps:
        call.replay(True)  # a later step: taken by the quick accept, which reads the held state and marks the step
        MOVES[field](call)
        assert call.accepts(False)  # a later microbatch of the same step: not read again
        assert not call.accepts(True)  # a first microbatch reads it
        with pytest.raises(ContractViolation) as refused:
            call.replay(True)
        assert refused.value.field == field
        assert not call.accepts(False)  # nothing was found as captured this step: read again


def test_a_step_that_ended_lets_no_replay_skip_the_held_state():
    # A training-mode forward of one's own after a step: Megatron marks it as a later microbatch.
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        call.replay(True)
        call.replay(False)
    _moved_parameter(call)
    assert not call.accepts(False)  # outside any step
    with steps:
        assert not call.accepts(False)  # another step, whose first microbatch has not been seen


def test_replays_outside_any_marked_step_read_the_held_state():
    steps = StepMarks()  # given, never entered: train_step was called past the plugin's patch
    call = SteppedCall(steps)
    call.replay(True)
    call.replay(False)
    _moved_parameter(call)
    assert not call.accepts(False)


def test_a_step_that_ended_inside_another_lets_no_replay_skip_the_held_state():
    # A script's bench: the patch marks the bench's whole run, the bench each step inside it.
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        with steps:
            call.replay(True)
        _moved_parameter(call)
        assert not call.accepts(False)


def test_without_step_marks_held_state_is_read_on_every_replay():
    call = SteppedCall(None)  # the model may move parameters between microbatches (Megatron-FSDP)
    for first in (True, False):
        call.replay(first)
    _moved_parameter(call)
    assert not call.accepts(False)


@pytest.mark.parametrize("marks", [(False, False, False), (None, None, None)], ids=["never first", "unmarked"])
def test_a_graph_never_replayed_as_a_first_microbatch_reads_held_state_on_every_replay(marks):
    # Under pipelining each microbatch has a graph of its own: only graph 0 sees is_first_microbatch=True.
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        for first in marks:
            call.replay(first)
        _moved_parameter(call)
        assert not call.accepts(marks[0])


@pytest.mark.parametrize("layout", ["the captured", "another"])
def test_an_unmarked_replay_ends_the_skip(layout):
    # Before the call's layout is compared: an unmarked call of another layout, refused, ends it too.
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        call.replay(True)
        _moved_parameter(call)
        args, kwargs = call.fresh(is_first_microbatch=None)
        if layout == "another":
            args = (*args, x())
        assert not call.contract.quick.accepts(args, kwargs, full=True)  # read, and refused
        with pytest.raises(ContractViolation):
            call.contract.check(args, kwargs, mode=FULL)
        assert not call.accepts(False)  # and the skip is over


def test_a_first_microbatch_the_full_check_passed_marks_the_step_in_full_mode_only():
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        call.replay(True)  # nothing learned yet: the full check, which reads the held state
        _moved_parameter(call)
        assert call.accepts(False)
    shapes_only = SteppedCall(steps)
    with steps:
        shapes_only.contract.check(*shapes_only.fresh(is_first_microbatch=True), mode=SHAPES)  # reads none
        _moved_parameter(shapes_only)
        assert not shapes_only.accepts(False)


def test_step_marks_tell_the_step_and_whether_one_is_under_way():
    steps = StepMarks()
    assert steps.step_now() is None
    with steps:
        first = steps.step_now()
        with steps:  # the bench's step inside a wrapped train_step
            assert steps.step_now() not in (None, first)
        assert steps.step_now() not in (None, first)
    assert steps.step_now() is None


def test_a_data_ptr_set_on_one_instance_counts_in_neither_check():
    # Every address is read through the tensor's type (record, full check, quick accept): none can disagree.
    p, static = torch.nn.Parameter(torch.ones(3)), x()
    p.data_ptr = static.data_ptr = lambda: 0  # set before the capture is recorded
    contract = record((static,), params=[("w", p)])
    contract.check((static,), {}, mode=FULL)  # read in place: the static buffer's own address
    claims_static = x(2, 4, 3).transpose(0, 1)  # another layout, in memory of its own
    claims_static.data_ptr = lambda: contract.quick.state.statics[0].data_ptr
    for _ in range(2):
        contract.check((claims_static,), {}, mode=FULL)  # copied in, whatever it claims
    assert contract.quick.accepts((claims_static,), {}, full=True)


def outlives_its_holders_with_gc_off(make) -> bool:
    """Whether the object ``make()`` returns first outlives the pair it returns (the object and what
    holds it) being dropped, with the cyclic collector off as Megatron's --manual-gc leaves it."""
    gc.disable()
    try:
        held = weakref.ref(make()[0])  # the pair is dropped at once; make's frame is gone
        return held() is not None
    finally:
        gc.enable()


def test_a_dropped_contract_frees_its_parameters_without_the_cyclic_collector():
    # A cycle through the compiled accept would keep every dropped graph's parameters (and what they
    # hold) alive until a manual collection.
    def learned():
        parameter = torch.nn.Parameter(torch.ones(3))
        contract = record(params=[("w", parameter)])
        for _ in range(2):
            contract.check((x(),), {}, mode=FULL)
        assert contract.quick.accepts((x(),), {}, full=True)  # learned: the compiled function exists
        return parameter, contract

    assert not outlives_its_holders_with_gc_off(learned)


def test_a_dropped_layer_holding_its_contract_is_freed_without_the_cyclic_collector():
    # The layer holds its graphs and they their contracts (layer.cuda_graphs); the contract's group
    # lookup must not hold the layer back.
    def graphed():
        layer = Layer(tp=process_group(), dp=process_group())
        contract = ReplayContract.record(GRAPH, (x(),), {}, module=layer)
        layer.cuda_graphs = [contract.replay_check(FULL)]
        for _ in range(2):
            layer.cuda_graphs[0]((x(),), {})
        assert contract.quick.accepts((x(),), {}, full=True)
        return layer, contract

    assert not outlives_its_holders_with_gc_off(graphed)


def test_a_contract_whose_layer_is_gone_refuses_it_as_groups_gone():
    layer = Layer(tp=process_group())
    contract = ReplayContract.record(GRAPH, (x(),), {}, module=layer)
    STATIC_BUFFERS.append(contract)
    for _ in range(2):
        contract.check((x(),), {}, mode=FULL)
    del layer
    gc.collect()
    assert not contract.quick.accepts((x(),), {}, full=True)
    assert violation(contract, (x(),)).field == "process group"


CALL_CHANGES = sorted(case for case in REFUSED if not case.startswith(tuple(MOVES)))  # the rest move held state


@pytest.mark.parametrize("case", CALL_CHANGES)
def test_the_skip_in_a_step_spares_the_held_state_only(case):
    # A later microbatch of a step whose first found the held state as captured: its call is still compared.
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        call.replay(True)
        assert call.accepts(False)
        args, kwargs = REFUSED[case](call)
        assert not call.contract.quick.accepts(args, {**kwargs, "is_first_microbatch": False}, full=True)


# The calls a replay may make: like the captured one, each read in place, and each of CALL_CHANGES (held
# state moves are drawn as events of their own).
CALLS = {
    "fresh": MegatronCall.fresh,
    "hidden states in place": lambda call: ((call.hidden,), call.kwargs(x(4, 1, 1, 2))),
    "rope in place": lambda call: call.fresh(rotary_pos_emb=call.rope),
    **{case: REFUSED[case] for case in CALL_CHANGES},
}


@given(data=st.data())
@settings(max_examples=1500, deadline=None)
def test_a_quick_accept_in_any_sequence_of_steps_and_moves_is_one_the_full_check_passes(data):
    # Except the one skip the design allows: a later microbatch of a step whose first microbatch found
    # the held state as captured, with no replay since that was not marked as a later microbatch.
    steps = StepMarks()
    call = SteppedCall(steps)
    captured_weight, captured_dp = call.layer.linear.weight.data, call.layer.pg_collection.dp
    skip_step = None  # the step a later microbatch may skip the held state in
    if data.draw(st.booleans(), label="inside a step"):
        steps.__enter__()
    for _ in range(data.draw(st.integers(1, 24), label="events")):
        event = data.draw(st.sampled_from(("enter", "exit", "move", "swap", "restore") + ("replay",) * 5), label="event")
        if event == "enter" and steps.depth < 2:
            steps.__enter__()
        elif event == "exit" and steps.depth:
            steps.__exit__()
        elif event in ("move", "swap"):
            (_moved_parameter if event == "move" else _swapped_group)(call)
        elif event == "restore":
            call.layer.linear.weight.data, call.layer.pg_collection.dp = captured_weight, captured_dp
        elif event == "replay":
            first = data.draw(st.sampled_from((True, False, None)), label="first")
            call_of = data.draw(st.sampled_from(sorted(CALLS)), label="call")
            args, kwargs = CALLS[call_of](call)
            kwargs = {**kwargs, "is_first_microbatch": first}
            if first is not False:
                skip_step = None
            accepted = call.contract.quick.accepts(args, kwargs, full=True)
            try:
                call.contract._check_in_full(args, kwargs, full=True)
            except ContractViolation as refused:
                assert not accepted or (first is False and skip_step is not None and skip_step == steps.step_now()
                                        and refused.field in MOVES), refused
                continue
            if not accepted:
                call.contract.quick.learn(args, kwargs, full=True)
            if not (accepted and first is False and skip_step is not None and skip_step == steps.step_now()):
                skip_step = steps.step_now() if first is True else None  # the held state was read


@pytest.mark.parametrize("where", ["keyword", "group"])
def test_a_name_of_a_str_subclass_at_capture_is_never_learned(where):
    # Its == could match any later name: the quick accept leaves such a call to the full check.
    call = MegatronCall()
    if where == "group":
        held = vars(call.layer.pg_collection)
        held.update({EqualsAnything(name): held.pop(name) for name in list(held)})
    kwargs = call.kwargs(call.rope)
    kwargs = {(EqualsAnything(key) if key == "window" and where == "keyword" else key): value
              for key, value in kwargs.items()}
    contract = ReplayContract.record(GRAPH, (call.hidden,), kwargs, module=call.layer)
    replay = (x(requires_grad=True),), {**kwargs, "rotary_pos_emb": x(4, 1, 1, 2)}
    for _ in range(2):
        contract.check(*replay, mode=FULL)
    assert not contract.quick.accepts(*replay, full=True)
    if where == "group":  # plain names now, under which the full check finds none of the captured groups
        held = vars(call.layer.pg_collection)
        held.update({str(name) + "x": held.pop(name) for name in list(held)})
        assert not contract.quick.accepts(*replay, full=True)
        assert violation(contract, *replay).field == "process group"
