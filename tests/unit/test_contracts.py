"""Tests for megatron_cg_plugin.capture.contracts: what a graph was captured for, checked before
every replay (on CPU tensors). Every call the check refuses is listed here (``REFUSED``, the
disguises, the property tests against a reference written out field by field), so a leaner check
cannot let one through."""

from __future__ import annotations

import gc
import types
import warnings
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.capture import contracts
from megatron_cg_plugin.capture.contracts import (
    FIRST_MICROBATCH,
    REPLAY_ONLY_KWARGS,
    CheckedGraph,
    ContractViolation,
    HeldState,
    ReplayContract,
    StaticInput,
    TensorSpec,
    flatten_call,
    process_groups_of,
)
from megatron_cg_plugin.capture.step_marks import StepMarks
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.console import group_label

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
    contract = ReplayContract.record(
        GRAPH, (a, 3), {"mask": mask, "z": None, "is_first_microbatch": True, "flag": "causal"}
    )
    assert [name for name, _ in contract.inputs] == ["arg0", "arg1", "flag=", "mask="]
    assert contract.inputs[0][1].spec == TensorSpec((4, 2, 3), torch.float32, (6, 3, 1), torch.device("cpu"), True)
    assert contract.inputs[0][1].data_ptr == a.data_ptr()
    assert contract.inputs[1] == ("arg1", 3)
    assert contract.inputs[2] == ("flag=", "causal")
    assert contract.held.parameters == () and contract.held.process_groups == ()


def test_nested_arguments_are_flattened_and_named_by_place():
    contract = record((x(), [x(2), 5]), {"extra": {"k": x(3)}})
    assert [name for name, _ in contract.inputs] == ["arg0", "arg1[0]", "arg1[1]", "extra=['k']"]


def test_a_tensor_in_a_list_is_checked_like_any_other():
    contract = record((x(), [x(2)]))
    contract.check((x(), [x(2)]), {}, mode=FULL)
    assert_message(
        violation(contract, (x(), [x(2, dtype=torch.float16)]), mode=SHAPES),
        "dtype",
        torch.float32,
        torch.float16,
        "arg1[0]",
    )
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
    assert_message(violation(contract, (second, first)), "alias", "separate memory", "a static buffer's memory", "arg0")
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


@pytest.mark.parametrize(
    "args, kwargs, actual",
    [
        ((), {"mask": "m"}, ["mask="]),  # a positional argument missing
        (("t", "t2"), {"mask": "m"}, ["arg0", "arg1", "mask="]),  # one too many
        (("t",), {}, ["arg0"]),  # a tensor kwarg missing
        (("t",), {"mask": "m", "extra": "e"}, ["arg0", "extra=", "mask="]),  # an unexpected kwarg
    ],
)
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
    assert [held.name for held in contract.held.parameters] == [
        "linear.weight",
        "linear.bias",
        "norm.weight",
        "norm.bias",
    ]
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
    groups_only = ReplayContract(GRAPH, contract.inputs, HeldState((), contract.held.process_groups))
    old = hex(layer.norm.bias.data_ptr())
    layer.norm.bias = torch.nn.Parameter(torch.zeros(3))
    layer.pg_collection.tp = process_group()
    for kwargs in ({"is_first_microbatch": True}, {"is_first_microbatch": False}, {}):
        assert_message(
            violation(contract, (x(),), kwargs), "parameter storage", old, hex(layer.norm.bias.data_ptr()), "norm.bias"
        )
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
    for _ in range(2):
        reads.clear()
        contract.check((x(),), {}, mode=FULL)
        assert reads == ["__dict__"] and len(contract.held.process_groups) == 2
    layer.pg_collection.dp = process_group()
    assert violation(contract, (x(),)).field == "process group"


def test_process_groups_by_identity():
    tp, dp = process_group(), process_group()
    layer = Layer(dp=dp, tp=tp, sizes=[1, 2])
    contract = record(module=layer)
    assert [held.name for held in contract.held.process_groups] == ["dp", "tp"]
    contract.check((x(),), {}, mode=FULL)
    layer.pg_collection.tp = lookalike = process_group()  # a re-created communicator
    error = violation(contract, (x(),))
    assert_message(error, "process group", group_label(tp), group_label(lookalike), "tp")
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
    assert {"is_first_microbatch", "cuda_graph_stream", "cuda_graph_event"} == REPLAY_ONLY_KWARGS


def test_none_kwargs_are_ignored():
    contract = record(kwargs={"rotary_pos_emb": None, "mask": x(1)})
    contract.check((x(),), {"mask": x(1)}, mode=FULL)
    contract.check((x(),), {"mask": x(1), "rotary_pos_emb": None, "packed_seq_params": None}, mode=FULL)


def test_hint_for_every_field_exists():
    for field in (
        "shape",
        "dtype",
        "stride",
        "device",
        "requires_grad",
        "kind",
        "alias",
        "control",
        "arguments",
        "parameter storage",
        "process group",
    ):
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
        return ReplayContract(GRAPH, (("arg0", static), ("arg1", StaticInput.of(second))))

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
    contract = ReplayContract(GRAPH, (("arg0", live_first), ("arg1", dead_second)))
    assert static_storages(contract) == {storage.untyped_storage().data_ptr()}
    inside = storage.view(-1)[1:25].view(4, 2, 3)  # neither buffer's address, but their memory
    assert violation(contract, (x(), inside)).field == "alias"


# ====================================================================== every refused call
#
# Each case below is a call the check refuses, named by the field it refuses; the property tests
# combine them, and compare the check with a reference that reads every field the plain way.


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
        return {
            "attention_mask": None,
            "rotary_pos_emb": rope,
            "window": 4,
            "packed_seq_params": None,
            "is_first_microbatch": False,
            **changes,
        }

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
    "arguments (a keyword gone)": lambda call: (
        call.fresh()[0],
        {k: v for k, v in call.fresh()[1].items() if k != "rotary_pos_emb"},
    ),
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
    "arguments (a keyword equal to anything)": lambda call: (
        call.fresh()[0],
        {
            (EqualsAnything("rotary_emb") if key == "rotary_pos_emb" else key): value
            for key, value in call.fresh()[1].items()
        },
    ),
}


def refusal(contract, args, kwargs, mode=FULL) -> str | None:
    """The field ``check`` refuses the call by, or None where it passes."""
    try:
        contract.check(args, kwargs, mode)
    except ContractViolation as error:
        return error.field
    return None


def static_storages(contract) -> set[int]:
    """The storages of the contract's static buffers still alive."""
    return {value.storage_ptr for _, value in contract.inputs if isinstance(value, StaticInput) and value.alive}


def reference_refusal(contract, args, kwargs, *, full=True, read_held=True) -> str | None:
    """What the check must refuse, written out field by field the plain way (every call flattened,
    every storage read through its type's ``untyped_storage``)."""
    actual = flatten_call(args, kwargs)
    if [name for name, _ in actual] != [name for name, _ in contract.inputs]:
        return "arguments"
    for (_, expected), (_, value) in zip(contract.inputs, actual):
        if isinstance(expected, StaticInput) != isinstance(value, torch.Tensor):
            return "kind"
        if not isinstance(value, torch.Tensor):
            try:
                same = expected is value or bool(expected == value)
            except (RuntimeError, TypeError, ValueError):
                same = False
            if full and not same:
                return "control"
            continue
        spec = expected.spec
        if tuple(value.shape) != spec.shape:
            return "shape"
        if value.dtype != spec.dtype:
            return "dtype"
        if not full:
            continue
        if value.device != spec.device:
            return "device"
        if value.requires_grad and not spec.requires_grad:
            return "requires_grad"
        if type(value).data_ptr(value) == expected.data_ptr and expected.alive:
            if contracts.addressed_strides(value.shape, value.stride()) != contracts.addressed_strides(
                spec.shape, spec.stride
            ):
                return "stride"
        elif value.numel() and type(value).untyped_storage(value).data_ptr() in static_storages(contract):
            return "alias"
    if full and read_held:
        for held in contract.held.parameters:
            now = held.lookup()
            if now is None or type(now).data_ptr(now) != held.captured:
                return "parameter storage"
        for held in contract.held.process_groups:
            if held.lookup().get(held.name) is not held.captured:
                return "process group"
    return None


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_refused_call_is_refused_naming_its_field(case):
    call = MegatronCall()
    contract = call.contract
    for _ in range(2):
        contract.check(*call.fresh(), mode=FULL)
    args, kwargs = REFUSED[case](call)
    assert refusal(contract, args, kwargs) == case.split(" (")[0] == reference_refusal(contract, args, kwargs)


def test_a_replay_like_the_captured_one_passes():
    call = MegatronCall()
    contract = call.contract
    for kwargs in ({}, {"is_first_microbatch": True}, {"is_first_microbatch": None}, {"inference_context": None}):
        args, fresh = call.fresh()
        contract.check(args, {**fresh, **kwargs}, mode=FULL)
    contract.check((call.hidden,), call.fresh()[1], mode=FULL)  # the static buffer itself, as captured
    contract.check((x(),), call.fresh()[1], mode=FULL)  # no gradient: the capture computed one, autograd drops it
    args, kwargs = call.fresh()
    contract.check(args, dict(reversed(list(kwargs.items()))), mode=FULL)  # keywords in another order
    contract.check(list(args), kwargs, mode=FULL)  # positional arguments as a list


def test_shapes_mode_compares_the_arguments_shape_and_dtype_only():
    call = MegatronCall()
    contract = call.contract
    _swapped_group(call)
    _moved_parameter(call)
    contract.check(*call.fresh(window=5), mode=SHAPES)  # neither is checked in shapes
    contract.check(*_inside_a_static_buffer(call), mode=SHAPES)
    for case in ("shape", "dtype", "kind", "arguments (a keyword added)"):
        assert refusal(contract, *REFUSED[case](call), mode=SHAPES) == case.split(" (")[0]


def test_a_freed_static_buffers_address_is_copied_in_like_any_other():
    call = MegatronCall()
    (name, static), *rest = call.contract.inputs
    dead = StaticInput(static.spec, static.data_ptr, static.storage_ptr, lambda: None)
    contract = ReplayContract(GRAPH, ((name, dead), *rest), call.contract.held)
    relaid = call.hidden.detach().as_strided((4, 2, 3), (1, 4, 8)).requires_grad_()
    contract.check((relaid,), call.fresh()[1], mode=FULL)  # at its address, another layout: copied in


BENIGN = {
    "first microbatch": lambda call, args, kwargs: (args, {**kwargs, "is_first_microbatch": True}),
    "no gradient": lambda call, args, kwargs: (
        tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
        kwargs,
    ),
    "in place": lambda call, args, kwargs: ((call.hidden,), kwargs),
    "another None keyword": lambda call, args, kwargs: (args, {**kwargs, "inference_context": None}),
}


@given(
    refused=st.lists(st.sampled_from(sorted(REFUSED)), max_size=2),
    benign=st.lists(st.sampled_from(sorted(BENIGN)), max_size=3),
)
@settings(max_examples=150, deadline=None)
def test_the_check_refuses_what_the_reference_refuses_in_any_combination(refused, benign):
    call = MegatronCall()
    contract = call.contract
    contract.check(*call.fresh(), mode=FULL)
    args, kwargs = call.fresh()
    for case in refused:
        args, kwargs = REFUSED[case](call)
    for case in benign:
        args, kwargs = BENIGN[case](call, args, kwargs)
    assert refusal(contract, args, kwargs) == reference_refusal(contract, args, kwargs)


def test_held_parameters_given_by_name_are_read_too():
    # Slot-shared capture holds its parameters as given, not through an owner's _parameters.
    p = torch.nn.Parameter(torch.ones(3))
    contract = record((x(),), params=[("w", p)])
    contract.check((x(),), {}, mode=FULL)
    p.data = torch.ones(3)
    assert violation(contract, (x(),)).field == "parameter storage"


def test_a_freed_static_buffers_memory_is_no_alias():
    storage = torch.zeros(2, 4, 2, 3)
    gone = x()
    dead = weakref.ref(gone)
    del gone
    freed = StaticInput(TensorSpec.of(storage[0]), storage[0].data_ptr(), storage.untyped_storage().data_ptr(), dead)
    contract = ReplayContract(GRAPH, (("arg0", freed),))
    contract.check((storage[1],), {}, mode=FULL)  # a new input where the freed buffer's memory was


def test_control_values_are_compared_with_the_captured_value_on_the_left():
    class AtMost:  # an __eq__ that is not symmetric: the captured value's decides
        def __init__(self, limit):
            self.limit = limit

        def __eq__(self, other):
            return self.limit <= other.limit

    contract = record((x(), AtMost(2)))
    contract.check((x(), AtMost(3)), {}, mode=FULL)
    assert violation(contract, (x(), AtMost(1))).field == "control"


def test_a_control_value_equal_to_a_list_is_no_substitute_for_its_leaf():
    class EqualsAll:
        def __eq__(self, other):
            return True

    contract = record((x(), EqualsAll()))
    assert violation(contract, (x(), [1])).field == "arguments"  # its leaves are named by place


def test_an_input_in_a_larger_storage_at_a_static_buffers_address_is_refused():
    # Two storages over one allocation (torch.frombuffer, or a CUDA block resized in place): the
    # input starts past the static buffer's bytes, but in a storage at the same address.
    memory = bytearray(2 * 24 * 4)
    static = torch.frombuffer(memory, dtype=torch.float32, count=24).view(4, 2, 3)
    beyond = torch.frombuffer(memory, dtype=torch.float32, count=48)[24:].view(4, 2, 3)
    contract = record((static,))
    contract.check((x(),), {}, mode=FULL)
    assert violation(contract, (beyond,)).field == "alias"


@pytest.mark.parametrize("kind", [torch.Tensor, torch.nn.Parameter])
def test_an_input_at_an_offset_inside_a_static_buffer_is_refused(kind):
    # A plain tensor's storage address is computed from its own address and offset: it must find the
    # static buffer's storage at offset 1 of 4-byte elements.
    def of_kind(tensor):
        return torch.nn.Parameter(tensor) if kind is torch.nn.Parameter else tensor

    static = x()
    contract = record((of_kind(static),))
    contract.check((of_kind(x()),), {}, mode=FULL)
    inside = of_kind(static.as_strided((4, 2, 3), (0, 0, 1), 1))
    assert violation(contract, (inside,)).field == "alias"


class OwnStorage(torch.Tensor):
    """A tensor type whose storage is its own business (``claims``, where set): its address minus its
    offset need not be its storage's, so the check reads the storage through the type."""

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
    "an instance's untyped_storage": (
        torch.Tensor,
        _with_instance_attribute(_offset_view, "untyped_storage", x().untyped_storage),
    ),
    "a type with its own storage": (OwnStorage, _claiming),
    "a type with its own storage and an instance's": (
        OwnStorage,
        _with_instance_attribute(_claiming, "untyped_storage", x().untyped_storage),
    ),
    "a type equal to torch.Tensor": (PosesAsTensor, _claiming),
}


@pytest.mark.parametrize("disguise", sorted(DISGUISES))
def test_an_input_in_a_static_buffers_storage_is_refused_in_any_disguise(disguise):
    # A tensor's offset and storage are read through its type, never through the instance, and the
    # storage is computed from the offset only for exactly torch.Tensor or Parameter (by identity).
    kind, disguised = DISGUISES[disguise]
    static = x()
    contract = record((static.as_subclass(kind),))
    contract.check((x().as_subclass(kind),), {}, mode=FULL)
    inside = disguised(static, kind)
    assert violation(contract, (inside,)).field == "alias"


class OwnPointer(torch.nn.Parameter):
    """A parameter whose ``data_ptr`` is another tensor's (a quantized parameter's data, say)."""

    def data_ptr(self) -> int:
        return self.inner.data_ptr()


def test_a_parameter_type_with_its_own_data_ptr_is_read_through_it():
    p = OwnPointer(torch.ones(3))
    p.inner = p.detach()  # at capture, the parameter's own memory
    contract = record((x(),), params=[("w", p)])
    contract.check((x(),), {}, mode=FULL)
    p.inner = torch.ones(3)  # torch.Tensor.data_ptr(p) is unchanged, p.data_ptr() is not
    assert violation(contract, (x(),)).field == "parameter storage"


def test_a_parameter_replaced_by_one_of_another_type_at_the_same_plain_address_is_refused():
    layer = Layer()
    contract = ReplayContract.record(GRAPH, (x(),), {}, module=layer)
    STATIC_BUFFERS.append(contract)
    contract.check((x(),), {}, mode=FULL)
    weight = layer.linear.weight
    replaced = OwnPointer(weight.detach())
    replaced.inner = torch.ones(3, 2)  # at the old parameter's address by torch.Tensor.data_ptr only
    layer.linear._parameters["weight"] = replaced
    assert violation(contract, (x(),)).field == "parameter storage"


class OwnInputPointer(torch.Tensor):
    """An input whose ``data_ptr`` claims the static buffer's address: the check reads it in place."""

    static_ptr = 0

    def data_ptr(self) -> int:
        return self.static_ptr


def test_an_input_type_with_its_own_data_ptr_is_read_through_it():
    contract = record((x(),))
    relaid = x(2, 4, 3).transpose(0, 1).as_subclass(OwnInputPointer)  # another layout, as if in place
    relaid.static_ptr = contract.inputs[0][1].data_ptr
    assert violation(contract, (relaid,)).field == "stride"
    contract.check((x().as_subclass(OwnInputPointer),), {}, mode=FULL)


class LogicalDtype(torch.Tensor):
    """An input whose Python-level ``dtype`` and ``requires_grad`` are its own (a quantized tensor's
    logical dtype, say): the check reads these attributes."""

    @property
    def dtype(self):
        return getattr(self, "logical", torch.float32)

    @property
    def requires_grad(self):
        return getattr(self, "wants_grad", False)


@pytest.mark.parametrize(
    "mode, attribute, value, field",
    [
        (FULL, "logical", torch.bfloat16, "dtype"),
        (SHAPES, "logical", torch.bfloat16, "dtype"),
        (FULL, "wants_grad", True, "requires_grad"),
    ],
)  # shapes mode does not check requires_grad
def test_metadata_is_read_through_the_tensors_attributes(mode, attribute, value, field):
    contract = record((x(),))
    contract.check((x().as_subclass(LogicalDtype),), {}, mode=mode)
    changed = x().as_subclass(LogicalDtype)
    setattr(changed, attribute, value)
    assert violation(contract, (changed,), mode=mode).field == field


def test_a_nested_tensor_where_a_dense_one_was_captured_raises_in_python():
    # torch's C++ tensor guards abort the whole process on a strided nested tensor; the check reads Python attributes.
    contract = record((x(),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(RuntimeError):
        contract.check((nested,), {}, mode=FULL)


def test_a_data_ptr_set_on_one_instance_counts_nowhere():
    # Every address is read through the tensor's type (record and check): none can disagree.
    p, static = torch.nn.Parameter(torch.ones(3)), x()
    p.data_ptr = static.data_ptr = lambda: 0  # set before the capture is recorded
    contract = record((static,), params=[("w", p)])
    contract.check((static,), {}, mode=FULL)  # read in place: the static buffer's own address
    claims_static = x(2, 4, 3).transpose(0, 1)  # another layout, in memory of its own
    claims_static.data_ptr = lambda: contract.inputs[0][1].data_ptr
    contract.check((claims_static,), {}, mode=FULL)  # copied in, whatever it claims


@pytest.mark.parametrize("where", ["keyword", "group"])
def test_a_name_of_a_str_subclass_is_compared_by_its_text(where):
    # Its == could match any later name: names are compared as the plain text flatten_call gives them.
    call = MegatronCall()
    if where == "group":
        held = vars(call.layer.pg_collection)
        held.update({EqualsAnything(name): held.pop(name) for name in list(held)})
    kwargs = call.kwargs(call.rope)
    kwargs = {
        (EqualsAnything(key) if key == "window" and where == "keyword" else key): value for key, value in kwargs.items()
    }
    contract = ReplayContract.record(GRAPH, (call.hidden,), kwargs, module=call.layer)
    replay = (x(requires_grad=True),), {**kwargs, "rotary_pos_emb": x(4, 1, 1, 2)}
    contract.check(*replay, mode=FULL)
    if where == "keyword":
        renamed = {(EqualsAnything("wind") if key == "window" else key): value for key, value in replay[1].items()}
        assert violation(contract, replay[0], renamed).field == "arguments"
    else:  # plain names now, under which the check finds none of the captured groups
        held = vars(call.layer.pg_collection)
        held.update({str(name) + "x": held.pop(name) for name in list(held)})
        assert violation(contract, *replay).field == "process group"


# ---------------------------------------------------------------------- any layout of a call
#
# A graph's call of a drawn layout (how many positional and keyword values, of which kinds, in which
# order), changed in drawn ways: the check refuses exactly what the reference refuses, by its field.

KINDS = ("tensor", "tensor with grad", "vector", "none", "int", "str")


def sample(kind: str):
    """A fresh value of ``kind``, equal in metadata (tensors) or value (controls) each time."""
    return {
        "tensor": lambda: torch.zeros(4, 2, 3),
        "tensor with grad": lambda: torch.zeros(4, 2, 3, requires_grad=True),
        "vector": lambda: torch.zeros(5, dtype=torch.float64),
        "none": lambda: None,
        "int": lambda: 3,
        "str": lambda: "causal",
    }[kind]()


class DrawnCall:
    """A graph's call of a drawn layout; the capture's sample tensors are kept as TE keeps its
    static buffers (alive as long as the graph)."""

    def __init__(self, positional: list[str], keywords: list[str], replay_only: bool) -> None:
        self.positional, self.keywords, self.replay_only = positional, keywords, replay_only
        self.captured = self.fresh(first=None)
        self.contract = ReplayContract.record("g", *self.captured)

    def fresh(self, first=False):
        args = tuple(sample(kind) for kind in self.positional)
        kwargs = {f"k{index}": sample(kind) for index, kind in enumerate(self.keywords)}
        if self.replay_only and first is not None:
            kwargs[FIRST_MICROBATCH] = first
        return list(args), kwargs

    def static(self, place, value: torch.Tensor) -> torch.Tensor:
        """The static buffer captured at ``place``; ``value`` where a tensor was not captured there."""
        where, key = place
        captured = self.captured[0] if where == "args" else self.captured[1]
        found = (captured[key] if key < len(captured) else None) if where == "args" else captured.get(key)
        return found if isinstance(found, torch.Tensor) else value


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
    """``value`` with one thing changed; some changes are benign (the check passes them)."""
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
    if change == "in a list":
        return [value]
    return {"none": None, "int": 3, "inside a static buffer": static}[change]


TENSOR_CHANGES = (
    "shape",
    "dtype",
    "gradient",
    "device",
    "subclass",
    "in place",
    "in place, relaid",
    "inside a static buffer",
    "none",
    "int",
    "in a list",
)
CONTROL_CHANGES = ("other value", "same value", "bool for int", "tensor", "none", "in a list")
CALL_CHANGES = (
    "keyword dropped",
    "keyword renamed",
    "keyword added",
    "keywords reordered",
    "positional added",
    "positional dropped",
    "first microbatch",
    "first microbatch None",
    "keyword of a str subclass",
)


def _mutated(call: DrawnCall, data, args: list, kwargs: dict):
    places = [("args", index) for index in range(len(args))] + [("kwargs", key) for key in kwargs]
    change = data.draw(st.sampled_from(("value",) * 3 + CALL_CHANGES), label="change")
    if change == "value" and places:
        place = data.draw(st.sampled_from(places), label="place")
        value = _get(args, kwargs, place)
        if place == ("kwargs", FIRST_MICROBATCH):
            _set(args, kwargs, place, data.draw(st.sampled_from((True, False, None, 1))))
        elif isinstance(value, torch.Tensor):
            _set(
                args,
                kwargs,
                place,
                _changed_tensor(value, data.draw(st.sampled_from(TENSOR_CHANGES)), call.static(place, value)),
            )
        else:
            control = data.draw(st.sampled_from(CONTROL_CHANGES), label="control change")
            _set(
                args,
                kwargs,
                place,
                {
                    "other value": "other" if isinstance(value, str) else 4,
                    "same value": value,
                    "bool for int": True,
                    "tensor": torch.zeros(2),
                    "none": None,
                    "in a list": [value],
                }[control],
            )
    elif change == "keyword dropped" and kwargs:
        kwargs.pop(data.draw(st.sampled_from(sorted(kwargs))))
    elif change == "keyword renamed" and kwargs:
        key = data.draw(st.sampled_from(sorted(kwargs)))
        kwargs[key + "_renamed"] = kwargs.pop(key)
    elif change == "keyword of a str subclass" and kwargs:
        key = data.draw(st.sampled_from(sorted(kwargs)))
        kwargs[EqualsAnything(key if data.draw(st.booleans()) else key + "_renamed")] = kwargs.pop(key)
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


@given(
    positional=st.lists(st.sampled_from(KINDS), max_size=3),
    keywords=st.lists(st.sampled_from(KINDS), max_size=4),
    replay_only=st.booleans(),
    mode=st.sampled_from((FULL, SHAPES)),
    data=st.data(),
)
@settings(max_examples=400, deadline=None)
def test_the_check_refuses_what_the_reference_refuses_whatever_the_calls_layout(
    positional, keywords, replay_only, mode, data
):
    call = DrawnCall(positional, keywords, replay_only)
    call.contract.check(*call.fresh(), mode=mode)  # its like, with fresh tensors
    args, kwargs = call.fresh()
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        args, kwargs = _mutated(call, data, args, kwargs)
    assert refusal(call.contract, args, kwargs, mode) == reference_refusal(
        call.contract, args, kwargs, full=mode == FULL
    )


def test_keywords_in_another_order_are_matched_by_name_not_by_place():
    static_a, static_b = torch.zeros(4, 2, 3), torch.zeros(4, 2, 3)
    contract = ReplayContract.record("g", (), {"a": static_a, "b": static_b})
    contract.check((), {"b": torch.zeros(4, 2, 3), "a": torch.zeros(4, 2, 3)}, mode=FULL)
    swapped = {"b": static_a, "a": torch.zeros(4, 2, 3)}  # a's static buffer given as b
    assert violation(contract, (), swapped).field == "alias"


# ---------------------------------------------------------------------- held state once a step
#
# Under Megatron's DDP parameters and groups stay put within a run of Megatron's schedule; with the
# run's step marks given, a contract reads them at its first replay in each run only.


class SteppedCall(MegatronCall):
    """A layer replayed step by step: ``steps`` are the run's marks (None: none given); ``held``, a
    held state shared with other contracts of the layer (else one of its own)."""

    def __init__(self, steps: StepMarks | None, layer: Layer | None = None, held: HeldState | None = None) -> None:
        self.layer = layer or Layer(tp=process_group(), dp=process_group())
        self.hidden, self.rope = x(requires_grad=True), x(4, 1, 1, 2)
        STATIC_BUFFERS.append((self.hidden, self.rope))
        own = {"module": self.layer, "step_marks": steps} if held is None else {"held": held}
        self.contract = ReplayContract.record(GRAPH, (self.hidden,), self.kwargs(self.rope), **own)

    def replay(self, first=False):
        self.contract.check(*self.fresh(is_first_microbatch=first), mode=FULL)

    def refused(self, first=False):
        return refusal(self.contract, *self.fresh(is_first_microbatch=first))


MOVES = {"parameter storage": _moved_parameter, "process group": _swapped_group}


@pytest.mark.parametrize("field", sorted(MOVES))
def test_held_state_is_read_at_a_contracts_first_replay_in_a_step_and_not_again_in_it(field):
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        call.replay(True)  # reads the held state
        MOVES[field](call)
        for first in (False, True, None):  # whatever Megatron marks the microbatch
            call.replay(first)
    assert call.refused() == field  # outside any step: read
    with steps:
        assert call.refused(True) == field  # the next step's first replay reads it
        assert call.refused(False) == field  # found moved: read again


def test_a_replay_outside_any_step_reads_the_held_state_every_time():
    # A training-mode forward of one's own, or train_step called past the plugin's patch (marks never entered).
    steps = StepMarks()
    call = SteppedCall(steps)
    for first in (True, False):
        call.replay(first)
    _moved_parameter(call)
    assert call.refused(False) == "parameter storage"


def test_a_step_that_ended_inside_another_lets_no_replay_skip_the_held_state():
    # A script's bench: the patch marks the bench's whole run, the bench each step inside it.
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        with steps:
            call.replay(True)
        _moved_parameter(call)
        assert call.refused(False) == "parameter storage"


def test_without_step_marks_held_state_is_read_on_every_replay():
    call = SteppedCall(None)  # the model may move parameters between microbatches (Megatron-FSDP)
    for first in (True, False):
        call.replay(first)
    _moved_parameter(call)
    assert call.refused(False) == "parameter storage"


@pytest.mark.parametrize("shared", [True, False])
def test_contracts_read_the_held_state_at_its_first_replay_in_a_step_whichever_contract_replays(shared):
    # Each microbatch has a graph (and contract) of its own on the same layer; the helper gives them the
    # layer's one held state. Contracts recorded apart hold a state each, read at each one's first replay.
    steps = StepMarks()
    first_graph = SteppedCall(steps)
    later_graph = SteppedCall(steps, first_graph.layer, first_graph.contract.held if shared else None)
    with steps:
        first_graph.replay(True)
        _moved_parameter(first_graph)  # no run moves them: shows which replay reads them
        first_graph.replay(False)
        assert later_graph.refused(False) == (None if shared else "parameter storage")


class CountedPointer(torch.nn.Parameter):
    """A parameter counting the reads of its address: each read of the held state reads it once."""

    reads = 0

    def data_ptr(self) -> int:
        self.reads += 1
        return super().data_ptr()


MICROBATCHES = 3


def layer_call(first=None):
    """A call of a Megatron layer as captured and replayed (``is_first_microbatch``: added at replay)."""
    return (x(requires_grad=True),), MegatronCall.kwargs(x(4, 1, 1, 2), is_first_microbatch=first)


def graphed_layer(steps: StepMarks) -> tuple[Layer, CountedPointer]:
    """A layer the plugin's helper held to its contracts after a capture: one graph per microbatch
    (Megatron replays graph ``microbatch % MICROBATCHES``); its weight counts the reads of it."""
    from megatron_cg_plugin.capture_lifecycle import PluginHelperMixin

    layer = Layer(tp=process_group(), dp=process_group())
    layer.layer_number = 7
    weight = layer.linear.weight = CountedPointer(torch.zeros(3, 2))
    graphs = [lambda *args, **kwargs: "replayed" for _ in range(MICROBATCHES)]
    layer.cuda_graphs = list(graphs)
    samples = [layer_call(False) for _ in graphs]
    STATIC_BUFFERS.append(samples)
    capture = types.SimpleNamespace(
        graphs=graphs, sample_args=[args for args, _ in samples], sample_kwargs=[kwargs for _, kwargs in samples]
    )
    helper = types.SimpleNamespace(flattened_callables=[layer], _contract_step_marks=lambda: steps)
    PluginHelperMixin._hold_to_contracts(helper, capture, FULL)
    return layer, weight


def replay_microbatch(layer: Layer, microbatch: int) -> ContractViolation | None:
    """Replays the layer's graph of ``microbatch``: the refusal, None where the graph ran."""
    args, kwargs = layer_call(microbatch == 0)
    try:
        assert layer.cuda_graphs[microbatch](*args, **kwargs) == "replayed"
    except ContractViolation as error:
        return error
    return None


def test_a_layers_microbatch_graphs_read_its_held_state_once_a_run_not_once_a_microbatch():
    steps = StepMarks()
    layer, weight = graphed_layer(steps)
    for _ in range(3):  # runs of the schedule, each replaying every microbatch's graph
        weight.reads = 0
        with steps:
            for microbatch in range(MICROBATCHES):
                assert replay_microbatch(layer, microbatch) is None
        assert weight.reads == 1
    weight.reads = 0
    assert replay_microbatch(layer, 1) is None and replay_microbatch(layer, 2) is None  # outside any run
    assert weight.reads == 2


MOVED_BETWEEN_RUNS = {  # what a checkpoint load may do to a layer's parameters
    "reallocated": lambda layer: setattr(layer.linear.weight, "data", torch.ones(3, 2)),
    "replaced": lambda layer: layer.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()}, assign=True),
}


@pytest.mark.parametrize("first", range(MICROBATCHES))
@pytest.mark.parametrize("move", sorted(MOVED_BETWEEN_RUNS))
def test_a_parameter_moved_between_runs_is_refused_at_the_next_runs_first_replay_of_any_microbatch(first, move):
    steps = StepMarks()
    layer, _ = graphed_layer(steps)
    with steps:
        for microbatch in range(MICROBATCHES):
            assert replay_microbatch(layer, microbatch) is None
    MOVED_BETWEEN_RUNS[move](layer)
    with steps:
        error = replay_microbatch(layer, first)  # whichever graph replays first in the run
        assert error is not None and (error.field, error.graph) == ("parameter storage", f"layer 7 microbatch {first}")
        for microbatch in range(MICROBATCHES):  # found moved: every later replay reads it again
            assert getattr(replay_microbatch(layer, microbatch), "field", None) == "parameter storage"


def test_a_check_in_shapes_mode_reads_no_held_state_for_a_later_full_one():
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        call.contract.check(*call.fresh(is_first_microbatch=True), mode=SHAPES)
        _moved_parameter(call)
        assert call.refused(False) == "parameter storage"


SAME_HELD = sorted(case for case in REFUSED if not case.startswith(tuple(MOVES)))  # the rest move held state


@pytest.mark.parametrize("case", SAME_HELD)
def test_the_skip_in_a_step_spares_the_held_state_only(case):
    # A later replay in a step whose first found the held state as captured: its call is still compared.
    steps = StepMarks()
    call = SteppedCall(steps)
    with steps:
        call.replay(True)
        args, kwargs = REFUSED[case](call)
        assert refusal(call.contract, args, {**kwargs, "is_first_microbatch": False}) == case.split(" (")[0]


def test_step_marks_tell_the_step_and_whether_one_is_under_way():
    steps = StepMarks()
    assert steps.step_now() is None
    with steps:
        first = steps.step_now()
        with steps:  # the bench's step inside a wrapped train_step
            assert steps.step_now() not in (None, first)
        assert steps.step_now() not in (None, first)
    assert steps.step_now() is None


# The calls a replay may make: like the captured one, each read in place, and each of SAME_HELD (held
# state moves are drawn as events of their own).
CALLS = {
    "fresh": MegatronCall.fresh,
    "hidden states in place": lambda call: ((call.hidden,), call.kwargs(x(4, 1, 1, 2))),
    "rope in place": lambda call: call.fresh(rotary_pos_emb=call.rope),
    **{case: REFUSED[case] for case in SAME_HELD},
}


@given(data=st.data())
@settings(max_examples=1500, deadline=None)
def test_in_any_sequence_of_steps_and_moves_the_check_skips_only_held_state_read_in_the_same_step(data):
    steps = StepMarks()
    call = SteppedCall(steps)
    captured_weight, captured_dp = call.layer.linear.weight.data, call.layer.pg_collection.dp
    read_in = None  # the step whose held state the contract found as captured
    if data.draw(st.booleans(), label="inside a step"):
        steps.__enter__()
    for _ in range(data.draw(st.integers(1, 24), label="events")):
        event = data.draw(
            st.sampled_from(("enter", "exit", "move", "swap", "restore") + ("replay",) * 5), label="event"
        )
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
            args, kwargs = CALLS[data.draw(st.sampled_from(sorted(CALLS)), label="call")](call)
            kwargs = {**kwargs, "is_first_microbatch": first}
            run = steps.step_now()
            skips = run is not None and run == read_in
            expected = reference_refusal(call.contract, args, kwargs, read_held=not skips)
            assert refusal(call.contract, args, kwargs) == expected
            if not skips and expected is None:
                read_in = run
            elif expected in MOVES:
                read_in = None


# ---------------------------------------------------------------------- the one wrapper


def test_a_checked_graph_refuses_before_the_graph_runs_and_counts_replays_and_refusals():
    from megatron_cg_plugin.capture.accounting import ReplayCounter

    calls = []

    def graph(*args, **kwargs):
        calls.append((args, kwargs))
        return "replayed"

    graph.reset = lambda: "reset"
    counter = ReplayCounter(2)
    checked = CheckedGraph(graph, record(), FULL, counter, 1)
    assert checked(x()) == "replayed" and checked.reset() == "reset"
    with pytest.raises(ContractViolation):
        checked(x(8, 2, 3))
    assert len(calls) == 1 and counter.counts == [0, 1] and counter.rejected == [0, 1]
    unchecked = CheckedGraph(graph, None, ContractCheck.OFF)
    assert unchecked(x(8, 2, 3)) == "replayed"


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
    def checked():
        parameter = torch.nn.Parameter(torch.ones(3))
        contract = record(params=[("w", parameter)])
        for _ in range(2):
            contract.check((x(),), {}, mode=FULL)
        return parameter, contract

    assert not outlives_its_holders_with_gc_off(checked)


def test_a_dropped_layer_holding_its_contract_is_freed_without_the_cyclic_collector():
    # The layer holds its graphs and they their contracts (layer.cuda_graphs); the contract's group
    # lookup must not hold the layer back.
    def graphed():
        layer = Layer(tp=process_group(), dp=process_group())
        contract = ReplayContract.record(GRAPH, (x(),), {}, module=layer)
        layer.cuda_graphs = [CheckedGraph(lambda *args: None, contract, FULL)]
        for _ in range(2):
            layer.cuda_graphs[0](x())
        return layer, contract

    assert not outlives_its_holders_with_gc_off(graphed)


def test_a_contract_whose_layer_is_gone_refuses_it_as_groups_gone():
    layer = Layer(tp=process_group())
    contract = ReplayContract.record(GRAPH, (x(),), {}, module=layer)
    STATIC_BUFFERS.append(contract)
    contract.check((x(),), {}, mode=FULL)
    del layer
    gc.collect()
    assert violation(contract, (x(),)).field == "process group"


@pytest.mark.parametrize(
    "extra",
    [
        {"module": torch.nn.Linear(2, 2)},
        {"params": [("w", torch.nn.Parameter(torch.zeros(2)))]},
        {"step_marks": StepMarks()},
    ],
)
def test_a_shared_held_state_is_not_mixed_with_the_makings_of_another(extra):
    held = HeldState.of(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="give held, or the module, params and step_marks to make one"):
        ReplayContract.record(GRAPH, (torch.zeros(2),), {}, held=held, **extra)
