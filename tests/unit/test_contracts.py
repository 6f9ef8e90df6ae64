"""Tests for megatron_cg_plugin.capture.contracts: what a graph was captured for, checked before
every replay (on CPU tensors)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_cg_plugin.capture import contracts
from megatron_cg_plugin.capture.contracts import (
    CONTRACT_MODES,
    REPLAY_ONLY_KWARGS,
    ContractViolation,
    ReplayContract,
    TensorSpec,
    process_groups_of,
)

GRAPH = "layer 7 microbatch 1"


def x(*shape, dtype=torch.float32, requires_grad=False):
    return torch.zeros(*(shape or (4, 2, 3)), dtype=dtype, requires_grad=requires_grad)


def record(args=None, kwargs=None, params=(), groups=()):
    return ReplayContract.record(GRAPH, (x(),) if args is None else args, kwargs or {}, params, groups)


def violation(contract, args, kwargs=None, mode="full", params=(), groups=()) -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        contract.check(args, kwargs or {}, mode=mode, params=params, process_groups=groups)
    return info.value


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
    assert contract.inputs[0][1] == TensorSpec((4, 2, 3), torch.float32, (6, 3, 1), torch.device("cpu"), True)
    assert contract.inputs[1] == ("arg1", 3)
    assert contract.inputs[2] == ("flag=", "causal")
    assert contract.alias == (0, 1)
    assert contract.param_storage == () and contract.process_groups == ()


def test_matching_replay_passes_in_every_mode():
    p = torch.nn.Parameter(torch.ones(3))
    group = object()
    contract = record((x(requires_grad=True), 2), {"mask": x(1, 1)}, [("w", p)], [("tp", group)])
    for mode in CONTRACT_MODES:
        contract.check((x(requires_grad=True), 2), {"mask": x(1, 1)}, mode=mode, params=[("w", p)],
                       process_groups=[("tp", group)])


# ====================================================================== per field


def test_shape():
    error = violation(record(), (x(8, 2, 3),))
    assert_message(error, "shape", (4, 2, 3), (8, 2, 3), "arg0")


def test_shape_in_kwargs_names_the_kwarg():
    error = violation(record(kwargs={"mask": x(1, 4)}), (x(),), {"mask": x(1, 5)}, mode="shapes")
    assert_message(error, "shape", (1, 4), (1, 5), "mask=")


def test_dtype():
    error = violation(record(), (x(dtype=torch.float16),), mode="shapes")
    assert_message(error, "dtype", torch.float32, torch.float16, "arg0")


def test_stride_full_only():
    contract = record()
    strided = x(2, 4, 3).transpose(0, 1)
    assert strided.shape == (4, 2, 3)
    contract.check((strided,), {}, mode="shapes")
    assert_message(violation(contract, (strided,)), "stride", (6, 3, 1), (3, 12, 1), "arg0")


def test_device_with_meta_tensors():
    contract = record()
    meta = torch.zeros(4, 2, 3, device="meta")
    contract.check((meta,), {}, mode="shapes")
    assert_message(violation(contract, (meta,)), "device", torch.device("cpu"), torch.device("meta"), "arg0")


def test_requires_grad():
    contract = record((x(requires_grad=True),))
    contract.check((x(),), {}, mode="shapes")
    assert_message(violation(contract, (x(),)), "requires_grad", True, False, "arg0")


def test_kind_tensor_versus_non_tensor():
    contract = record((x(), 1))
    assert_message(violation(contract, (x(), x())), "kind", "int", "Tensor", "arg1")
    assert_message(violation(contract, (5, 1), mode="shapes"), "kind", "TensorSpec", "int", "arg0")


def test_alias_pattern_shared_at_capture_not_at_replay():
    base = torch.zeros(8, 3)
    contract = record((base[:4], base[4:]))
    assert contract.alias == (0, 0)
    contract.check((x(4, 3), x(4, 3)), {}, mode="shapes")
    assert_message(violation(contract, (x(4, 3), x(4, 3))), "alias", (0, 0), (0, 1))
    other = torch.ones(8, 3)
    contract.check((other[:4], other[4:]), {}, mode="full")  # shared again: fine


def test_alias_pattern_separate_at_capture_shared_at_replay():
    contract = record((x(4, 3), x(4, 3)))
    shared = x(4, 3)
    assert_message(violation(contract, (shared, shared)), "alias", (0, 1), (0, 0))


def test_control_values():
    contract = record((x(), 2), {"mode": "causal"})
    contract.check((x(), 3), {"mode": "padding"}, mode="shapes")  # not checked in shapes
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
    contract.check((x(),), {}, mode="full", params=[("w", p), ("b", q)])
    p.data.copy_(torch.full((3,), 2.0))  # in place: same storage, fine
    contract.check((x(),), {}, mode="full", params=[("w", p), ("b", q)])
    old = hex(q.data_ptr())
    q.data = torch.zeros(2)  # a checkpoint loaded into new tensors
    error = violation(contract, (x(),), params=[("w", p), ("b", q)])
    assert_message(error, "parameter storage", old, hex(q.data_ptr()), "b")
    contract.check((x(),), {}, mode="shapes", params=[("w", p), ("b", q)])


def test_process_groups_by_identity():
    tp, dp = types.SimpleNamespace(name="tp"), types.SimpleNamespace(name="dp")
    contract = record(groups=[("dp", dp), ("tp", tp)])
    contract.check((x(),), {}, mode="full", process_groups=[("dp", dp), ("tp", tp)])
    lookalike = types.SimpleNamespace(name="tp")
    assert lookalike == tp  # equal, but a different communicator
    error = violation(contract, (x(),), groups=[("dp", dp), ("tp", lookalike)])
    assert_message(error, "process group", contracts.group_label(tp), contracts.group_label(lookalike), "tp")
    assert f"{id(tp):#x}" in str(error) and f"{id(lookalike):#x}" in str(error)
    contract.check((x(),), {}, mode="shapes", process_groups=[("dp", dp), ("tp", lookalike)])


# ====================================================================== modes and ignored kwargs


def test_off_checks_nothing():
    contract = record((x(requires_grad=True), 1), {"mask": x(1)}, [("w", torch.nn.Parameter(torch.ones(1)))])
    contract.check((), {"other": 5}, mode="off")
    contract.check(("not a tensor",), {}, mode="off", params=[("w", torch.nn.Parameter(torch.ones(1)))])


def test_shapes_checks_only_shape_dtype_kind_and_arguments():
    base = torch.zeros(8, 3)
    p = torch.nn.Parameter(torch.ones(1))
    contract = record((base[:4], base[4:], 1), params=[("w", p)], groups=[("tp", object())])
    p.data = torch.zeros(1)
    contract.check((x(4, 3, requires_grad=True), x(8, 3)[::2], 2), {}, mode="shapes",
                   params=[("w", p)], process_groups=[("tp", object())])
    assert violation(contract, (x(4, 3), x(4, 4), 1), mode="shapes").field == "shape"


@pytest.mark.parametrize("name", sorted(REPLAY_ONLY_KWARGS))
def test_replay_only_kwargs_are_ignored(name):
    contract = record()
    contract.check((x(),), {name: object()}, mode="full")
    at_capture = ReplayContract.record(GRAPH, (x(),), {name: True})
    at_capture.check((x(),), {}, mode="full")
    assert REPLAY_ONLY_KWARGS == {"is_first_microbatch", "cuda_graph_stream", "cuda_graph_event"}


def test_none_kwargs_are_ignored():
    contract = record(kwargs={"rotary_pos_emb": None, "mask": x(1)})
    contract.check((x(),), {"mask": x(1)}, mode="full")
    contract.check((x(),), {"mask": x(1), "rotary_pos_emb": None, "packed_seq_params": None}, mode="full")


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

    layer = types.SimpleNamespace(pg_collection=collection)
    contract = record(groups=process_groups_of(layer))
    contract.check((x(),), {}, mode="full", process_groups=process_groups_of(layer))
    collection.tp = dist.ProcessGroup(dist.HashStore(), 0, 1)  # re-created communicator
    assert violation(contract, (x(),), groups=process_groups_of(layer)).field == "process group"
