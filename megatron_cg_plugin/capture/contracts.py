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
  its collection once per check (s90 counted a lookup call per group, 276 a step for 12 replays of
  the Llama-like model). Every check in full mode reads them, but for one case: under Megatron's
  DDP, with the plugin's step marks given, the quick accept skips them on the later microbatches of
  a schedule run whose first microbatch found them as captured (``QuickAccept``). Megatron-FSDP
  frees and regathers parameters around each forward, so there they may move between microbatches.
Arguments are flattened with ``torch.utils._pytree``, so a tensor in a list or dict is checked
like any other. A violation names the graph, the field, the captured and the actual value.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from megatron_cg_plugin.banks.router import group_label
from megatron_cg_plugin.capture.accept_code import Accept, AcceptLayout, accept_function, refuse_all
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.capture.step_marks import StepMarks

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
    def of(cls, tensor: torch.Tensor) -> "StaticInput":
        return cls(TensorSpec.of(tensor), _data_ptr(tensor), _storage_ptr(tensor), weakref.ref(tensor))

    @property
    def alive(self) -> bool:
        return self.buffer() is not None


def _storage_ptr(tensor: torch.Tensor) -> int:
    """A tensor's storage address by its type's ``untyped_storage``, as ``_data_ptr`` reads its address."""
    return type(tensor).untyped_storage(tensor).data_ptr()


def _data_ptr(tensor: torch.Tensor) -> int:
    """A tensor's address by its type's ``data_ptr`` (a subclass may override it there); the quick
    accept reads it the same way, so an attribute set on one instance counts in neither."""
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
class Held:
    """State a graph reads in place besides its inputs, found again by ``lookup`` at each check: a
    parameter (``captured``: its storage address; ``lookup``: the parameter now) or a process group
    (``captured``: the object; ``lookup``: the layer's groups by name now, one function shared by
    all of a layer's groups, so a check reads the collection once)."""

    name: str
    captured: Any
    lookup: Callable[[], Any] = dataclasses.field(compare=False, repr=False)


def _parameters_of(module: Any) -> tuple[Held, ...]:
    """Every parameter of ``module``, looked up again where it lives (its owner's ``_parameters``):
    a parameter replaced by a new one is seen, and the walk over submodules is made only once."""
    return tuple(Held(f"{prefix}.{attribute}" if prefix else attribute, _data_ptr(param),
                      functools.partial(dict.get, owner._parameters, attribute))
                 for prefix, owner in module.named_modules() for attribute, param in owner._parameters.items()
                 if param is not None)


def _returning(value: Any) -> Callable[[], Any]:
    """A lookup that finds ``value`` itself, held strongly."""
    return functools.partial(_itself, value)


def _itself(value: Any) -> Any:
    return value


def _groups_of(module: Any) -> tuple[Held, ...]:
    # By weak reference where the module takes one: the layer holds its graphs, which hold this
    # contract, so a strong one is a cycle that keeps a dropped layer alive under --manual-gc. A layer
    # gone reads as no groups: refused, as a group swapped would be.
    try:
        layer = weakref.ref(module)
    except TypeError:  # e.g. types.SimpleNamespace
        layer = _returning(module)

    def groups_now() -> Mapping[str, Any]:  # where process_groups_of found them
        return getattr(getattr(layer(), "pg_collection", None), "__dict__", {})

    return tuple(Held(name, group, groups_now) for name, group in process_groups_of(module))


_META = operator.attrgetter("shape", "dtype", "device", "requires_grad")  # as the full check reads them
_DATA_PTR = torch.Tensor.data_ptr
# Types whose storage address the quick accept computes (``accept_code._storage_read``): address minus
# offset, exactly their storage's. Other types (a wrapper subclass, say) read their storage.
_STORAGE_BY_OFFSET = (torch.Tensor, torch.nn.Parameter)  # compared by identity: a metaclass's == may lie


def _plain_data_ptr(types: Iterable[type]) -> bool:
    """Whether ``torch.Tensor.data_ptr`` is these types' own ``data_ptr``: the quick accept calls it
    unbound (one ``map``), where the full check calls the type's, which a subclass may override."""
    return all(kind.data_ptr is _DATA_PTR for kind in types)


class QuickAccept:
    """A cheaper test run before the full check on every replay. Anything it does not accept (a
    difference, or a case it does not cover) goes on to the full check, which decides, names what
    differs, and teaches this one the call again.

    Why: inside a training step, where its code and objects are out of cache, the full check cost
    the Llama-like model 2.4% of its step (s93, against the plugin without checks; ~30 us a layer
    replay on the fastest cycles, where a loop of checks takes ~10 us each). Each learned call is
    compiled into one function (``accept_code.py``) that unpacks the call's values and reads each
    one directly: every distinct call costs inside a step, so it makes as few as it can. Metadata is
    read through the tensor's Python attributes, as the full check reads it (s98 tried torch's C++
    tensor guards: a subclass's own ``dtype`` or ``requires_grad`` went unseen, and a nested tensor
    aborted the process).

    It accepts only calls the full check passes, but for the held state it may skip within a step
    (below). Each comparison holds a call to what a call the full check passed (the learned one)
    had, or to something stricter:
    - the positional count, the keywords in order and the values' types equal to the learned call's,
      and its control values (in full mode): the same leaves under the same names, tensors of the
      same types where tensors were, None where None was, the captured control values;
    - each tensor's shape, dtype, device and ``requires_grad`` equal to the learned call's;
    - an input at its static buffer's address: that buffer alive and the captured strides exactly;
      any other input: its storage none of the live static buffers' (when all are copied in, those
      alive when it learned: a buffer alive now was alive then), which is the full check's alias rule;
    - parameters of the learned types at their captured addresses, read with ``torch.Tensor.data_ptr``
      only where that is every learned type's own (else a parameter's check is left to the full one);
    - each group collection holding, under the same names, the objects of the last full check.
    Calls with list, tuple or dict arguments (leaves named by place), tensor types with a
    ``data_ptr`` of their own, and keyword or group names of a ``str`` subclass (whose ``==`` may
    say anything) are left to the full check.

    Parameters and groups (held state) are read on every replay, but for one case. With
    ``step_marks`` given (the caller does so for a model wrapped in Megatron's DDP), a replay marked
    as a step's first microbatch (``is_first_microbatch=True``, which Megatron passes to every graph
    replayed for microbatch 0) that finds them as captured inside a marked run of Megatron's
    schedule (``step_marks.py``: the train-step-timer patch marks the ``forward_backward_func`` it
    hands ``train_step``) lets the replays marked ``False`` skip them until that run ends; any replay
    not marked ``False`` reads them again. Why: inside a step the check's every read costs several
    times what it does in a loop (s95: 37 us a Llama-like layer replay, where the loop takes 8), and
    the held state is most of its reads. It holds because inside one schedule run only the
    microbatches' forwards and backwards run, and under Megatron's DDP they leave parameters and
    process groups where they are (what re-points parameters, a checkpoint load or a train_step of
    one's own, does so outside the schedule). Read every replay: without step marks (Megatron-FSDP,
    torch FSDP2, any other wrapper; graph banks' own contracts, whose calls carry no keyword),
    outside a marked schedule run (a training-mode forward of one's own, which Megatron marks as a
    later microbatch), on a graph never replayed as a first microbatch (one per microbatch under
    pipelining: only graph 0 sees ``True``), and on calls without the keyword."""

    __slots__ = ("inputs", "static_ptrs", "state", "accept")

    def __init__(self, inputs: tuple[tuple[str, Any], ...], parameters: tuple[Held, ...],
                 process_groups: tuple[Held, ...], *, step_marks: StepMarks | None = None) -> None:
        self.inputs = inputs
        self.state = QuickState(tuple(value for _, value in inputs if isinstance(value, StaticInput)), parameters,
                                process_groups, step_marks)
        self.static_ptrs = frozenset(static.data_ptr for static in self.state.statics)
        self.accept: Accept = refuse_all  # compiled for each call learned (accept_code.py)

    def learn(self, args: Sequence[Any], kwargs: Mapping[str, Any], *, full: bool) -> None:
        """After the full check passed this call: its shape, its tensors' metadata and the static
        buffers alive now; in full mode also its parameters' types, its groups' collections and (on
        a step's first microbatch) the step whose later microbatches may skip them."""
        values = (*args, *kwargs.values())
        if any(isinstance(value, (list, tuple, dict)) for value in values):
            return  # leaves named by place: the full check's walk
        if not _plain_names(kwargs):
            return  # a keyword name of a str subclass: its == may say anything
        keys = [f"arg{i}" for i in range(len(args))] + list(kwargs)
        names = keys[:len(args)] + [_keyword_leaf(key, value) for key, value in kwargs.items()]
        where = {name: position for position, name in enumerate(names) if name is not None}
        tensor_at, control_at, controls = [], [], []
        for name, expected in self.inputs:
            if isinstance(expected, StaticInput):
                tensor_at.append(where[name])
            else:
                control_at.append(where[name])
                controls.append(expected)
        tensors = tuple(map(values.__getitem__, tensor_at))
        if not _plain_data_ptr(map(type, tensors)):
            return  # a tensor type with its own data_ptr: the full check calls it
        state = self.state
        typed_at = tuple(position for position, key in enumerate(keys) if key not in REPLAY_ONLY_KWARGS)
        live_storages = frozenset(s.storage_ptr for s in state.statics if s.alive)
        layout = AcceptLayout(len(args), len(kwargs), typed_at, tuple(tensor_at), tuple(control_at), full,
                              reads_storages=bool(live_storages), step_marked=state.step_marks is not None,
                              storage_by_offset=tuple(any(type(tensor) is kind for kind in _STORAGE_BY_OFFSET)
                                                      for tensor in tensors))
        # The metadata the full check just passed: a graph captured with a gradient replayed without
        # one is accepted from now on, not sent to the full check on every replay.
        self.accept = accept_function(
            layout, state, first_keyword=FIRST_MICROBATCH, keys=tuple(kwargs),
            types=tuple(type(values[p]) for p in typed_at),
            metas=tuple(field for tensor in tensors for field in _META(tensor)), controls=tuple(controls),
            static_ptrs=self.static_ptrs, live_storages=live_storages, data_ptr=_DATA_PTR,
            storage_offset=torch.Tensor.storage_offset, storage_ptr=_storage_ptr,
            itemsizes=tuple(tensor.dtype.itemsize for tensor in tensors))
        # the full check read the held state only in full mode
        state.held_at_step = state.held_step_after(kwargs.get(FIRST_MICROBATCH)) if full else None
        if full:
            state.learn_held()

    def accepts(self, args: Sequence[Any], kwargs: Mapping[str, Any], full: bool) -> bool:
        return self.accept(args, kwargs, full)


class QuickState:
    """What a quick accept's compiled function reads besides the call: the static buffers, the held
    state as the last full check found it, and the step whose later microbatches may skip it (the one
    thing the function writes). The function holds this, not its ``QuickAccept`` (which holds the
    function), so no reference cycle keeps a dropped contract's parameters alive until the cyclic
    collector runs (Megatron's ``--manual-gc`` turns it off)."""

    __slots__ = ("statics", "step_marks", "held_at_step", "parameter_ptrs", "parameter_types", "parameters_now",
                 "group_sources", "groups_seen")

    def __init__(self, statics: tuple[StaticInput, ...], parameters: tuple[Held, ...],
                 process_groups: tuple[Held, ...], step_marks: StepMarks | None) -> None:
        self.statics = statics
        self.step_marks = step_marks
        self.held_at_step: int | None = None  # the step whose first microbatch found the held state as captured
        self.parameter_ptrs = tuple(held.captured for held in parameters)
        self.parameter_types: tuple[type, ...] | None = None  # learned by a full check
        self.parameters_now = _reader([held.lookup for held in parameters])
        self.group_sources = tuple(dict.fromkeys(held.lookup for held in process_groups))
        self.groups_seen: tuple[tuple[tuple[str, ...], tuple[Any, ...]], ...] | None = None

    def learn_held(self) -> None:
        """The parameters' types and the group collections, as a full check just found them."""
        parameter_types = tuple(map(type, self.parameters_now()))
        self.parameter_types = parameter_types if _plain_data_ptr(parameter_types) else None
        seen = [source() for source in self.group_sources]
        # a name of a str subclass: read the groups on every replay (groups_seen None refuses)
        self.groups_seen = tuple((tuple(groups), tuple(groups.values())) for groups in seen) if all(
            map(_plain_names, seen)) else None

    def held_step_after(self, first_microbatch: Any) -> int | None:
        """The step whose later microbatches may skip the held state just found as captured on a
        replay with this ``is_first_microbatch``: a first microbatch's, inside a marked step."""
        marks = self.step_marks
        return marks.step_now() if first_microbatch is True and marks is not None else None

    def memory_in_place(self, tensors: tuple[torch.Tensor, ...], ptrs: tuple[int, ...]) -> bool:
        """Where an input is at a static buffer's address: read in place, the captured strides exactly;
        copied in, not in a live static buffer's storage. ``tensors`` in the static inputs' order."""
        live_storages = frozenset(s.storage_ptr for s in self.statics if s.alive)
        for tensor, ptr, static in zip(tensors, ptrs, self.statics):
            if ptr == static.data_ptr:
                if static.buffer() is None or tensor.stride() != static.spec.stride:
                    return False
            elif _storage_ptr(tensor) in live_storages:
                return False
        return True

    def held_accepts(self) -> bool:
        """Parameters of the learned types at their captured addresses; each group collection holding
        the objects of the last full check under the same names, so ``get(name)`` finds what the full
        check found: the captured group."""
        if self.parameter_ptrs:
            parameters = tuple(self.parameters_now())
            # Unequal too where none were learned (None: no full check yet, or a type with its own data_ptr)
            if tuple(map(type, parameters)) != self.parameter_types:  # one gone (None) or of another type
                return False
            if tuple(map(_DATA_PTR, parameters)) != self.parameter_ptrs:
                return False
        seen = self.groups_seen
        if seen is None:
            return not self.group_sources
        for source, (names, groups) in zip(self.group_sources, seen):
            now = source()
            if not _same_names(now, names) or not all(map(operator.is_, now.values(), groups)):
                return False
        return True


def _plain_names(mapping: Mapping[Any, Any]) -> bool:
    return all(type(name) is str for name in mapping)


def _same_names(mapping: Mapping[Any, Any], names: tuple[str, ...]) -> bool:
    """``mapping``'s keys are ``names`` (plain ``str``), in order: by identity (attribute names are
    interned), else as plain ``str`` by value; a subclass's ``==`` may say anything."""
    if len(mapping) != len(names):
        return False
    return all(map(operator.is_, mapping, names)) or all(
        type(name) is str and name == learned for name, learned in zip(mapping, names))


def _reader(lookups: list[Callable[[], Any]]) -> Callable[[], Iterable[Any]]:
    """The objects ``lookups`` return, read in one ``map``: straight from their dicts where every
    lookup is ``partial(dict.get, mapping, key)`` (the parameters of a layer), else call by call."""
    if all(isinstance(lookup, functools.partial) and lookup.func is dict.get and not lookup.keywords
           for lookup in lookups):
        mappings, keys = tuple(lookup.args[0] for lookup in lookups), tuple(lookup.args[1] for lookup in lookups)
        return lambda: map(dict.get, mappings, keys)
    calls = tuple(lookups)
    return lambda: map(operator.call, calls)


@dataclasses.dataclass(frozen=True)
class ReplayContract:
    graph: str
    inputs: tuple[tuple[str, Any], ...]  # (name, StaticInput or control value)
    parameters: tuple[Held, ...]
    process_groups: tuple[Held, ...]
    # Storage address -> the static inputs there: what a copied-in input must not alias (alive ones).
    static_by_storage: Mapping[int, tuple[StaticInput, ...]] = dataclasses.field(compare=False, repr=False)
    quick: "QuickAccept | None" = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def of_inputs(cls, graph: str, inputs: tuple[tuple[str, Any], ...], parameters: tuple[Held, ...] = (),
                  process_groups: tuple[Held, ...] = (), *, step_marks: StepMarks | None = None) -> "ReplayContract":
        by_storage: dict[int, tuple[StaticInput, ...]] = {}
        for _, value in inputs:
            if isinstance(value, StaticInput):
                by_storage[value.storage_ptr] = by_storage.get(value.storage_ptr, ()) + (value,)
        return cls(graph, inputs, parameters, process_groups, by_storage,
                   QuickAccept(inputs, parameters, process_groups, step_marks=step_marks))

    @classmethod
    def record(cls, graph: str, args: Sequence[Any], kwargs: Mapping[str, Any], *, module: Any = None,
               params: Iterable[tuple[str, torch.Tensor]] = (), step_marks: StepMarks | None = None) -> "ReplayContract":
        """The contract of a graph captured with ``args``/``kwargs``: ``module``'s parameters and
        process groups (a Megatron layer), or ``params`` held as they are (slot-shared capture).
        ``step_marks``: the run's, where the model keeps its parameters in place within a step
        (``QuickAccept``)."""
        inputs = tuple((name, StaticInput.of(v) if isinstance(v, torch.Tensor) else v)
                       for name, v in flatten_call(args, kwargs))
        held = tuple(Held(name, _data_ptr(p), _returning(p)) for name, p in params)
        return cls.of_inputs(graph, inputs, held + (_parameters_of(module) if module is not None else ()),
                             _groups_of(module) if module is not None else (), step_marks=step_marks)

    def static_storages(self) -> frozenset[int]:
        """The storages of the static buffers still alive."""
        return frozenset(ptr for ptr, values in self.static_by_storage.items() if any(v.alive for v in values))

    def check(self, args: Sequence[Any], kwargs: Mapping[str, Any], *, mode: ContractCheck) -> None:
        """Raises ``ContractViolation`` on the first difference. ``SHAPES`` checks the arguments and
        tensor shape and dtype; ``FULL`` everything in the module docstring; ``OFF`` nothing."""
        if mode != ContractCheck.OFF:
            self.check_as(mode != ContractCheck.SHAPES, args, kwargs)

    def replay_check(self, mode: ContractCheck) -> Callable[[Sequence[Any], Mapping[str, Any]], None]:
        """``check`` with ``mode`` bound, for the replay's path: ``check(args, kwargs)``. A closure that
        calls the quick accept itself: each call on the way costs inside a step."""
        if mode == ContractCheck.OFF:
            return functools.partial(_unchecked)
        full, quick, check_and_learn = mode != ContractCheck.SHAPES, self.quick, self._check_and_learn
        if quick is None:
            return functools.partial(check_and_learn, full)

        def check(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            if not quick.accept(args, kwargs, full):
                check_and_learn(full, args, kwargs)

        return check

    def check_as(self, full: bool, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """The quick accept, else the full check (``full``: in full mode; any mode but ``SHAPES`` and
        ``OFF`` is checked in full: fail closed), which then teaches the quick accept the call."""
        if self.quick is None or not self.quick.accept(args, kwargs, full):
            self._check_and_learn(full, args, kwargs)

    def _check_and_learn(self, full: bool, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self._check_in_full(args, kwargs, full=full)
        if self.quick is not None:
            self.quick.learn(args, kwargs, full=full)

    def _check_in_full(self, args: Sequence[Any], kwargs: Mapping[str, Any], *, full: bool) -> None:
        actual = flatten_call(args, kwargs)
        if len(actual) != len(self.inputs) or any(a[0] != e[0] for a, e in zip(actual, self.inputs)):
            raise ContractViolation(self.graph, "arguments", [n for n, _ in self.inputs], [n for n, _ in actual])
        for (name, expected), (_, value) in zip(self.inputs, actual, strict=True):
            if isinstance(expected, StaticInput) != isinstance(value, torch.Tensor):
                captured_kind = "TensorSpec" if isinstance(expected, StaticInput) else type(expected).__name__
                raise ContractViolation(self.graph, "kind", captured_kind, type(value).__name__, name)
            if isinstance(value, torch.Tensor):
                self._check_tensor(name, expected, value, full=full)
            elif full and not _same_value(expected, value):
                raise ContractViolation(self.graph, "control", expected, value, name)
        if full:
            self._check_held()

    def _check_held(self) -> None:
        for held in self.parameters:
            now = held.lookup()
            ptr = None if now is None else _data_ptr(now)
            if ptr != held.captured:
                raise ContractViolation(self.graph, "parameter storage", hex(held.captured),
                                        "gone" if ptr is None else hex(ptr), held.name)
        source = groups = None
        for held in self.process_groups:
            if held.lookup is not source:  # a layer's groups share one lookup: its collection, read once
                source, groups = held.lookup, held.lookup()
            now = groups.get(held.name)
            if now is not held.captured:
                raise ContractViolation(self.graph, "process group", group_label(held.captured), group_label(now),
                                        held.name)

    def _check_tensor(self, name: str, static: StaticInput, value: torch.Tensor, *, full: bool) -> None:
        spec = static.spec
        if value.shape != spec.shape:  # torch.Size is a tuple
            raise ContractViolation(self.graph, "shape", spec.shape, tuple(value.shape), name)
        if value.dtype != spec.dtype:
            raise ContractViolation(self.graph, "dtype", spec.dtype, value.dtype, name)
        if not full:
            return
        if value.device != spec.device:
            raise ContractViolation(self.graph, "device", spec.device, value.device, name)
        if value.requires_grad and not spec.requires_grad:
            raise ContractViolation(self.graph, "requires_grad", spec.requires_grad, value.requires_grad, name)
        if _data_ptr(value) == static.data_ptr and static.alive:  # read in place: the layout is the graph's
            stride = value.stride()
            if stride != spec.stride and addressed_strides(value.shape, stride) != addressed_strides(spec.shape,
                                                                                                      spec.stride):
                raise ContractViolation(self.graph, "stride", spec.stride, tuple(stride), name)
        elif value.numel():
            sharing = self.static_by_storage.get(_storage_ptr(value))
            if sharing and any(static.alive for static in sharing):
                raise ContractViolation(self.graph, "alias", "separate memory", "a static buffer's memory", name)


def _unchecked(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """``--cg-contract-check off``."""


def process_groups_of(module: Any) -> tuple[tuple[str, Any], ...]:
    """The process groups a Megatron layer holds in its ``pg_collection`` (name, group)."""
    collection = getattr(module, "pg_collection", None)
    if collection is None:
        return ()
    if not torch.distributed.is_available():
        return ()
    return tuple((name, value) for name, value in sorted(getattr(collection, "__dict__", {}).items(), key=_FIRST)
                 if isinstance(value, torch.distributed.ProcessGroup))
