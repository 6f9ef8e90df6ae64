"""Slot-shared capture: mutually exclusive variants of the same layers in one CUDA graph pool.

TE 2.20.2's ``make_graphed_callables`` keeps a forward's backward state in pool blocks that the
allocator hands to the next capture sharing the pool once that backward is captured, so replays of
two variants that interleave (A.fwd, B.fwd, A.bwd) corrupt each other. Here each variant is
captured once per slot of a slot ring (``slot_sharing.plan``), all into one pool, and everything the
forward leaves for its backward is copied, inside the forward graph, into the slot's arena
(``slot_sharing.saved_tensors``): tensors saved through ``save_for_backward`` and tensors kept on ``ctx``.
Arenas and every graph boundary (inputs, outputs, incoming and returned gradients) live outside the
pool, allocated before capture; the pool then only holds each graph's temporaries, which the
captures may share freely because graphs replay one at a time on one stream. After each forward
capture the pool must hold no block that the capture left alive besides the outputs (checked from
the allocator's snapshot: ``SlotCoverageError`` otherwise), so nothing the backward reads can be
handed to another capture.

Sizes: one arena per slot, sized by the largest variant measured at warmup; boundary storage per
(slot, I/O branch): variants with identical boundary layouts share it (as do variants naming the
same ``io_branch``, which must then have identical layouts: ``slot_sharing.branches``); parameter
gradients go through one buffer shared by every graph and are cloned after each backward replay
(autograd may keep a returned gradient as ``.grad``), and captures that replay one at a time may
share those buffers too (``slot_sharing.param_grads``); parameters no warmup gave a gradient get none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch

from megatron_cg_plugin.capture import accounting, stale_graphs
from megatron_cg_plugin.capture import te_backend as te_seam
from megatron_cg_plugin.capture.contracts import CheckedGraph, HeldState, ReplayContract
from megatron_cg_plugin.capture.step_marks import StepMarks
from megatron_cg_plugin.capture.transaction import CaptureTransaction
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.slot_sharing import fp8_state
from megatron_cg_plugin.slot_sharing.branches import BranchSignature, check_branches
from megatron_cg_plugin.slot_sharing.guard import SlotGuard
from megatron_cg_plugin.slot_sharing.layout import span_elements, span_of
from megatron_cg_plugin.slot_sharing.offload_arenas import (
    CudaTransfers,
    HostArena,
    OffloadingArenaHooks,
    StagedArenaHooks,
    Transfers,
)
from megatron_cg_plugin.slot_sharing.offload_plan import (
    OffloadPlan,
    OffloadPolicy,
    OffloadStack,
    Save,
    host_arena_bytes,
    plan_offload,
)
from megatron_cg_plugin.slot_sharing.offload_staging import StagedFrame, StagingRing
from megatron_cg_plugin.slot_sharing.param_grads import ParamGradBuffers
from megatron_cg_plugin.slot_sharing.plan import SlotPlan, per_slot_max
from megatron_cg_plugin.slot_sharing.saved_tensors import Arena, ArenaHooks, ArenaSizer, no_call_objects, storage_keys

__all__ = [
    "SlotCoverageError",
    "SlotFp8",
    "SlotOffload",
    "SlottedGraphs",
    "SlottedStats",
    "Surface",
    "Variant",
    "capture_slotted",
    "io_branches",
    "planned_slots",
    "slot_arena_bytes",
]


class SlotCoverageError(RuntimeError):
    """A forward capture left pool memory alive that no arena protects."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One graph variant: ``fn(*sample_args)`` returns a tensor or a tuple of tensors.

    Variants with the same ``io_branch`` share boundary storage in each slot (their inputs, outputs
    and gradients must then have identical layouts, or capture is refused); without one, variants
    share it exactly when their layouts are identical. As with TE's graphs, the sample tensors may
    become the static inputs of a slot (``_Boundary``): replays write their arguments into them, so
    keep no other use for them.
    """

    name: Hashable
    fn: Callable[..., Any]
    sample_args: tuple[torch.Tensor, ...]
    io_branch: Hashable | None = None


@dataclasses.dataclass(frozen=True)
class SlotOffload:
    """Activation offload for slot-shared capture (``slot_sharing.offload_arenas``): ``policy`` selects saves by
    Megatron's offload group, ``group`` names the group running now (for Megatron's layers:
    ``slot_sharing.offload_groups.OffloadGroupTracker.current``). The copies run inside the graphs
    through the engine ``transfers`` makes, or, with ``staging``, between replays through that
    ring of staging buffers (``slot_sharing.offload_staging``)."""

    policy: OffloadPolicy
    group: Callable[[], str | None]
    transfers: Callable[[], Transfers] = CudaTransfers
    # Given: the copies run between replays through this ring of staging buffers, shared by every
    # capture that passes it (slot_sharing.offload_staging); None: inside the graphs, through ``transfers``.
    staging: StagingRing | None = None
    # In-graph copies: offload groups whose copies may run beside the one being staged or unpacked
    # (more overlap, more staging and reload buffers alive in the pool; slot_sharing.offload_arenas).
    window: int = 1
    # The variants are layer ``layer_index`` of ``stack``: Megatron's choice across the layers
    # (slot_sharing.offload_plan); None: the frames are planned alone.
    stack: OffloadStack | None = None
    layer_index: int = 0

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"offload window {self.window}: use 0 or more groups (--cg-offload-window).")
        assert self.stack is None or self.stack.policy == self.policy, "one policy for the stack and its layers"

    def plan(self, variant: Hashable, saves: Sequence[Save]) -> OffloadPlan:
        if self.stack is None:
            return plan_offload(saves, self.policy)
        return self.stack.plan(saves, self.layer_index, variant)


@dataclasses.dataclass(frozen=True)
class SlotFp8:
    """FP8 for the variants of one capture, as TE's ``make_graphed_callables`` takes it: warmup and
    capture run under TE's graph autocast with ``recipe`` and the amax reduction ``group``
    (``enabled=False``: a layer kept in bf16). Delayed or current scaling (``fp8_state.slot_fp8_refusal``).
    ``modules`` are the modules the variants call (Megatron: the layer). Their FP8 weight workspaces
    are shared by every frame, so saves of them are not copied into arenas. Under delayed scaling,
    their amax histories and scales come back as they were after capture, and replays join TE's amax
    reduction. Each module quantizes its weight into its workspace inside the graph, under TE's
    weight-update flag: a replay refreshes the workspace unless called with
    ``update_fp8_weights=False`` (Megatron: every microbatch but the first). ``modules`` must hold
    every TE module the variants call: a quantizer outside them counts as a per-call copy. Refused:
    te.ops fused operations (they run without module hooks). Not covered: modules only some
    variants reach (under delayed scaling every replay joins all visited ones)."""

    recipe: Any
    group: Any = None
    enabled: bool = True
    modules: tuple[Any, ...] = ()
    # False only to show what it protects: TE's per-call quantizer copies (FP8 attention's S-scale
    # snapshot) stay in the pool, where another variant's replay can overwrite them.
    snapshot_attention_scales: bool = True


@dataclasses.dataclass(frozen=True)
class SlottedStats:
    ring_size: int
    variants: int
    graphs: int
    capture_seconds: float
    pool_bytes: int  # reserved by the shared pool
    arena_bytes: int
    slot_arena_bytes: tuple[int, ...]  # per slot: the largest frame of the variants the plan puts there
    boundary_bytes: int  # inputs it copied (adopted samples are the caller's), outputs, incoming and returned
    # gradients, the parameter-gradient buffers it added
    saved_bytes: dict[Hashable, int]  # per variant, measured at warmup
    ctx_tensors: dict[Hashable, int]  # per variant: tensors found on ctx and protected
    retained_bytes: int  # pool blocks still allocated after every capture (library workspaces)
    uncovered_bytes: int  # backward state outside the arenas (0 when protected; strict refuses more)
    offloaded_bytes: dict[Hashable, int] = dataclasses.field(default_factory=dict)  # per variant, to the host
    host_arena_bytes: tuple[int, ...] = ()  # pinned: per slot (in-graph copies) or per graph (between replays)
    staging_bytes: int = 0  # GPU staging buffers this capture added to the ring (between replays)


# ---------------------------------------------------------------------------------------------- storage
class Surface:
    """Boundary storage with a tensor's layout (shape, stride, dtype) outside any pool. ``load``
    copies a tensor of that layout in by its addressed span, so transposed, strided and expanded
    (self-overlapping) tensors keep their layout and nothing is materialized twice."""

    def __init__(self, like: torch.Tensor) -> None:
        self.buffer = torch.empty(span_elements(like), dtype=like.dtype, device=like.device)
        self.view = self.buffer.as_strided(tuple(like.shape), tuple(like.stride()), 0)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def load(self, tensor: torch.Tensor) -> None:
        if span_elements(tensor) and tensor.stride() == self.view.stride():
            span_of(self.view).copy_(span_of(tensor))
        else:
            self.view.copy_(tensor)


def _as_tuple(outputs: Any, variant: Hashable) -> tuple[torch.Tensor, ...]:
    items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    if not all(isinstance(item, torch.Tensor) for item in items):
        raise TypeError(
            f"variant {variant!r}: fn must return a tensor or a tuple of tensors, got "
            f"{[type(item).__name__ for item in items]}; wrap it to return only tensors."
        )
    return tuple(items)


# ---------------------------------------------------------------------------------------------- warmup
@dataclasses.dataclass(frozen=True)
class _Sharing:
    """For a frame's hooks: storages every frame shares (FP8 weight workspaces), kept as they are,
    and the per-call objects on ctx whose tensors are protected (TE's quantizer copies)."""

    storages: frozenset = frozenset()
    call_objects: Callable[[Any], tuple[str, ...]] = no_call_objects

    def apply(self, packer: Any) -> Any:
        return packer.sharing(self.storages).entering(self.call_objects)


def _fp8_sharing(fp8: SlotFp8) -> _Sharing:
    call_objects = fp8_state.per_call_quantizers(fp8.modules) if fp8.snapshot_attention_scales else no_call_objects
    return _Sharing(storage_keys(fp8_state.fp8_workspace_storages(fp8.modules)), call_objects)


@dataclasses.dataclass
class _Measure:
    saved_bytes: int
    ctx_tensors: int
    outputs: tuple[torch.Tensor, ...]  # warmup outputs, as layout templates
    input_grads: tuple[torch.Tensor | None, ...]
    params_used: tuple[bool, ...]
    saves: tuple = ()  # offload_plan.Save of every save, when an offload group source is given


def _warmup(
    variant: Variant,
    params: Sequence[torch.nn.Parameter],
    iterations: int,
    group: Callable[[], str | None] | None = None,
    sharing: Callable[[], _Sharing] = _Sharing,
) -> _Measure:
    """Runs forward and backward eagerly (parameters' ``.grad`` untouched) and measures the frame;
    with ``group``, every save is recorded with its offload group (the last iteration's record).
    Shared storages (``sharing``) are not counted; FP8 weight workspaces exist only after the first
    iteration, so the frame is the last iteration's."""
    measure = None
    for _ in range(iterations):
        inputs = [a.detach().clone().requires_grad_(a.requires_grad) for a in variant.sample_args]
        sizer = sharing().apply(ArenaSizer(device=inputs[0].device if inputs else None, group=group))
        with sizer.hooks():
            outputs = _as_tuple(variant.fn(*inputs), variant.name)
        ctx_count = sizer.protect_ctx_tensors(outputs)
        differentiable = [o for o in outputs if o.requires_grad]
        targets = [i for i in inputs if i.requires_grad] + list(params)
        grads = (
            torch.autograd.grad(
                differentiable, targets, [torch.ones_like(o) for o in differentiable], allow_unused=True
            )
            if differentiable
            else (None,) * len(targets)
        )
        input_grads = iter(grads[: len(targets) - len(params)])
        measure = _Measure(
            saved_bytes=sizer.nbytes,
            ctx_tensors=ctx_count,
            outputs=tuple(o.detach().requires_grad_(o.requires_grad) for o in outputs),  # layout templates
            input_grads=tuple(next(input_grads) if i.requires_grad else None for i in inputs),
            params_used=tuple(g is not None for g in grads[len(targets) - len(params) :]),
            saves=tuple(sizer.saves),
        )
    assert measure is not None  # iterations >= 1, checked by the caller
    return measure


# ---------------------------------------------------------------------------------------------- graphs
def _adoptable(samples: Sequence[torch.Tensor]) -> list[bool]:
    """Which samples can be static inputs themselves: each owns exactly its storage (a view of a
    larger tensor would be saved and copied whole, and warmup measured a compact clone), is no
    parameter (a replay writes its input in), and shares no storage with another sample (one
    static input would then serve two arguments)."""
    storages = [s.untyped_storage().data_ptr() for s in samples]
    return [
        bool(  # storage_offset() is typed int | SymInt: its comparison a SymBool
            not isinstance(s, torch.nn.Parameter)
            and s.storage_offset() == 0
            and storages.count(storages[i]) == 1
            and s.untyped_storage().nbytes() == span_elements(s) * s.element_size()
        )
        for i, s in enumerate(samples)
    ]


class _Boundary:
    """The boundary storage of one (slot, I/O branch). With ``adopt_inputs`` the variant's sample
    tensors that can be (``_adoptable``) are the static inputs, as in TE's graphs (the caller's
    sample arguments stay alive anyway, so a copy would only double them): replays then write into
    the caller's samples. The forward graph reads its inputs when it replays, and every replay copies
    in what is not already there, so even samples shared by several graphs (Megatron's RoPE table)
    serve each one."""

    def __init__(self, variant: Variant, measure: _Measure, *, adopt_inputs: bool = False) -> None:
        self.inputs = []
        self.adopted = _adoptable(variant.sample_args) if adopt_inputs else [False] * len(variant.sample_args)
        for sample, adopted in zip(variant.sample_args, self.adopted):
            if adopted:
                self.inputs.append(sample)
                continue
            static = torch.empty_strided(
                tuple(sample.shape), tuple(sample.stride()), dtype=sample.dtype, device=sample.device
            )
            self.inputs.append(static.requires_grad_(sample.requires_grad))
        self.outputs = [Surface(o) for o in measure.outputs]
        self.grad_outputs = [
            torch.empty(tuple(o.shape), dtype=o.dtype, device=o.device) if o.requires_grad else None
            for o in measure.outputs
        ]
        self.input_grads = [None if g is None else Surface(g) for g in measure.input_grads]

    @property
    def nbytes(self) -> int:
        """The bytes this boundary allocated (adopted inputs are the caller's)."""
        tensors = [t for t, adopted in zip(self.inputs, self.adopted) if not adopted] + [
            g for g in self.grad_outputs if g is not None
        ]
        return sum(t.untyped_storage().nbytes() for t in tensors) + sum(
            s.nbytes for s in self.outputs + [g for g in self.input_grads if g is not None]
        )


class _Entry:
    """The graphs of one variant in one slot, and what their replays read and write."""

    def __init__(
        self,
        variant: Variant,
        slot: int,
        boundary: _Boundary,
        params: Sequence[torch.nn.Parameter],
        param_grads: Sequence[torch.Tensor | None],
        guard: SlotGuard | None,
        contract_check: ContractCheck,
        held: HeldState,
    ) -> None:
        self.variant, self.slot = variant, slot
        self.boundary: _Boundary | None = boundary  # None once released
        self.params, self.param_grads = tuple(params), tuple(param_grads)
        self.guard = guard
        self.forward_graph: Any = None
        self.backward_graph: Any = None
        self.params_used: tuple[bool, ...] = ()
        self.output_requires_grad: tuple[bool, ...] = ()
        self.input_count = len(variant.sample_args)
        # The same contract as TE's graphs: the boundary inputs are the static buffers (an input at
        # their address is read in place, any other copied in), the parameters are read in place:
        # ``held``, shared by the capture's entries (once a run under step marks, as for TE's graphs).
        self.contract_check = contract_check
        self.contract = ReplayContract.record(self.name, boundary.inputs, {}, held=held)
        self.frames = 0
        self.frame: str | None = None
        self.uncovered_bytes = 0  # pool bytes left alive by the forward capture besides the outputs
        self.staged: StagedFrame | None = None  # offload between replays: the copies around them
        self.fp8: fp8_state.Fp8Replay | None = None  # captured under FP8: TE's state around each replay

    @property
    def name(self) -> str:
        return f"variant {self.variant.name!r} in slot {self.slot}"

    def release(self) -> None:
        """Resets the graphs and drops every tensor they used: the run report keeps each layer's
        replay callable, and with it this entry, after teardown. The variant's samples go too: once
        adopted they are the static inputs (Megatron's sample arguments, a layer's hidden states and
        attention mask), which would otherwise outlive the graphs (1.5 activations a layer)."""
        for graph in (self.forward_graph, self.backward_graph):
            if graph is not None:
                graph.reset()
        self.forward_graph = self.backward_graph = None
        self.boundary = None
        self.variant = dataclasses.replace(self.variant, sample_args=())
        self.param_grads = ()
        self.staged = None
        self.fp8 = None  # TE's weight-update flag

    def _check_live(self) -> _Boundary:
        """The boundary of graphs that are still there (a RuntimeError once they were reset)."""
        if self.forward_graph is None:
            raise RuntimeError(
                f"the graphs of {self.name} were reset (delete_cuda_graphs or SlottedGraphs.reset); "
                "capture again before replaying."
            )
        assert self.boundary is not None  # release drops the boundary with the graphs
        return self.boundary

    def checked_forward(self) -> CheckedGraph:
        """``replay_forward`` held to this entry's contract (in its mode), as TE's graphs are."""
        contract = None if self.contract_check == ContractCheck.OFF else self.contract
        return CheckedGraph(self.replay_forward, contract, self.contract_check)

    def replay_forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        boundary = self._check_live()
        if len(args) != self.input_count:  # a wrong call, as for any function; the contract checks the rest
            raise TypeError(f"the graphs of {self.name} take {self.input_count} tensors, got {len(args)}")
        for arg, static in zip(args, boundary.inputs, strict=True):
            if arg.data_ptr() != static.data_ptr():
                static.detach().copy_(arg)
        self.frames += 1
        self.frame = f"{self.name} (forward #{self.frames})"
        if self.guard is not None:
            self.guard.acquire(self.slot, self.frame)
        if self.staged is not None:
            self.staged.before_forward()
        self.forward_graph.replay()
        if self.staged is not None:
            self.staged.after_forward()
        return tuple(surface.view.detach() for surface in boundary.outputs)

    def replay_backward(self, grads: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
        boundary = self._check_live()  # a forward replayed before a reset, its backward after
        for grad, static in zip(grads, boundary.grad_outputs):
            if static is None:
                continue
            if grad is None:
                static.zero_()
            elif grad.data_ptr() != static.data_ptr():
                static.copy_(grad)
        if self.staged is not None:
            self.staged.before_backward()
        self.backward_graph.replay()
        if self.staged is not None:
            self.staged.after_backward()
        if self.guard is not None:
            self.guard.release(self.slot, self.frame or self.name)
        input_grads = tuple(None if surface is None else surface.view.detach() for surface in boundary.input_grads)
        # Real parameter gradients are cloned: the buffer is shared by every graph, and autograd may
        # keep a returned gradient as ``.grad``. Unused parameters get no gradient at all.
        # A used parameter has a buffer: _capture_entry refuses a captured gradient without one.
        param_grads = tuple(
            buffer.clone() if used and buffer is not None else None
            for buffer, used in zip(self.param_grads, self.params_used)
        )
        return input_grads + param_grads


class _SlotReplay(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        entry: _Entry,
        replay: CheckedGraph,
        input_count: int,
        update_fp8_weights: bool,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.entry = entry
        ctx.fp8_first = entry.fp8.before_forward(update_fp8_weights) if entry.fp8 is not None else False
        outputs = replay(*tensors[:input_count])  # the entry's replay_forward, held to its contract
        ctx.mark_non_differentiable(*[o for o, rg in zip(outputs, entry.output_requires_grad) if not rg])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        grads_in = ctx.entry.replay_backward(grads)
        if ctx.entry.fp8 is not None:
            ctx.entry.fp8.after_backward(ctx.fp8_first)
        return (None, None, None, None, *grads_in)


class SlottedGraphs:
    """What ``capture_slotted`` returns: ``graphs.callable(variant, slot)(*inputs)`` replays that
    variant's forward graph for a frame in ``slot``; autograd replays the matching backward. Graphs
    captured under FP8 refresh their weight workspaces unless called with ``update_fp8_weights=False``.

    Outputs and returned input gradients are views of the slot's boundary storage: consume them
    before the slot's next forward (the slot plan guarantees the next forward comes after this
    frame's backward)."""

    def __init__(self, entries: dict[tuple[Hashable, int], _Entry], stats: SlottedStats, keep_alive: list[Any]) -> None:
        self._entries = entries
        self.stats = stats
        self._keep_alive = keep_alive  # arenas and boundary storage the graphs read and write

    def callable(self, variant: Hashable, slot: int) -> Callable[..., Any]:
        try:
            entry = self._entries[variant, slot]
        except KeyError:
            variants = sorted({str(v) for v, _ in self._entries})
            raise KeyError(
                f"no graph for variant {variant!r} in slot {slot}: captured variants {variants}, "
                f"slots 0..{self.stats.ring_size - 1}"
            ) from None

        forward = entry.checked_forward()  # held here, not by the entry: no cycle through it

        def replay(*inputs: torch.Tensor, update_fp8_weights: bool = True) -> Any:
            outputs = _SlotReplay.apply(entry, forward, len(inputs), update_fp8_weights, *inputs, *entry.params)
            return outputs[0] if len(outputs) == 1 else outputs

        return replay

    def reset(self) -> None:
        """Frees every graph, arena and boundary buffer (the pool goes once the caller drops its
        handle). Callables handed out before keep only an emptied entry and refuse to replay."""
        for entry in self._entries.values():
            entry.release()
        self._entries.clear()
        for kept in self._keep_alive:
            if isinstance(kept, _Offloading):
                kept.release()
        self._keep_alive.clear()


# ---------------------------------------------------------------------------------------------- capture
def capture_slotted(
    variants: Sequence[Variant],
    plan: SlotPlan,
    parameters: torch.nn.Module | Iterable[torch.nn.Parameter],
    *,
    protect: bool = True,
    pool: Any = None,
    stream: Any = None,
    warmup_iterations: int = 2,
    debug: bool = False,
    strict: bool = True,
    contract_check: ContractCheck = ContractCheck.FULL,
    offload: SlotOffload | None = None,
    fp8: SlotFp8 | None = None,
    check_stale: bool = True,
    param_grads: ParamGradBuffers | None = None,
    step_marks: StepMarks | None = None,
) -> SlottedGraphs:
    """Captures each variant once per slot that ``plan`` (``slot_sharing.plan.plan_slots``) gives it, all
    into one graph pool; each slot's arena is sized by the largest of its own variants.

    ``parameters``: the layer the variants run, or its parameters (shared by all variants); those
    needing a gradient get one. Every replay's contract reads them in place (``HeldState``, one for
    all the variants): a layer's looked up where they live, so a parameter its module was given anew
    is refused; parameters given one by one, as they are. ``protect=False`` captures
    the same graphs without arenas (shared pool, nothing protected: the corruption this module
    exists to prevent; for tests and measurements). ``debug`` turns on the host-side slot guard
    (``MEGATRON_CG_SLOT_DEBUG``). ``strict`` raises ``SlotCoverageError`` if a forward capture
    leaves unprotected pool memory alive; otherwise its bytes are only reported. ``contract_check``
    is what each replay checks (``--cg-contract-check``, parsed with the config).
    ``offload`` moves the saves its policy selects to pinned host arenas, copied inside the graphs
    or between replays (``SlotOffload``); each slot's GPU arena then holds only the saves that
    stay. Captures sharing a ``pool`` should share the capture ``stream`` too: the allocator hands a
    freed pool block only to allocations on the stream it came from. ``fp8`` runs the variants'
    warmup and capture under TE's graph autocast (``SlotFp8``); replays then belong inside the
    caller's own FP8 autocast with the same recipe, as TE's graphed callables do. ``check_stale``
    refuses capture while eager autograd graphs reach the parameters (``capture.stale_graphs``; ~0.2 s);
    ``False`` where the caller checks (the plugin's helper, once per capture phase).
    ``param_grads`` shares the parameter-gradient buffers with other captures whose backward
    replays never overlap with these (``slot_sharing.param_grads``); the stats then count only the
    buffers this capture added. ``step_marks``: the run's, where the model keeps its parameters in
    place within a step, so the held state is read once a run of the schedule (``HeldState``).
    """
    params, held = _trained_and_held(parameters, step_marks)
    slots_of = _validate(variants, plan, warmup_iterations, fp8)
    fp8_capture = None
    if fp8 is not None:
        variants = [dataclasses.replace(v, fn=_under_fp8(v.fn, fp8)) for v in variants]
        fp8_capture = fp8_state.Fp8Capture(fp8.recipe, fp8.modules)
    if check_stale:  # an eager graph alive at capture breaks the backward capture, also where TE's tolerates it
        stale_graphs.ensure_no_stale_graphs(params, tolerate=False)
    start = time.perf_counter()
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    if offload is not None and not protect:
        raise ValueError("offload needs the arenas (protect=True): offloaded saves come back through them.")
    sharing = (lambda: _fp8_sharing(fp8)) if fp8 is not None else _Sharing
    options = _CaptureOptions(
        protect, warmup_iterations, debug, strict, contract_check, held, offload, param_grads, sharing
    )
    # Warmup and capture draw random numbers that eager training never draws: the generators go back after.
    with (
        te_seam.te_capture_flag(),
        _fp8_capturing(fp8_capture),
        te_seam.generators_preserved(te_seam.graph_generators()),
    ):
        entries, arenas, boundaries, (param_grads, param_grad_bytes), measures, retained, offloading = _capture_all(
            variants, plan.ring_size, slots_of, params, pool, torch.cuda.Stream() if stream is None else stream, options
        )
    if fp8 is not None and fp8_capture is not None:  # the one is set where the other is
        replay = fp8_capture.replay(fp8.enabled)
        for entry in entries.values():
            entry.fp8 = replay
    torch.cuda.synchronize()
    segments = accounting.allocator_segments()
    stats = SlottedStats(
        ring_size=plan.ring_size,
        variants=len(variants),
        graphs=2 * len(entries),
        capture_seconds=time.perf_counter() - start,
        pool_bytes=accounting.pool_bytes_by_id(segments).get(tuple(pool), 0),
        arena_bytes=sum(a.capacity for a in arenas),
        slot_arena_bytes=tuple(a.capacity for a in arenas),
        boundary_bytes=sum(b.nbytes for b in boundaries.values()) + param_grad_bytes,
        saved_bytes={name: m.saved_bytes for name, m in measures.items()},
        ctx_tensors={name: m.ctx_tensors for name, m in measures.items()},
        retained_bytes=retained,
        uncovered_bytes=sum(e.uncovered_bytes for e in entries.values()),
        offloaded_bytes={name: p.host_bytes for name, p in offloading.plans.items()},
        host_arena_bytes=tuple(h.buffer.numel() for h in offloading.host_arenas),
        staging_bytes=offloading.staging_bytes,
    )
    return SlottedGraphs(entries, stats, [arenas, boundaries, param_grads, pool, offloading])


def _trained_and_held(
    parameters: torch.nn.Module | Iterable[torch.nn.Parameter], step_marks: StepMarks | None
) -> tuple[list[torch.nn.Parameter], HeldState]:
    """The parameters the variants train (those needing a gradient) and the held state their
    contracts share: a module's parameters looked up in their owners, as a TE graph's contract
    does (its process groups are not held: a graph bank's CP group is its router's to check), or
    the parameters given, held as they are."""
    if isinstance(parameters, torch.nn.Module):
        trained = [p for p in parameters.parameters() if p.requires_grad]
        return trained, HeldState.of(parameters, groups=False, step_marks=step_marks)
    trained = [p for p in parameters if p.requires_grad]
    return trained, HeldState.of(params=_numbered(trained), step_marks=step_marks)


def _numbered(params: Iterable[torch.nn.Parameter]) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"parameter {index}", param) for index, param in enumerate(params)]


@dataclasses.dataclass(frozen=True)
class _CaptureOptions:
    protect: bool
    warmup_iterations: int
    debug: bool
    strict: bool
    contract_check: ContractCheck
    held: HeldState  # the parameters every entry's contract reads (one state for all)
    offload: SlotOffload | None = None
    param_grads: ParamGradBuffers | None = None  # shared with other captures; None: this capture's own
    # What frames share and what ctx objects belong to one call, read when a frame's hooks are made.
    sharing: Callable[[], _Sharing] = _Sharing


@dataclasses.dataclass
class _Offloading:
    """The offload side of one slot-shared capture: each variant's plan, the pinned host arenas
    (per slot for in-graph copies, per graph for copies between replays) and the copy engine."""

    plans: dict[Hashable, OffloadPlan]
    host_arenas: list[HostArena]
    transfers: Transfers | None
    staged: dict[tuple[Hashable, int], StagedFrame] = dataclasses.field(default_factory=dict)
    staging_bytes: int = 0
    window: int = 1  # SlotOffload.window

    def release(self) -> None:
        """The graphs go (teardown resets every capture sharing the ring): the staging ring drains
        its copies and lets go of every frame."""
        rings = {id(frame.ring): frame.ring for frame in self.staged.values()}
        for ring in rings.values():
            ring.release()
        self.staged.clear()

    def hooks(self, key: tuple[Hashable, int], arena: Arena) -> ArenaHooks:
        """The saved-tensor hooks of one (variant, slot) capture: its planned saves to the slot's
        host arena through in-graph copies, to its staging buffer (copies between replays), or,
        with nothing to offload, every save to the arena."""
        plan = self.plans.get(key[0])
        if plan is None or not plan.offloaded:
            return ArenaHooks(arena)
        staged = self.staged.get(key)
        if staged is not None:
            return StagedArenaHooks(arena, staged.staging, plan)
        assert self.transfers is not None  # in-graph copies: plan() made the engine
        return OffloadingArenaHooks(arena, self.host_arenas[key[1]], plan, self.transfers, window=self.window)

    @classmethod
    def plan(
        cls,
        offload: SlotOffload,
        measures: dict[Hashable, _Measure],
        ring_size: int,
        slots_of: dict[Hashable, tuple[int, ...]],
        placed: list[tuple[Variant, int]],
    ) -> _Offloading:
        """Plans from the warmup records; pinned memory is taken here, before any capture, so what
        cannot be had is refused naming the bytes (``HostArenaError``)."""
        plans = {name: offload.plan(name, m.saves) for name, m in measures.items()}
        if offload.staging is None:
            return cls(
                plans,
                [
                    HostArena(nbytes, name=f"host arena of slot {slot}")
                    for slot, nbytes in enumerate(host_arena_bytes(ring_size, slots_of, plans))
                ],
                offload.transfers(),
                window=offload.window,
            )
        ring, before = offload.staging, offload.staging.nbytes
        hosts, staged = [], {}
        for slot in range(ring_size):  # one position in the ring per slot: a slot's variants never overlap
            ring.advance()
            for variant in (v for v, s in placed if s == slot and plans[v.name].offloaded):
                plan = plans[variant.name]
                hosts.append(HostArena(plan.host_bytes, name=f"host arena of {variant.name!r} in slot {slot}"))
                staged[variant.name, slot] = ring.frame(plan.host_bytes, hosts[-1], f"{variant.name!r} in slot {slot}")
        return cls(plans, hosts, None, staged, ring.nbytes - before)


def _capture_all(
    variants: Sequence[Variant],
    ring_size: int,
    slots_of: dict[Hashable, tuple[int, ...]],
    params: list[torch.nn.Parameter],
    pool: Any,
    stream: Any,
    options: _CaptureOptions,
) -> tuple:
    """Warmup, sizing, allocation and every capture (TE's capture flag set by the caller)."""
    stream.wait_stream(torch.cuda.current_stream())
    group = options.offload.group if options.offload is not None else None
    with torch.cuda.stream(stream):  # warmup and capture on one stream: library workspaces exist before capture
        measures = {v.name: _warmup(v, params, options.warmup_iterations, group, options.sharing) for v in variants}
    torch.cuda.current_stream().wait_stream(stream)
    branch_of = io_branches(variants, measures, slots_of)

    device = variants[0].sample_args[0].device if variants[0].sample_args else torch.device("cuda")
    placed = [(v, slot) for v in variants for slot in slots_of[v.name]]
    offloading = (
        _Offloading({}, [], None)
        if options.offload is None
        else _Offloading.plan(options.offload, measures, ring_size, slots_of, placed)
    )
    arenas = (
        [
            Arena(arena_bytes, device, name=f"slot {slot}")
            for slot, arena_bytes in enumerate(slot_arena_bytes(ring_size, slots_of, measures, offloading.plans))
        ]
        if options.protect
        else []
    )
    boundaries: dict[tuple[int, Hashable], _Boundary] = {}
    adopted: set[Hashable] = set()  # each variant's samples are one boundary's inputs at most
    for v, slot in placed:
        branch_key = (slot, branch_of[v.name])
        if branch_key not in boundaries:
            boundaries[branch_key] = _Boundary(v, measures[v.name], adopt_inputs=v.name not in adopted)
            adopted.add(v.name)
    # A buffer only for what some variant's warmup gave a gradient (an attn graph of an MoE layer reaches no expert).
    reached = [any(measure.params_used[index] for measure in measures.values()) for index in range(len(params))]
    param_grads, param_grad_bytes = (options.param_grads or ParamGradBuffers()).take(params, reached)
    guard = SlotGuard(ring_size) if options.debug else None
    entries = {
        (v.name, slot): _Entry(
            v,
            slot,
            boundaries[slot, branch_of[v.name]],
            params,
            param_grads,
            guard,
            options.contract_check,
            options.held,
        )
        for v, slot in placed
    }
    retained = 0
    torch.cuda.synchronize()
    sharing = options.sharing()
    with CaptureTransaction([]) as transaction:
        for key, entry in entries.items():
            hooks = sharing.apply(offloading.hooks(key, arenas[key[1]])) if options.protect else None
            retained += _capture_entry(entry, hooks, pool, stream, transaction, options.strict)
            entry.staged = offloading.staged.get(key)
    return entries, arenas, boundaries, (param_grads, param_grad_bytes), measures, retained, offloading


def slot_arena_bytes(
    ring_size: int,
    slots_of: dict[Hashable, tuple[int, ...]],
    measures: dict[Hashable, _Measure],
    offload_plans: dict[Hashable, OffloadPlan] | None = None,
) -> list[int]:
    """Per slot, the bytes its arena needs: the largest frame of the variants the plan puts there
    (measured at warmup), so a slot only small variants use gets a small arena. A variant with an
    offload plan needs only the storages that stay on the GPU."""
    plans = offload_plans or {}
    return per_slot_max(
        ring_size,
        slots_of,
        {name: m.saved_bytes - (plans[name].host_bytes if name in plans else 0) for name, m in measures.items()},
    )


def planned_slots(plan: SlotPlan, names: Sequence[Hashable]) -> dict[Hashable, tuple[int, ...]]:
    """The slots ``plan`` gives each variant (``ValueError`` if the plan and the names differ)."""
    slots_of = {name: tuple(sorted({f.slot for f in plan.frames if f.variant == name})) for name in names}
    unplanned = sorted(str(name) for name, slots in slots_of.items() if not slots)
    unknown = sorted({str(f.variant) for f in plan.frames} - {str(name) for name in names})
    if unplanned or unknown:
        raise ValueError(
            f"the plan and the variants differ: variants in no frame of the plan {unplanned}, frames "
            f"of variants not given {unknown}; plan with the same variant names you capture."
        )
    return slots_of


@contextlib.contextmanager
def _fp8_capturing(capture: fp8_state.Fp8Capture | None) -> Any:
    if capture is None:
        yield
        return
    failed = True
    try:
        capture.enter()  # inside: what a failing enter already changed is put back too
        yield
        failed = False
    finally:
        capture.exit(failed)


def _under_fp8(fn: Callable[..., Any], fp8: SlotFp8) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        with fp8_state.fp8_capture_autocast(fp8.enabled, fp8.recipe, fp8.group):
            return fn(*args)

    return run


def _validate(
    variants: Sequence[Variant], plan: SlotPlan, warmup_iterations: int, fp8: SlotFp8 | None = None
) -> dict[Hashable, tuple[int, ...]]:
    """Everything capture refuses, before anything is allocated; returns each variant's slots."""
    if not isinstance(plan, SlotPlan):
        raise TypeError(
            f"plan is a {type(plan).__name__}; pass the SlotPlan of plan_slots(order, variants) "
            "(slot_sharing.plan), or slot_sharing.plan.exclusive_plan(names) for variants that never overlap."
        )
    if warmup_iterations < 1:
        raise ValueError("warmup_iterations must be >= 1: arenas are sized from a warmup run.")
    if not variants:
        raise ValueError("no variants given; pass at least one Variant.")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names repeat ({names}); give each variant its own name.")
    slots_of = planned_slots(plan, names)
    for variant in variants:
        if not all(isinstance(a, torch.Tensor) and a.is_cuda for a in variant.sample_args):
            raise ValueError(f"variant {variant.name!r}: sample_args must be CUDA tensors.")
    if fp8_state.fp8_autocast_active():
        raise ValueError(
            "slot-shared capture was called inside an FP8 autocast, whose exit would reduce amaxes "
            "the graphs recorded: capture outside it and pass fp8=SlotFp8(recipe, group)."
        )
    if fp8 is not None and not isinstance(fp8, SlotFp8):
        raise TypeError(f"fp8 is a {type(fp8).__name__}; pass SlotFp8(recipe, group, enabled).")
    if fp8 is not None and warmup_iterations < 2:
        raise ValueError(
            "slot-shared capture with FP8 needs warmup_iterations >= 2: the FP8 weight workspaces are "
            "made in the first one, and frames are measured without them in the last."
        )
    if fp8 is not None and fp8.enabled and (refusal := fp8_state.slot_fp8_refusal(fp8.recipe, fp8.modules)):
        raise ValueError(refusal)
    return slots_of


def io_branches(
    variants: Sequence[Variant], measures: dict[Hashable, _Measure], slots_of: dict[Hashable, tuple[int, ...]]
) -> dict[Hashable, Hashable]:
    """The I/O branch of each variant: its ``io_branch`` if named (all variants naming one must have
    interchangeable layouts: ``BranchMismatchError`` otherwise), else its boundary layout, so that
    variants with identical layouts share storage."""
    signatures = {
        v.name: BranchSignature.of(
            list(measures[v.name].outputs) + list(v.sample_args),
            [g for g in measures[v.name].input_grads if g is not None],
        )
        for v in variants
    }
    named: dict[Hashable, dict[Hashable, BranchSignature]] = {}
    for v in variants:
        if v.io_branch is not None:
            named.setdefault(v.io_branch, {})[v.name] = signatures[v.name]
    for branches in named.values():
        for slot in sorted({slot for name in branches for slot in slots_of[name]}):
            check_branches(slot, {name: sig for name, sig in branches.items() if slot in slots_of[name]})
    return {
        v.name: ("named", v.io_branch) if v.io_branch is not None else ("layout", signatures[v.name]) for v in variants
    }


def _live(pool: Any) -> dict[int, int]:
    return accounting.live_blocks(accounting.allocator_segments(), pool)


def _capture_entry(
    entry: _Entry, hooks: ArenaHooks | None, pool: Any, stream: Any, transaction: CaptureTransaction, strict: bool
) -> int:
    """Captures one variant's forward and backward for one slot; returns the pool bytes still
    allocated afterwards that were not before (library workspaces; 0 normally). ``hooks`` (None
    without arenas) take the forward's saves; in-graph offload hooks (``OffloadingArenaHooks``)
    send the planned ones to the host, and both graphs join their copy streams before they end."""
    boundary, variant = entry.boundary, entry.variant
    assert boundary is not None  # captured before any release
    for static, sample in zip(boundary.inputs, variant.sample_args):
        static.detach().copy_(sample)
    before = _live(pool)

    forward = torch.cuda.CUDAGraph()
    transaction.track(forward)
    te_seam.register_graph_safe_generators(forward)
    with torch.cuda.graph(forward, pool=pool, stream=stream):
        with _copies_joined(hooks, "forward"):  # every D2H copy inside the forward graph
            with hooks.hooks() if hooks else contextlib.nullcontext():
                outputs = _as_tuple(variant.fn(*boundary.inputs), variant.name)
            if hooks:
                hooks.protect_ctx_tensors(outputs)
        for surface, output in zip(boundary.outputs, outputs):
            surface.load(output)
    entry.forward_graph = forward
    entry.output_requires_grad = tuple(o.requires_grad for o in outputs)
    if hooks:
        _check_coverage(entry, before, _live(pool), outputs, strict)

    differentiable = [(o, g) for o, g in zip(outputs, boundary.grad_outputs) if o.requires_grad]
    inputs_with_grad = [i for i in boundary.inputs if i.requires_grad]
    backward = torch.cuda.CUDAGraph()
    transaction.track(backward)
    te_seam.register_graph_safe_generators(backward)
    with torch.cuda.graph(backward, pool=pool, stream=stream), _copies_joined(hooks, "backward"):
        grads: list[torch.Tensor | None] = (
            list(
                torch.autograd.grad(
                    [o for o, _ in differentiable],
                    inputs_with_grad + list(entry.params),
                    [g for _, g in differentiable],
                    allow_unused=True,
                )
            )
            if differentiable
            else []
        )
        grads = grads or [None] * (len(inputs_with_grad) + len(entry.params))
        input_grads = iter(grads[: len(inputs_with_grad)])
        for static, grad_surface in zip(boundary.inputs, boundary.input_grads):
            grad = next(input_grads) if static.requires_grad else None
            if grad_surface is not None and grad is not None:
                grad_surface.load(grad)
        for index, (buffer, grad) in enumerate(zip(entry.param_grads, grads[len(inputs_with_grad) :])):
            if grad is not None:
                if buffer is None:
                    raise RuntimeError(
                        f"{entry.name}: parameter {index} got a gradient in the captured "
                        "backward but none in warmup, so it has no buffer: the layer's backward reaches other "
                        "parameters from one call to the next, which a graph cannot replay; keep it eager."
                    )
                buffer.copy_(grad)
    entry.backward_graph = backward
    entry.params_used = tuple(g is not None for g in grads[len(inputs_with_grad) :])
    del outputs, differentiable, grads, input_grads, hooks
    after = _live(pool)
    return sum(size for address, size in after.items() if address not in before)


@contextlib.contextmanager
def _copies_joined(hooks: ArenaHooks | None, graph: str) -> Iterator[None]:
    """In-graph offload's copy streams around one graph's capture: the backward's first reloads
    start before its first kernel; every copy stream is joined before the capture ends, also when
    the graph's code raised. An unjoined stream makes ``capture_end`` fail, which would leave the
    CUDA generators registered with the graph in capture mode: every later random op of the
    process would then raise."""
    if not isinstance(hooks, OffloadingArenaHooks):
        yield
        return
    # The backward's reloads the backward never unpacks are joined too.
    join = hooks.join_forward if graph == "forward" else hooks.join_backward
    try:
        if graph == "backward":
            hooks.start_backward()
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the graph's own error is the one to report
            join()
        raise
    join()


def _check_coverage(
    entry: _Entry, before: dict[int, int], after: dict[int, int], outputs: Sequence[torch.Tensor], strict: bool
) -> None:
    """Between a forward capture and its backward capture, the pool may hold only the forward's
    outputs (their blocks are released by the backward capture; the backward never reads them
    unless saved, and saved tensors are in the arena). Anything else alive there is backward state
    outside the arena, which another capture could be handed."""
    output_ptrs = [o.untyped_storage().data_ptr() for o in outputs]
    uncovered = {
        address: size
        for address, size in after.items()
        if address not in before and not any(address <= ptr < address + size for ptr in output_ptrs)
    }
    entry.uncovered_bytes = sum(uncovered.values())
    if uncovered and strict:
        held = [
            f"{tuple(t.shape)} {t.dtype} held by {'; '.join(stale_graphs.describe_holders(t)) or 'no Python referrer'}"
            for t in stale_graphs.tensors_in(uncovered)
        ]
        raise SlotCoverageError(
            f"{entry.name}: after its forward capture {len(uncovered)} pool block(s), {sum(uncovered.values())} bytes, "
            "are still alive besides the outputs: backward state kept outside save_for_backward and ctx "
            "attributes (a module attribute or a global cache filled during capture?). Slot sharing cannot "
            "protect it; capture this variant in its own pool, or pass strict=False to measure. Tensors there: "
            + ("; ".join(held) or "none reachable from Python (a C++ workspace or cache)")
            + "."
        )
