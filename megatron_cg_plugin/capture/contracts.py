"""Replay contracts: what a graph was captured for, checked before every replay (fail closed).

A CUDA graph replays fixed kernels on fixed addresses. TE hands each replay's tensor inputs to the
graph in one of two ways (``graph.py``, ``Graphed.forward``): an input at its static buffer's own
address is read in place, any other is ``copy_``'d into the static buffer. ``copy_`` honours any
memory layout but casts a wrong dtype silently and broadcasts some wrong shapes; an input read in
place must have the captured layout. The graph also keeps reading parameters at their captured
addresses and talking over the captured communicators.

So a contract compares only what changes a replay's result or safety:
- every tensor: shape and dtype (``shapes`` and ``full``); device, and a gradient the capture did
  not compute (``full``);
- a tensor read in place: its strides, ignoring those of size-1 dimensions, which address nothing;
- a tensor to be copied: that its storage does not start where a live static buffer's does (so it
  is not that buffer's storage), which a copy into that buffer would overwrite before it is read;
  storages that share memory from different starting addresses are not seen;
- non-tensor arguments by value, parameters by storage, process groups by identity (``full``);
  both are looked up again where they live (the owner's ``_parameters``, the layer's
  ``pg_collection``), not by walking the module on every replay; a layer's groups are read from
  its collection once per check. This held state is the layer's (``HeldState``), shared by the
  contracts of its graphs, one per microbatch. What a training step cannot change between its
  microbatches (parameters and groups, under Megatron's DDP) is read once per layer per run of
  Megatron's schedule, at the layer's first replay in it, and on every replay outside one; each
  replay checks its call. Megatron-FSDP frees and regathers parameters around each forward, so
  there they are read on every replay.
Arguments are flattened with ``torch.utils._pytree``, so a tensor in a list or dict is checked
like any other; a call whose arguments are each one tensor or value (a Megatron layer's) is read as
it comes, without flattening. A violation names the graph, the field, the captured and the actual
value. ``CheckedGraph`` is where every replay meets its contract.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from megatron_cg_plugin.capture.accounting import ReplayCounter
from megatron_cg_plugin.capture.step_marks import StepMarks
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.console import group_label

__all__ = [
    "CheckedGraph",
    "ContractViolation",
    "FIRST_MICROBATCH",
    "HeldState",
    "REPLAY_ONLY_KWARGS",
    "ReplayContract",
    "StaticInput",
    "TensorSpec",
    "addressed_strides",
    "alias_topology",
    "flatten_call",
    "process_groups_of",
]

# Keyword arguments Megatron adds at replay only; TE consumes them outside the graph.
FIRST_MICROBATCH = "is_first_microbatch"  # True for a step's first microbatch (module.py l.332)
_FIRST = operator.itemgetter(0)
REPLAY_ONLY_KWARGS = frozenset({FIRST_MICROBATCH, "cuda_graph_stream", "cuda_graph_event"})

_HINTS = {
    "shape": "graphs replay fixed shapes: keep --seq-length, --micro-batch-size and the parallel sizes as at capture",
    "dtype": "inputs must keep the captured dtype (TE would cast silently)",
    "stride": "an input passed in the graph's own static buffer is read in place and must keep the captured "
    "memory layout",
    "device": "inputs must stay on the device the graph was captured on",
    "requires_grad": "an input now requires a gradient that the captured backward does not compute",
    "kind": "an input changed between tensor and non-tensor",
    "alias": "an input shares memory with a static buffer of this graph, which copying the inputs in would "
    "overwrite before it is read; pass a separate tensor",
    "control": "a non-tensor argument differs from its captured value; graphs bake control values in",
    "arguments": "the set of arguments differs from the captured call",
    "parameter storage": "a parameter was reallocated after capture (e.g. a checkpoint loaded into new "
    "tensors); copy into the existing parameters, or recapture",
    "process group": "the layer now uses a different process group than at capture; graphs bake in their communicators",
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
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()), tensor.device, tensor.requires_grad)


def addressed_strides(shape: Sequence[int], stride: Sequence[int]) -> tuple[int | None, ...]:
    """The strides that address memory: a size-1 dimension's stride is never used (None here)."""
    return tuple(None if size == 1 else step for size, step in zip(shape, stride, strict=True))


@dataclasses.dataclass(frozen=True)
class StaticInput:
    """A tensor argument as captured: its metadata and where TE's static buffer for it lives.

    The buffer is held weakly: TE keeps it alive as long as the graph; once it is gone its address
    means nothing (a later tensor may land there), so it is neither "read in place" nor aliased."""

    spec: TensorSpec
    data_ptr: int  # an input at this address is read in place, any other is copied in
    storage_ptr: int
    buffer: weakref.ref = dataclasses.field(compare=False, repr=False)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> StaticInput:
        return cls(TensorSpec.of(tensor), _data_ptr(tensor), _storage_ptr(tensor), weakref.ref(tensor))

    @property
    def alive(self) -> bool:
        return self.buffer() is not None


def _storage_ptr(tensor: torch.Tensor) -> int:
    """A tensor's storage address by its type's ``untyped_storage``, as ``_data_ptr`` reads its address."""
    return type(tensor).untyped_storage(tensor).data_ptr()


def _data_ptr(tensor: torch.Tensor) -> int:
    """A tensor's address by its type's ``data_ptr`` (a subclass may override it there), so an
    attribute set on one instance counts nowhere."""
    return type(tensor).data_ptr(tensor)


def alias_topology(tensors: Sequence[torch.Tensor], state: Mapping[str, torch.Tensor] | None = None) -> tuple:
    """Per tensor: ``("state", name)`` if it views module ``state``, else the index of the first
    tensor sharing its storage (itself if none)."""
    state_ptrs = {_storage_ptr(t): name for name, t in (state or {}).items()}
    first: dict[int, int] = {}
    topology = []
    for index, tensor in enumerate(tensors):
        ptr = _storage_ptr(tensor)
        topology.append(("state", state_ptrs[ptr]) if ptr in state_ptrs else first.setdefault(ptr, index))
    return tuple(topology)


def flatten_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Every leaf of a call, named by its place: ``arg0``, ``arg1[2]``, ``mask=``, ``extra=['k']``.
    Replay-only and None keyword arguments are left out (TE drops them as well)."""
    items: list[tuple[str, Any]] = []
    named = [(f"arg{index}", value) for index, value in enumerate(args)]
    # by name alone: a str subclass's == must not send the sort on to the values
    named += [(name, value) for key, value in sorted(kwargs.items(), key=_FIRST) if (name := _keyword_leaf(key, value))]
    for name, value in named:
        if not isinstance(value, (list, tuple, dict)):  # a leaf (the common case): skip pytree's walk
            items.append((name, value))
            continue
        leaves, _ = pytree.tree_flatten_with_path(value)
        items += [(name + pytree.keystr(path), leaf) for path, leaf in leaves]
    return items


def _keyword_leaf(key: str, value: Any) -> str | None:
    """A keyword argument's name among the call's leaves; None for one the contract leaves out."""
    return None if key in REPLAY_ONLY_KWARGS or value is None else f"{key}="


def _same_value(expected: Any, actual: Any) -> bool:
    if expected is actual:
        return True
    try:
        return bool(expected == actual)
    except (RuntimeError, TypeError, ValueError):  # e.g. objects holding tensors: not comparable by value
        return False


@dataclasses.dataclass(frozen=True)
class _Held:
    """State a graph reads in place besides its inputs, found again by ``lookup`` at each check: a
    parameter (``captured``: its storage address; ``lookup``: the parameter now) or a process group
    (``captured``: the object; ``lookup``: the layer's groups by name now, one function shared by
    all of a layer's groups, so a check reads the collection once)."""

    name: str
    captured: Any
    lookup: Callable[[], Any] = dataclasses.field(compare=False, repr=False)


def _parameters_of(module: Any) -> tuple[_Held, ...]:
    """Every parameter of ``module``, looked up again where it lives (its owner's ``_parameters``):
    a parameter replaced by a new one is seen, and the walk over submodules is made only once."""
    return tuple(
        _Held(
            f"{prefix}.{attribute}" if prefix else attribute,
            _data_ptr(param),
            functools.partial(dict.get, owner._parameters, attribute),
        )
        for prefix, owner in module.named_modules()
        for attribute, param in owner._parameters.items()
        if param is not None
    )


def _returning(value: Any) -> Callable[[], Any]:
    """A lookup that finds ``value`` itself, held strongly."""
    return functools.partial(_itself, value)


def _itself(value: Any) -> Any:
    return value


def _groups_of(module: Any) -> tuple[_Held, ...]:
    # By weak reference where the module takes one: the layer holds its graphs, which hold this
    # contract, so a strong one is a cycle that keeps a dropped layer alive under --manual-gc. A layer
    # gone reads as no groups: refused, as a group swapped would be.
    layer: Callable[[], Any]
    try:
        layer = weakref.ref(module)
    except TypeError:  # e.g. types.SimpleNamespace
        layer = _returning(module)

    def groups_now() -> Mapping[str, Any]:  # where process_groups_of found them
        return getattr(getattr(layer(), "pg_collection", None), "__dict__", {})

    return tuple(_Held(name, group, groups_now) for name, group in process_groups_of(module))


_CONTAINERS = (list, tuple, dict)  # arguments whose leaves flatten_call names by place
_STORAGE_OFFSET = torch.Tensor.storage_offset


def _flat_call(inputs: tuple[tuple[str, Any], ...]) -> tuple[int, tuple[str, ...]] | None:
    """How many positional arguments and which keywords (in the contract's order) a call of these
    leaves has, where each argument is one leaf; None where a leaf is named by a place inside one."""
    positional, keys = 0, []
    for name, _ in inputs:
        if name.endswith("="):  # a keyword's leaf; a place inside one ends with "]" or a field
            keys.append(name[:-1])
        elif not keys and name == f"arg{positional}":
            positional += 1
        else:
            return None
    return positional, tuple(keys)


def _reader(lookups: list[Callable[[], Any]]) -> Callable[[], Iterable[Any]]:
    """The objects ``lookups`` return, read in one ``map``: straight from their dicts where every
    lookup is ``partial(dict.get, mapping, key)`` (the parameters of a layer), else call by call."""
    partials = [
        lookup
        for lookup in lookups
        if isinstance(lookup, functools.partial) and lookup.func is dict.get and not lookup.keywords
    ]
    if len(partials) == len(lookups):
        mappings, keys = tuple(lookup.args[0] for lookup in partials), tuple(lookup.args[1] for lookup in partials)
        return lambda: map(dict.get, mappings, keys)
    calls = tuple(lookups)
    return lambda: map(operator.call, calls)


class HeldState:
    """What a layer's graphs read in place besides their calls: its ``parameters`` (by storage) and
    ``process_groups`` (by identity), looked up again where they live. One instance serves every
    contract of the layer (Megatron gives it one graph per microbatch), so ``check`` reads them once
    for all of them: on every check, but for one case. With ``step_marks`` given (the caller does so
    for a model wrapped in Megatron's DDP, which keeps parameters in place within a step), a check
    inside a run of Megatron's schedule reads them at the layer's first replay in that run only.
    Inside one run only the microbatches' forwards and backwards run; whatever moves parameters or
    groups (the optimizer, an evaluation, a checkpoint load, a ``train_step`` of one's own) runs
    outside it, and each run has a count of its own (``step_marks.py``), so the first replay after
    any of those reads them again; a replay outside any run (a training-mode forward of one's own)
    reads them every time."""

    __slots__ = ("parameters", "process_groups", "step_marks", "_read_in", "_parameters_now")

    def __init__(
        self,
        parameters: tuple[_Held, ...] = (),
        process_groups: tuple[_Held, ...] = (),
        *,
        step_marks: StepMarks | None = None,
    ) -> None:
        self.parameters, self.process_groups = parameters, process_groups
        self.step_marks = step_marks
        self._read_in: int | None = None  # the schedule run in which this state was last found as captured
        self._parameters_now = _reader([held.lookup for held in parameters])

    @classmethod
    def of(
        cls,
        module: Any = None,
        *,
        params: Iterable[tuple[str, torch.Tensor]] = (),
        groups: bool = True,
        step_marks: StepMarks | None = None,
    ) -> HeldState:
        """The held state of ``module`` (a Megatron layer): its parameters, looked up in their
        owners' ``_parameters``, and (``groups``) the process groups of its ``pg_collection``; and
        ``params`` (name, parameter) held as they are. ``step_marks``: the run's, where the model
        keeps its parameters in place within a step."""
        held = tuple(_Held(name, _data_ptr(p), _returning(p)) for name, p in params)
        return cls(
            held + (_parameters_of(module) if module is not None else ()),
            _groups_of(module) if module is not None and groups else (),
            step_marks=step_marks,
        )

    def check(self, graph: str) -> None:
        """Raises ``ContractViolation`` (naming ``graph``, the replay that found it) where a
        parameter or process group differs from its capture; inside a run of the schedule, only
        the first check in that run reads them (where it found them as captured)."""
        marks = self.step_marks
        run = None if marks is None else marks.step_now()
        if run is None or run != self._read_in:
            self._read_in = None
            self._read(graph)
            self._read_in = run

    def _read(self, graph: str) -> None:
        for held, now in zip(self.parameters, self._parameters_now()):
            ptr = None if now is None else _data_ptr(now)
            if ptr != held.captured:
                raise ContractViolation(
                    graph, "parameter storage", hex(held.captured), "gone" if ptr is None else hex(ptr), held.name
                )
        source: Callable[[], Any] | None = None
        groups: Mapping[str, Any] = {}
        for held in self.process_groups:
            if held.lookup is not source:  # a layer's groups share one lookup: its collection, read once
                source, groups = held.lookup, held.lookup()
            now = groups.get(held.name)
            if now is not held.captured:
                raise ContractViolation(graph, "process group", group_label(held.captured), group_label(now), held.name)


class ReplayContract:
    """What one graph was captured for, and ``check``, the one test of a replay against it.

    Each call is compared as a whole (``check``: its arguments, tensors and control values). In full
    mode the held state (parameters, process groups: ``HeldState``) is checked too; a layer's
    contracts, one per microbatch, share one, so under ``step_marks`` it is read once per layer per
    run of Megatron's schedule (at the layer's first replay in it), not once per microbatch."""

    __slots__ = ("graph", "inputs", "held", "static_by_storage", "flat_call", "_tensor_at", "__weakref__")

    def __init__(self, graph: str, inputs: tuple[tuple[str, Any], ...], held: HeldState | None = None) -> None:
        self.graph, self.inputs, self.held = graph, inputs, held
        # Storage address -> the static inputs there: what a copied-in input must not alias (alive ones).
        by_storage: dict[int, tuple[StaticInput, ...]] = {}
        for _, value in inputs:
            if isinstance(value, StaticInput):
                by_storage[value.storage_ptr] = (*by_storage.get(value.storage_ptr, ()), value)
        self.static_by_storage: Mapping[int, tuple[StaticInput, ...]] = by_storage
        # (positional count, keywords) where every argument is one leaf: such a call is read without flattening
        self.flat_call = _flat_call(inputs)
        self._tensor_at = tuple(isinstance(value, StaticInput) for _, value in inputs)

    @classmethod
    def record(
        cls,
        graph: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        module: Any = None,
        params: Iterable[tuple[str, torch.Tensor]] = (),
        step_marks: StepMarks | None = None,
        held: HeldState | None = None,
    ) -> ReplayContract:
        """The contract of a graph captured with ``args``/``kwargs``. Its held state is ``held``,
        shared with the other contracts of the same layer, or, where none is given, one of its own:
        ``module``'s parameters and process groups (a Megatron layer) and ``params`` held as they
        are, read once a run under ``step_marks`` (``HeldState.of``)."""
        inputs = tuple(
            (name, StaticInput.of(v) if isinstance(v, torch.Tensor) else v) for name, v in flatten_call(args, kwargs)
        )
        params = tuple(params)
        if held is None:
            held = HeldState.of(module, params=params, step_marks=step_marks)
        elif module is not None or params or step_marks is not None:
            raise ValueError("give held, or the module, params and step_marks to make one: not both")
        return cls(graph, inputs, held)

    def check(self, args: Sequence[Any], kwargs: Mapping[str, Any], mode: ContractCheck = ContractCheck.FULL) -> None:
        """Raises ``ContractViolation`` on the first difference. ``SHAPES`` checks the arguments and
        tensor shape and dtype; ``FULL`` everything in the module docstring; ``OFF`` nothing. Any
        mode but ``SHAPES`` and ``OFF`` is checked in full (fail closed)."""
        if mode == ContractCheck.OFF:
            return
        full = mode != ContractCheck.SHAPES
        values = self._leaves(args, kwargs)
        by_storage = self.static_by_storage
        for (name, expected), is_tensor, value in zip(self.inputs, self._tensor_at, values):
            if not is_tensor:
                if isinstance(value, torch.Tensor):
                    raise ContractViolation(self.graph, "kind", type(expected).__name__, type(value).__name__, name)
                if full and not _same_value(expected, value):
                    raise ContractViolation(self.graph, "control", expected, value, name)
                continue
            if not isinstance(value, torch.Tensor):
                raise ContractViolation(self.graph, "kind", "TensorSpec", type(value).__name__, name)
            spec = expected.spec
            if value.shape != spec.shape:  # torch.Size is a tuple
                raise ContractViolation(self.graph, "shape", spec.shape, tuple(value.shape), name)
            if value.dtype != spec.dtype:
                raise ContractViolation(self.graph, "dtype", spec.dtype, value.dtype, name)
            if not full:
                continue
            if value.device != spec.device:
                raise ContractViolation(self.graph, "device", spec.device, value.device, name)
            if value.requires_grad and not spec.requires_grad:
                raise ContractViolation(self.graph, "requires_grad", spec.requires_grad, value.requires_grad, name)
            kind = type(value)
            ptr = kind.data_ptr(value)
            if ptr == expected.data_ptr and expected.buffer() is not None:  # read in place: the graph's layout
                stride = value.stride()
                if stride != spec.stride and addressed_strides(value.shape, stride) != addressed_strides(
                    spec.shape, spec.stride
                ):
                    raise ContractViolation(self.graph, "stride", spec.stride, tuple(stride), name)
            elif value.numel():
                # A plain tensor's address is its storage's plus its offset (TensorImpl::data): one method call,
                # where untyped_storage() makes a storage object. Any other type may keep its storage apart.
                storage = (
                    ptr - _STORAGE_OFFSET(value) * spec.dtype.itemsize
                    if (kind is torch.Tensor or kind is torch.nn.Parameter)
                    else _storage_ptr(value)
                )
                sharing = by_storage.get(storage)
                if sharing and any(static.alive for static in sharing):
                    raise ContractViolation(self.graph, "alias", "separate memory", "a static buffer's memory", name)
        held = self.held
        if full and held is not None:
            held.check(self.graph)

    def _leaves(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Sequence[Any]:
        """The call's leaves in the contract's order; ``ContractViolation`` (arguments) where their
        names differ. A call of one-leaf arguments is read as it comes; any other is flattened."""
        flat = self.flat_call
        if flat is not None:
            positional, keys = flat
            values = self._flat_leaves(args, kwargs, positional, keys)
            if values is not None:
                return values
        actual = flatten_call(args, kwargs)
        if len(actual) != len(self.inputs) or any(a[0] != e[0] for a, e in zip(actual, self.inputs)):
            raise ContractViolation(self.graph, "arguments", [n for n, _ in self.inputs], [n for n, _ in actual])
        return [value for _, value in actual]

    @staticmethod
    def _flat_leaves(
        args: Sequence[Any], kwargs: Mapping[str, Any], positional: int, keys: tuple[str, ...]
    ) -> list[Any] | None:
        """The leaves of a call that is exactly ``positional`` arguments and ``keys`` (besides the
        keywords flatten_call leaves out), each one leaf; None for any other (flatten_call decides)."""
        if len(args) != positional:
            return None
        present = 0
        for key, value in kwargs.items():
            if value is None:
                continue
            if type(key) is not str:  # a subclass's == or hash may say anything: flatten_call names it
                return None
            if key not in REPLAY_ONLY_KWARGS:
                present += 1
        if present != len(keys):
            return None
        values = list(args)
        for key in keys:
            value = kwargs.get(key)
            if value is None:
                return None
            values.append(value)
        for value in values:
            if isinstance(value, _CONTAINERS):
                return None
        return values


class CheckedGraph:
    """A graphed callable held to its replay contract: each call is checked (``contract.check`` in
    ``mode``; no contract: ``--cg-contract-check off``) before it runs. The one place a contract is
    enforced: TE's graphs under the plugin's helper and slot-shared graphs are both wrapped in it.
    With a ``counter``, replays and refused replays are counted for ``slot``. Every other attribute
    (``reset``, ``backward_dw`` ...) is the graph's, so Megatron's replay and teardown code sees no
    difference."""

    __slots__ = ("graph", "contract", "mode", "_counter", "_slot")

    def __init__(
        self,
        graph: Callable,
        contract: ReplayContract | None,
        mode: ContractCheck,
        counter: ReplayCounter | None = None,
        slot: int = 0,
    ) -> None:
        self.graph, self.contract, self.mode = graph, contract, mode
        self._counter, self._slot = counter, slot

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        counter = self._counter
        if self.contract is not None:
            try:
                self.contract.check(args, kwargs, self.mode)
            except Exception:
                if counter is not None:
                    counter.rejected[self._slot] += 1
                raise
        if counter is not None:
            counter.counts[self._slot] += 1
        return self.graph(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally; "graph" itself is unset while copy/pickle
        # builds an instance, and forwarding it would recurse.
        if name == "graph" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.graph, name)


def process_groups_of(module: Any) -> tuple[tuple[str, Any], ...]:
    """The process groups a Megatron layer holds in its ``pg_collection`` (name, group)."""
    collection = getattr(module, "pg_collection", None)
    if collection is None:
        return ()
    if not torch.distributed.is_available():
        return ()
    return tuple(
        (name, value)
        for name, value in sorted(getattr(collection, "__dict__", {}).items(), key=_FIRST)
        if isinstance(value, torch.distributed.ProcessGroup)
    )
