"""The plugin's ``TECudaGraphHelper``: Megatron's lifecycle, with capture made transactional and
fail-closed, replays checked against their contracts and counted, and teardown measured.

``create_cudagraphs`` runs Megatron's own (start, input data, one ``make_graphed_callables`` call,
graph i handed to its layer and microbatch, finish) inside a ``CaptureTransaction``, with the
plugin's capture call standing in for TE's (``capture.te_backend``): on any error every graph created
so far is reset and everything the capture changed is restored before the error is raised
(``--cg-on-capture-error raise``) or training continues without graphs (``eager``). The graphs
Megatron handed out are then wrapped with their replay contracts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils import _pytree as pytree

from megatron_cg_plugin import foreign_state
from megatron_cg_plugin.banks import capture as graph_banks
from megatron_cg_plugin.banks.sizes import bank_sizes
from megatron_cg_plugin.capture import accounting, stale_graphs
from megatron_cg_plugin.capture.contracts import CheckedGraph, HeldState, ReplayContract
from megatron_cg_plugin.capture.scratch import clear, moe_dispatcher_scratch
from megatron_cg_plugin.capture.step_marks import StepMarks
from megatron_cg_plugin.capture.te_backend import GraphBackend, TEBackend
from megatron_cg_plugin.capture.transaction import (
    CaptureTransaction,
    Restorable,
    attribute,
    gc_freeze,
    gc_state,
    rng_state,
    tensor_grads,
)
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.console import EXIT_BAD_INPUT
from megatron_cg_plugin.packed import graphs as packed_graphs
from megatron_cg_plugin.planner.prediction import with_model_config
from megatron_cg_plugin.scopes import module_names
from megatron_cg_plugin.session import CaptureStats, RunSession
from megatron_cg_plugin.setups import memory_guard
from megatron_cg_plugin.slot_sharing.megatron_backend import SlotBackend, SlotLayerGraph
from megatron_cg_plugin.slot_sharing.offload_groups import OffloadCopies

__all__ = [
    "CaptureFailedError",
    "CaptureWontFitError",
    "InjectedCaptureFailure",
    "PluginHelperMixin",
    "bind_helper_class",
    "parameters_stay_within_a_step",
    "read_free_memory",
    "refusals_reported",
    "scope_label",
]

logger = logging.getLogger(__name__)


class CaptureFailedError(RuntimeError):
    """Capture failed; everything it changed was rolled back before this was raised."""


class CaptureWontFitError(CaptureFailedError):
    """The planner predicts that the capture would not fit in the memory free when it would start:
    refused before anything was captured (``setups.memory_guard``)."""


@contextlib.contextmanager
def refusals_reported(command: str) -> Iterator[None]:
    """A refusal raised in training that names what to change (a capture the memory guard stopped, live
    eager graphs reaching the graphed parameters) printed as ``command``'s one message and exit code 2
    (``SystemExit``), in place of a traceback through Megatron's loop. Nothing was captured: the run
    stops as a refusal before training would."""
    try:
        yield
    except (CaptureWontFitError, stale_graphs.StaleAutogradGraphError) as refusal:
        print(f"{command}: {refusal}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None


class InjectedCaptureFailure(RuntimeError):
    """Raised inside a capture by ``--cg-inject-capture-failure`` (testing the rollback)."""


def scope_label(modules: Iterable[Any]) -> str:
    """``[attn, moe_router]`` -> ``'attn+moe_router'``; an empty list means the whole layer."""
    return "+".join(module_names(modules)) or "layer"


def read_free_memory(budget_gib: float | None) -> memory_guard.FreeMemory:
    """What capture may take now: ``budget_gib`` (``--cg-memory-budget-gib``) or what this rank's GPU
    has free, and the host memory available to the ranks of this host (``capture.accounting``)."""
    host, ranks = accounting.host_available_bytes(), accounting.ranks_on_this_host()
    if budget_gib is not None:
        budget = int(budget_gib * memory_guard.GIB)
        return memory_guard.FreeMemory(budget, host, ranks, device_source=f"--cg-memory-budget-gib {budget_gib:g}")
    return memory_guard.FreeMemory(accounting.device_free_bytes(), host, ranks)


def _layer_label(layer: Any, index: int) -> str:
    number = getattr(layer, "layer_number", None)
    return f"layer {number}" if number is not None else f"graphed callable #{index + 1}"


class _CaptureTracker:
    """Wraps each layer's capture entry point (``_te_cuda_graph_capture``, what Megatron runs under
    TE's capture) for the transaction: remembers which layer's forward or backward runs, and raises
    the injected failure inside the capture of the chosen layer.

    TE captures every forward first, then the backwards in reverse order, so the last forward that
    ran is not where a backward failed: hooks on each forward's outputs name the layer's backward
    when autograd reaches them (in warmup and in the backward capture). Leaving ``installed`` removes
    them, so nothing stays attached to TE's static outputs."""

    def __init__(self, layers: list[Any], *, inject_at: int | None, is_capturing: Callable[[], bool]) -> None:
        self.layers = layers
        self.inject_at = inject_at
        self.is_capturing = is_capturing
        self.current: str | None = None
        self._hooks: list[Any] = []  # handles of the hooks on capture outputs

    @property
    def where(self) -> str:
        """Where a failure happened, in words: the layer and phase that ran last, or before any."""
        return self.current or "the capture's setup, before any layer ran"

    @contextlib.contextmanager
    def installed(self) -> Iterator[_CaptureTracker]:
        """The wrappers on every layer for the block (``ledger.SCOPED``, ``layer-capture-tracker``);
        after it, success or failure, the layers have their class's method again and the output
        hooks are gone."""
        with foreign_state.Changes() as changes:
            for index, layer in enumerate(self.layers):
                changes.set(
                    layer,
                    "_te_cuda_graph_capture",
                    self._wrap(layer._te_cuda_graph_capture, index, layer),
                    change="layer-capture-tracker",
                )
            try:
                yield self
            finally:
                self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _wrap(self, run: Callable, index: int, layer: Any) -> Callable:
        label = _layer_label(layer, index)
        forward, backward = f"{label} (forward)", f"{label} (backward)"

        def capture_entry(*args: Any, **kwargs: Any) -> Any:
            self.current = forward
            if self.inject_at == index + 1 and self.is_capturing():
                raise InjectedCaptureFailure(f"injected failure inside the capture of {forward}")
            outputs = run(*args, **kwargs)
            self._name_on_backward(outputs, backward)
            return outputs

        return capture_entry

    def _name_on_backward(self, outputs: Any, label: str) -> None:
        """``label`` becomes current when autograd reaches any of ``outputs``: the first thing a
        layer's backward does. Outputs that take no gradient start no backward."""

        def reached(grad: Any) -> None:
            self.current = label

        self._hooks += [
            leaf.register_hook(reached)
            for leaf in pytree.tree_leaves(outputs)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]


class _CaptureCall:
    """Stands in for TE's ``make_graphed_callables`` inside Megatron's ``create_cudagraphs``: the
    capture goes through the backend with every graph tracked by the transaction (and what TE
    changes restorable), and the sample arguments and returned graphs are kept for the contracts."""

    def __init__(self, backend: GraphBackend, transaction: CaptureTransaction, tracker: _CaptureTracker) -> None:
        self.backend, self.transaction, self.tracker = backend, transaction, tracker
        self.graphs: Any = None
        self.sample_args: Any = None
        self.sample_kwargs: Any = None

    def __call__(self, callables: tuple, sample_args: Any, **kwargs: Any) -> Any:
        self.transaction.add(self.backend.restorables(callables, kwargs))
        with self.backend.tracking(self.transaction.track):
            graphs = self.backend.make_graphed_callables(callables, sample_args, **kwargs)
        self.tracker.current = "Megatron's finish after the capture (handing out the graphs)"  # no layer runs now
        self.graphs, self.sample_args = tuple(graphs), sample_args
        self.sample_kwargs = kwargs.get("sample_kwargs") or [{}] * len(sample_args)
        return graphs


class _Phases:
    """Seconds per named phase of a capture: ``with phases("name"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - begin


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """One capture (TE's, slot-shared or the graph banks'), for the stats and the failure it ends
    with: what it graphs (``scope`` in words, ``layers``), when it started, the tracker naming the
    layer that ran last, and how a failure reads: ``what`` failed and ``undone``, what the rollback
    left."""

    scope: str
    layers: list[Any]
    start: float
    tracker: _CaptureTracker
    what: str
    undone: str
    # Megatron's create_cudagraphs ran: a failure is followed by its post-capture reset and the stale-graph diagnosis.
    megatron_lifecycle: bool


if TYPE_CHECKING:

    class _MegatronHelper:
        """For the type checker only: what ``PluginHelperMixin`` uses of Megatron's ``TECudaGraphHelper``
        (the class it is mixed in front of), attributes and the methods it extends through ``super()``."""

        model: list[Any]  # the model chunks
        config: Any  # Megatron's TransformerConfig
        flattened_callables: list[Any]  # every graphed layer, chunk by chunk
        num_microbatches: int | None
        _graphs_created: bool
        _capture_finished: bool

        def graphs_created(self) -> bool: ...
        def _get_sample_arguments(self, order: Any, chunk_id_list: Any = None) -> tuple: ...
        def _reset_after_capture(self) -> None: ...
        def create_cudagraphs(self) -> None: ...
        def cuda_graph_set_manual_hooks(self) -> None: ...
        def delete_cuda_graphs(self) -> None: ...

else:
    _MegatronHelper = object  # at run time the mixin comes first in the MRO, before Megatron's helper


class PluginHelperMixin(_MegatronHelper):
    """Mixed in front of Megatron's ``TECudaGraphHelper`` by ``bind_helper_class``."""

    session: ClassVar[RunSession]
    backend: ClassVar[GraphBackend | None]  # None: chosen by the run's config (capture_backend)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture_stats: CaptureStats | None = None
        self.teardown_stats: accounting.TeardownStats | None = None
        self._banks: Any = None  # banks.capture.BankedLayers while graph banks are installed
        self._baseline: accounting.MemoryState | None = None
        self._warned_close_to_memory_limit = False
        self.session.attach_helper(self)

    # -- capture ------------------------------------------------------------------------------
    def _restorables(self, layers: list[Any]) -> list[Restorable]:
        from megatron.core.transformer import cuda_graphs

        params = [p for chunk in self.model for p in chunk.parameters()]
        items = [
            attribute(cuda_graphs, "_IS_GRAPH_CAPTURING", label="Megatron capture flag"),
            gc_state(),
            gc_freeze(),
            rng_state(),
            tensor_grads(params),
        ]
        items += [attribute(layer, "cuda_graphs") for layer in layers]
        items += [attribute(self, name) for name in ("_graphs_created", "_capture_finished", "num_microbatches")]
        return items

    def _get_sample_arguments(self, order: Any, chunk_id_list: Any = None) -> tuple:
        """Megatron's sample arguments per layer and microbatch, as a packed microbatch brings them
        where the run lays packed data out (``--cg-thd-max-seqs``: ``packed.graphs``)."""
        sample_args, sample_kwargs = super()._get_sample_arguments(order, chunk_id_list)
        return packed_graphs.helper_sample_inputs(self, sample_args, sample_kwargs)

    def create_cudagraphs(self) -> None:
        self.session.mark_capture_start()  # capture runs between iterations: no step's time
        if not self.flattened_callables:
            return super().create_cudagraphs()  # Megatron warns and finishes the phase
        self.session.model_config_seen(self.config)
        if self.session.config.graph_banks:
            return self._create_banks()
        config = self.session.config
        layers = self.flattened_callables  # every graphed layer, chunk by chunk
        scope = scope_label(self.config.cuda_graph_modules) + (" (slot-shared)" if config.slot_capture else "")
        backend = self.capture_backend()
        attempt = _Attempt(
            scope,
            layers,
            time.perf_counter(),
            _CaptureTracker(layers, inject_at=config.inject_capture_failure, is_capturing=backend.is_capturing),
            what=f"CUDA graph capture ({scope})",
            undone="Everything the capture changed was rolled back.",
            megatron_lifecycle=True,
        )
        phases = _Phases()  # where capture time goes, for the report (the plugin's cost is the non-capture part)
        # The last eager step's MoE dispatcher state holds that step's autograd graph: dropped first
        # (the next forward sets it anew), so no stale-graph check has it to collect.
        self._clear_moe_scratch()
        if config.stale_graph_check == "before":
            with phases("stale-graph check"):
                allowed = self._stale_graphs_allow_capture(attempt)
            if not allowed:
                return
        if not self._memory_allows_capture(attempt):
            return
        # The default check costs nothing on success: it lists the heap only after a failed, rolled-back
        # capture. Garbage needs no check: Megatron's _start_capturing collects it first (0.19.2 l.2662).
        try:
            baseline, capture, counter = self._capture_in_transaction(backend, attempt.tracker, phases)
        except Exception as error:  # noqa: BLE001 - every failure is rolled back, then explained, raised or logged
            self._capture_failed(error, attempt)
            return
        self._baseline = baseline
        self.capture_stats = self._capture_stats(
            attempt,
            graphs=sum(len(layer.cuda_graphs) for layer in layers),
            replays=counter,
            baseline=baseline,
            phases=dict(phases.seconds),
            slot_layers=_slot_layer_stats(capture.graphs),
        )

    def _capture_in_transaction(
        self, backend: GraphBackend, tracker: _CaptureTracker, phases: _Phases
    ) -> tuple[accounting.MemoryState, _CaptureCall, accounting.ReplayCounter]:
        """One capture through Megatron's ``create_cudagraphs``; on any error everything it changed
        is rolled back before the error propagates."""
        from megatron.core.transformer import cuda_graphs

        with contextlib.ExitStack() as scope_of_transaction:
            with phases("rollback snapshot"):
                baseline = accounting.memory_state()
                transaction = scope_of_transaction.enter_context(
                    CaptureTransaction(self._restorables(self.flattened_callables))
                )
            # The capture wrappers are the transaction's: gone when it ends, after success too.
            scope_of_transaction.enter_context(tracker.installed())
            capture = _CaptureCall(backend, transaction, tracker)
            # Megatron's own lifecycle (start, input data, the capture, graph i handed to its layer
            # and microbatch, finish) with the plugin's capture call in place of TE's.
            with (
                phases("Megatron and TE capture"),
                foreign_state.setting(cuda_graphs, "make_graphed_callables", capture, change="megatron-capture-call"),
            ):
                super().create_cudagraphs()
            with phases("replay contracts"):
                counter = self._hold_to_contracts(capture, self.session.config.contract_check)
        return baseline, capture, counter

    def capture_backend(self) -> GraphBackend:
        """The class's backend if bound with one, else what the config asks for: slot-shared
        capture with in-graph offload under ``--cg-slot-capture``, TE's capture otherwise."""
        if self.backend is not None:
            return self.backend
        if self.session.config.slot_capture:
            return SlotBackend(copies=OffloadCopies.of(self.session.config), debug=self.session.config.slot_debug)
        return TEBackend()

    def _create_banks(self) -> None:
        """Hybrid CP: one bank per power-of-two CP size for every layer, in one pool
        (``banks.capture``); ``capture_banks`` leaves no layer banked if it fails."""
        from megatron.core import parallel_state

        config = self.session.config
        layers = self.flattened_callables
        unbanked = sorted({type(layer).__name__ for layer in layers if not getattr(type(layer), "graph_banks", False)})
        if unbanked:
            raise CaptureFailedError(
                f"--cg-graph-banks needs the banked layer class in the model's layer spec, but {unbanked} were "
                "built; use the plugin's launcher (python -m megatron_cg_plugin.pretrain_gpt), or set "
                "megatron_cg_plugin.banks.dynamic_cp.adapt_layer_spec(spec, rope=..., banks=True) on the model's "
                "layer spec."
            )
        dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        sizes = bank_sizes(dp_cp, config.bank_min_cp)
        groups = {
            size: parallel_state.get_hybrid_data_context_parallel_groups(group_size=size) if size > 1 else None
            for size in sizes
        }
        capacity = graph_banks.ThdCapacity(self.config.max_seqlen_per_dp_cp_rank, config.thd_capacity)
        scope = f"{scope_label(self.config.cuda_graph_modules)} (banks CP {'/'.join(map(str, sizes))})"
        # Banks capture each layer's forward and backward back to back; the tracker names which ran.
        attempt = _Attempt(
            scope,
            layers,
            time.perf_counter(),
            _CaptureTracker(layers, inject_at=None, is_capturing=lambda: False),
            what="graph bank capture",
            undone="No layer was left banked.",
            megatron_lifecycle=False,
        )
        baseline = accounting.memory_state()
        try:
            # capture_banks resets the graphs it made itself; the transaction puts back what the capture
            # changed, a layer's banks included (none is left banked, whatever failed).
            banked_layers = [attribute(layer, "_graph_banks") for layer in layers]
            with CaptureTransaction(self._restorables(layers) + banked_layers), attempt.tracker.installed():
                banks = graph_banks.capture_banks(
                    layers,
                    groups,
                    capacity,
                    rope_tables=graph_banks.bank_rope_tables(self.model[0], groups, capacity),
                    debug=config.slot_debug,
                    contract_check=config.contract_check,
                    step_marks=self._contract_step_marks(),
                    offload_copies=OffloadCopies.of(config),
                )
        except Exception as error:  # noqa: BLE001 - rolled back and nothing left banked; raise or go on eagerly
            self._capture_failed(error, attempt)
            return
        self._banks = banks
        self._baseline = baseline
        self._graphs_created = True
        self._capture_finished = True
        self.capture_stats = self._capture_stats(
            attempt,
            graphs=banks.graph_count,
            replays=banks.replay_counts(),
            baseline=baseline,
            banks=lambda: banks.report()["banks"],
        )

    def _graphed_parameters(self) -> list[Any]:
        return [p for layer in self.flattened_callables for p in layer.parameters()]

    def _tolerate_stale_graphs(self) -> bool:
        """TE's capture was seen to succeed with the graphs ``stale_graphs.TOLERATED_HOLDERS`` name;
        slot-shared capture takes every parameter's gradient and failed on one."""
        return not self.session.config.slot_capture

    def _stale_graphs_allow_capture(self, attempt: _Attempt) -> bool:
        """``--cg-stale-graph-check before``: the check runs before capture changes anything, so a
        refusal needs no rollback."""
        try:
            tolerated = stale_graphs.ensure_no_stale_graphs(
                self._graphed_parameters(), tolerate=self._tolerate_stale_graphs()
            )
        except stale_graphs.StaleAutogradGraphError as refusal:
            self._refuse(refusal, attempt, "refused before capture")
            return False
        for graph in tolerated:
            logger.info(
                "capture proceeds with a tolerated live autograd graph: %s held by %s",
                graph.root,
                "; ".join(graph.holders),
            )
        return True

    def _memory_allows_capture(self, attempt: _Attempt) -> bool:
        """The memory guard, before capture changes anything: the planner's prediction of the capture
        (``RunSession.prediction``, for the built model's config) against what is free now
        (``read_free_memory``). A capture that would not fit is refused (``_refuse``) naming the setups
        that would; one close to the limit is logged once, on rank 0. Runs the planner did not predict
        (no settings seen, a layout it does not model, graph banks) capture unguarded."""
        settings, plan = self.session.settings, self.session.prediction.graph_memory
        if settings is None or plan is None:
            return True
        config = self.session.config
        verdict = memory_guard.check_capture_memory(
            plan,
            read_free_memory(config.memory_budget_gib),
            settings=with_model_config(settings, self.config),
            config=config,
        )
        if verdict.fit is memory_guard.Fit.DOES_NOT_FIT:
            self._refuse(CaptureWontFitError(verdict.message(attempt.what)), attempt, "refused before capture")
            return False
        if verdict.fit is memory_guard.Fit.CLOSE and not self._warned_close_to_memory_limit:
            self._warned_close_to_memory_limit = True
            if self.session.probe.is_rank0():
                logger.warning("%s", verdict.message(attempt.what))
        return True

    def _stale_graphs_refuse_after_failure(self, error: Exception, attempt: _Attempt) -> bool:
        """After a failed, rolled-back capture: True when it was refused for live eager graphs
        reaching the graphed parameters (named, in place of the bare CUDA error). A refusal raised
        inside the capture (slot-shared capture's own check) is that refusal. The diagnosis never
        hides the capture's own failure: if it fails itself, the failure goes on as it came."""
        found = next(
            (link for link in stale_graphs.chain(error) if isinstance(link, stale_graphs.StaleAutogradGraphError)), None
        )
        try:
            if found is None:
                stale_graphs.diagnose_failed_capture(
                    self._graphed_parameters(), error, tolerate=self._tolerate_stale_graphs()
                )
        except stale_graphs.StaleAutogradGraphError as refusal:
            found = refusal
        except Exception as diagnosis_error:  # noqa: BLE001 - the capture's failure is what must be reported
            logger.warning(
                "the stale-graph check after the failed capture failed itself (%s: %s); reporting the "
                "capture's failure as it came.",
                type(diagnosis_error).__name__,
                diagnosis_error,
            )
            return False
        if found is None:
            return False
        self._empty_cache()
        self._refuse(
            found, attempt, f"refused after a failed capture ({attempt.tracker.where}: {type(error).__name__}: {error})"
        )
        return True

    @staticmethod
    def _empty_cache() -> None:
        """Gives the failed capture's pool back (harmless without CUDA)."""
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()

    def _refuse(self, refusal: RuntimeError, attempt: _Attempt, when: str) -> None:
        """A refusal (live eager graphs, a capture that would not fit in memory): nothing is left
        captured. With ``raise`` the phase stays open, so capture may run again once the cause is
        gone (before a capture the helper is exactly as it was; after a failed one, rolled back and
        reset by Megatron's post-capture reset). With ``eager`` the phase is marked done, the report
        says why, and training goes on eagerly."""
        if self.session.config.on_capture_error == "raise":
            raise refusal
        self._record_failure(attempt, f"{when}: {refusal}")
        logger.warning("%s; training continues eagerly (--cg-on-capture-error eager).", refusal)

    def _record_failure(self, attempt: _Attempt, failure: str) -> None:
        """No graphs for this phase: the report shows why, and Megatron's loop must not try again
        every step."""
        self._capture_finished = True
        self.capture_stats = self._capture_stats(
            attempt, graphs=0, replays=accounting.ReplayCounter(len(attempt.layers)), baseline=None, failure=failure
        )

    @staticmethod
    def _capture_stats(
        attempt: _Attempt,
        *,
        graphs: int,
        replays: accounting.ReplayTotals,
        baseline: accounting.MemoryState | None,
        **details: Any,
    ) -> CaptureStats:
        """What the report shows of a capture, captured or failed: its time so far and the graph-pool
        bytes it added over ``baseline`` (None: a failed capture, which holds none)."""
        return CaptureStats(
            scope=attempt.scope,
            layers=len(attempt.layers),
            graphs=graphs,
            seconds=time.perf_counter() - attempt.start,
            pool_bytes=0
            if baseline is None
            else accounting.new_pool_bytes(baseline.pools, accounting.memory_state().pools),
            replays=replays,
            **details,
        )

    def _hold_to_contracts(self, capture: _CaptureCall, mode: ContractCheck) -> accounting.ReplayCounter:
        """Wraps each graph Megatron handed to a layer with its replay contract (recorded from that
        graph's own sample arguments, found by identity; none with ``--cg-contract-check off``) and
        its replay counter. A layer's contracts, one per microbatch, share one held state, so its
        parameters and groups are read once a run for all of them (``HeldState``)."""
        if capture.graphs is None:
            raise CaptureFailedError(
                "Megatron's create_cudagraphs returned without calling make_graphed_callables: this megatron-core "
                "release captures differently; install the supported megatron-core (docs/versions.md)."
            )
        index_of = {id(graph): index for index, graph in enumerate(capture.graphs)}
        counter = accounting.ReplayCounter(len(self.flattened_callables))
        step_marks = self._contract_step_marks()
        for slot, layer in enumerate(self.flattened_callables):
            wrapped = []
            held = None if mode is ContractCheck.OFF else HeldState.of(layer, step_marks=step_marks)
            for microbatch, graph in enumerate(layer.cuda_graphs):
                index = index_of.get(id(graph))
                if index is None:
                    raise CaptureFailedError(
                        f"{_layer_label(layer, slot)} was handed a graph make_graphed_callables did not return: this "
                        "megatron-core release hands graphs out differently; install the supported one "
                        "(docs/versions.md)."
                    )
                contract = (
                    None
                    if mode is ContractCheck.OFF
                    else ReplayContract.record(
                        f"{_layer_label(layer, slot)} microbatch {microbatch}",
                        capture.sample_args[index],
                        capture.sample_kwargs[index] or {},
                        held=held,
                    )
                )
                wrapped.append(CheckedGraph(graph, contract, mode, counter, slot))
            layer.cuda_graphs = wrapped
        return counter

    def _contract_step_marks(self) -> StepMarks | None:
        """The run's step marks where Megatron's DDP keeps parameters in place within a step, so the
        replay contracts may read them once a step; None (read on every replay) elsewhere."""
        return self.session.step_marks if parameters_stay_within_a_step(self.model) else None

    def _release_failed_capture(self) -> None:
        """After the transaction rolled back: Megatron's own post-capture reset. Garbage is
        collected later, once the stale-graph check has looked at it."""
        with contextlib.suppress(Exception):  # a sticky CUDA error must not hide the real cause
            torch.cuda.synchronize()
        with contextlib.suppress(Exception):
            self._reset_after_capture()  # zero grad buffers, MoE metrics, temporary tensors
        self._graphs_created = False

    def _capture_failed(self, error: Exception, attempt: _Attempt) -> None:
        """How every failed capture ends, once its transaction rolled back what it changed: after
        Megatron's own lifecycle, Megatron's post-capture reset and (``--cg-stale-graph-check
        refuse``) the stale-graph diagnosis, which may refuse in place of the bare error; then what
        the capture held is freed, the report records where and why, and the error is raised as
        ``CaptureFailedError`` or training goes on eagerly (``--cg-on-capture-error``)."""
        if attempt.megatron_lifecycle:
            self._release_failed_capture()
            if self.session.config.stale_graph_check == "refuse" and self._stale_graphs_refuse_after_failure(
                error, attempt
            ):
                return
        gc.collect()
        self._empty_cache()
        where = attempt.tracker.where
        cause = f"{type(error).__name__}: {error}"
        self._record_failure(attempt, f"{where}: {cause}")
        if self.session.config.on_capture_error == "raise":
            raise CaptureFailedError(
                f"{attempt.what} failed in {where}: {cause}\n{attempt.undone} Fix the cause "
                "(docs/troubleshooting.md), or pass --cg-on-capture-error eager to keep training without graphs."
            ) from error
        logger.warning(
            "%s failed in %s: %s; rolled back, training continues eagerly (--cg-on-capture-error eager).",
            attempt.what,
            where,
            cause,
        )

    # -- teardown -----------------------------------------------------------------------------
    def cuda_graph_set_manual_hooks(self) -> None:
        # Nothing to hook after a failed capture; graph banks refuse the flags the hooks serve.
        if self.graphs_created() and self._banks is None:
            super().cuda_graph_set_manual_hooks()

    def delete_cuda_graphs(self) -> None:
        """Frees every graph and its pools; harmless when there is nothing to delete. Afterwards a
        new capture may run (``create_cudagraphs`` again)."""
        if not self.graphs_created():
            return
        if self._banks is not None:
            self._banks.reset()
            self._banks = None
        super().delete_cuda_graphs()
        self._clear_moe_scratch()
        gc.collect()
        if torch.cuda.is_initialized():  # graphs were captured, so only a CPU test lacks it
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if self._baseline is not None:
            self.teardown_stats = self._measure_teardown(self._baseline)
        self._capture_finished = False

    def _clear_moe_scratch(self) -> None:
        """An MoE layer's dispatcher keeps the last forward's per-forward state on its attributes
        (``capture.scratch``): before a capture, the last eager step's, with its autograd graph;
        after one, the last graph's, in its pool, which would then outlive the graphs. The next
        forward sets it anew."""
        for layer in self.flattened_callables:
            if getattr(getattr(getattr(layer, "mlp", None), "token_dispatcher", None), "cudagraph_attrs", None):
                clear(moe_dispatcher_scratch(layer))

    @staticmethod
    def _measure_teardown(baseline: accounting.MemoryState) -> accounting.TeardownStats:
        """What teardown left, and what holds the pool blocks still allocated (for the report)."""
        stats = accounting.teardown_stats(baseline, accounting.memory_state())
        if not stats.pool_bytes_left:
            return stats
        blocks = accounting.blocks_of_new_pools(baseline, accounting.allocator_segments())
        holders = tuple(
            f"{tuple(t.shape)} {t.dtype} held by {'; '.join(stale_graphs.describe_holders(t)) or 'nothing in Python'}"
            for t in stale_graphs.tensors_in(blocks)[:4]
        )
        logger.warning(
            "after delete_cuda_graphs %.2f MiB stay in graph pools: %s",
            stats.pool_bytes_left / 2**20,
            "; ".join(holders) or "no Python tensor there (a library workspace)",
        )
        return dataclasses.replace(stats, pool_holders=holders)


def _slot_layer_stats(graphs: Any) -> Callable[[], tuple] | None:
    """Per graphed layer, what its slot-shared graphs hold, read live (the delayed-flush counts grow
    in training); None for TE's graphs."""
    slotted = tuple(graph for graph in graphs or () if isinstance(graph, SlotLayerGraph))
    return (lambda: tuple(graph.stats for graph in slotted)) if slotted else None


def parameters_stay_within_a_step(model: Iterable[Any]) -> bool:
    """Whether every model chunk is wrapped in Megatron's ``DistributedDataParallel``, which leaves
    parameters where they are within a step (what re-points them, a checkpoint load, does so between
    steps), so a layer's contracts may read them once a step (``HeldState``). Megatron-FSDP and torch
    FSDP2 wrap chunks in other classes and regather parameters around each forward; any wrapper not
    known to keep them counts as moving them."""
    try:
        from megatron.core.distributed import DistributedDataParallel
    except ImportError:  # no Megatron: nothing known to keep them
        return False
    return all(isinstance(chunk, DistributedDataParallel) for chunk in model)


def bind_helper_class(base: type, session: RunSession, backend: GraphBackend | None = None) -> type:
    """A subclass of ``base`` (Megatron's helper) whose instances report to ``session`` and capture
    through ``backend`` (by default the one the run's config asks for: ``capture_backend``)."""
    return type(
        "PluginTECudaGraphHelper",
        (PluginHelperMixin, base),
        {"session": session, "backend": backend, "__module__": __name__},
    )
