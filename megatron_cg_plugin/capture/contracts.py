"""Replay contracts: what a graph was captured for, checked before every replay (fail closed).

A CUDA graph replays fixed kernels on fixed addresses. TE copies new inputs into the captured
static buffers with ``copy_``, which silently casts a wrong dtype and broadcasts some wrong shapes,
and the graph keeps reading parameters at their captured addresses and talking over the captured
communicators. So each graph records, at capture, the metadata of its tensor inputs, their alias
pattern, its non-tensor control values, the storage of its layer's parameters and the identity of
its process groups; each replay is checked against that record and refused with the field, the
captured value and the actual value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import torch

CONTRACT_MODES = ("full", "shapes", "off")
# Keyword arguments Megatron adds at replay only; TE consumes them outside the graph.
REPLAY_ONLY_KWARGS = frozenset({"is_first_microbatch", "cuda_graph_stream", "cuda_graph_event"})

_HINTS = {
    "shape": "graphs replay fixed shapes: keep --seq-length, --micro-batch-size and the parallel sizes as at capture",
    "dtype": "inputs must keep the captured dtype (TE would cast silently)",
    "stride": "inputs must keep the captured memory layout; make them contiguous as at capture",
    "device": "inputs must stay on the device the graph was captured on",
    "requires_grad": "requires_grad of an input changed; the captured backward assumes the old value",
    "kind": "an input changed between tensor and non-tensor",
    "alias": "inputs that shared storage at capture must share it now (and vice versa)",
    "control": "a non-tensor argument differs from its captured value; graphs bake control values in",
    "arguments": "the set of arguments differs from the captured call",
    "parameter storage": "a parameter was reallocated after capture (e.g. a checkpoint loaded into new "
                         "tensors); copy into the existing parameters, or recapture",
    "process group": "the layer now uses a different process group than at capture; graphs bake in "
                     "their communicators",
}


class ContractViolation(RuntimeError):
    """A replay whose inputs or state differ from what its graph was captured for."""

    def __init__(self, graph: str, field: str, captured: Any, actual: Any, where: str = "") -> None:
        self.graph, self.field, self.captured, self.actual = graph, field, captured, actual
        hint = _HINTS.get(field, "")
        location = f" ({where})" if where else ""
        super().__init__(
            f"CUDA graph replay refused for {graph}: {field}{location} was {captured!r} at capture, "
            f"is {actual!r} now. {hint}. (--cg-contract-check off disables this check.)"
        )


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        return cls(tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()), tensor.device, tensor.requires_grad)


def alias_topology(tensors: Sequence[torch.Tensor], state: Mapping[str, torch.Tensor] | None = None) -> tuple:
    """Per tensor: ``("state", name)`` if it views module ``state``, else the index of the first
    tensor sharing its storage (itself if none)."""
    state_ptrs = {t.untyped_storage().data_ptr(): name for name, t in (state or {}).items()}
    first: dict[int, int] = {}
    topology = []
    for index, tensor in enumerate(tensors):
        ptr = tensor.untyped_storage().data_ptr()
        topology.append(("state", state_ptrs[ptr]) if ptr in state_ptrs else first.setdefault(ptr, index))
    return tuple(topology)


def _flatten(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    items = [(f"arg{i}", value) for i, value in enumerate(args)]
    items += [(f"{key}=", value) for key, value in sorted(kwargs.items())
              if key not in REPLAY_ONLY_KWARGS and value is not None]
    return items


@dataclasses.dataclass(frozen=True)
class ReplayContract:
    graph: str
    inputs: tuple[tuple[str, Any], ...]  # (name, TensorSpec or control value)
    alias: tuple[int, ...]
    param_storage: tuple[tuple[str, int], ...]
    process_groups: tuple[tuple[str, Any], ...]  # (name, group object): compared by identity

    @classmethod
    def record(cls, graph: str, args: Sequence[Any], kwargs: Mapping[str, Any],
               params: Iterable[tuple[str, torch.Tensor]] = (),
               process_groups: Iterable[tuple[str, Any]] = ()) -> "ReplayContract":
        inputs = _flatten(args, kwargs)
        tensors = [value for _, value in inputs if isinstance(value, torch.Tensor)]
        return cls(
            graph=graph,
            inputs=tuple((name, TensorSpec.of(v) if isinstance(v, torch.Tensor) else v) for name, v in inputs),
            alias=alias_topology(tensors),
            param_storage=tuple((name, p.data_ptr()) for name, p in params),
            process_groups=tuple(process_groups),
        )

    def check(self, args: Sequence[Any], kwargs: Mapping[str, Any], *, mode: str,
              params: Iterable[tuple[str, torch.Tensor]] = (),
              process_groups: Iterable[tuple[str, Any]] = ()) -> None:
        """Raises ``ContractViolation`` on the first difference. ``shapes`` checks tensor shape and
        dtype only; ``full`` everything; ``off`` nothing."""
        if mode == "off":
            return
        actual = _flatten(args, kwargs)
        names = [name for name, _ in actual]
        if names != [name for name, _ in self.inputs]:
            raise ContractViolation(self.graph, "arguments", [n for n, _ in self.inputs], names)
        tensors = []
        for (name, expected), (_, value) in zip(self.inputs, actual):
            if isinstance(expected, TensorSpec) != isinstance(value, torch.Tensor):
                raise ContractViolation(self.graph, "kind", type(expected).__name__, type(value).__name__, name)
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                self._check_tensor(name, expected, value, full=mode == "full")
            elif mode == "full" and value != expected:
                raise ContractViolation(self.graph, "control", expected, value, name)
        if mode != "full":
            return
        alias = alias_topology(tensors)
        if alias != self.alias:
            raise ContractViolation(self.graph, "alias", self.alias, alias)
        for (name, ptr), (_, param) in zip(self.param_storage, params):
            if param.data_ptr() != ptr:
                raise ContractViolation(self.graph, "parameter storage", hex(ptr), hex(param.data_ptr()), name)
        for (name, group), (_, now) in zip(self.process_groups, process_groups):
            if now is not group:
                raise ContractViolation(self.graph, "process group", group_label(group), group_label(now), name)

    def _check_tensor(self, name: str, spec: TensorSpec, value: torch.Tensor, *, full: bool) -> None:
        if tuple(value.shape) != spec.shape:
            raise ContractViolation(self.graph, "shape", spec.shape, tuple(value.shape), name)
        if value.dtype != spec.dtype:
            raise ContractViolation(self.graph, "dtype", spec.dtype, value.dtype, name)
        if not full:
            return
        if tuple(value.stride()) != spec.stride:
            raise ContractViolation(self.graph, "stride", spec.stride, tuple(value.stride()), name)
        if value.device != spec.device:
            raise ContractViolation(self.graph, "device", spec.device, value.device, name)
        if value.requires_grad != spec.requires_grad:
            raise ContractViolation(self.graph, "requires_grad", spec.requires_grad, value.requires_grad, name)


def group_label(group: Any) -> str:
    return "None" if group is None else f"{type(group).__name__}@{id(group):#x}"


def process_groups_of(module: Any) -> tuple[tuple[str, Any], ...]:
    """The process groups a Megatron layer holds in its ``pg_collection`` (name, group)."""
    collection = getattr(module, "pg_collection", None)
    if collection is None:
        return ()
    if not torch.distributed.is_available():
        return ()
    return tuple((name, value) for name, value in sorted(getattr(collection, "__dict__", {}).items())
                 if isinstance(value, torch.distributed.ProcessGroup))
