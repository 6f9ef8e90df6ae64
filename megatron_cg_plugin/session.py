"""One training run as the plugin sees it: per-iteration metrics, the helpers Megatron created, and
the report and files written when the run ends.

The session is fed by the hooks (the ``train_step`` timer marks an iteration's start, the
``training_log`` tap hands over its values) and never reaches into Megatron itself; device access
goes through a small ``_DeviceProbe`` so the bookkeeping is tested on CPU.

Recording costs the step nothing on the device: no hook synchronizes, and values Megatron hands
over as device tensors (the loss) are kept as they are and read to the host in one go every
``read_every`` iterations and when the run ends. Step time is the host's wall clock from one
``train_step`` start to the next (``IterationRecord``). Each step records only what the run asked
for: the values only for ``--cg-metrics-out``, the times for it, ``--cg-report-out`` or the printed
report, and nothing at all with none of them (``keeps_values``, ``times_steps``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from megatron_cg_plugin import refusal, rules
from megatron_cg_plugin.capture import accounting
from megatron_cg_plugin.capture.step_marks import StepMarks
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.golden import GoldenValues, MetricsRecorder
from megatron_cg_plugin.moe.capacity import uniform_load
from megatron_cg_plugin.planner.prediction import RunPrediction, predict_run
from megatron_cg_plugin.report import RunReport, ScopeReport
from megatron_cg_plugin.settings import RunSettings

__all__ = ["CaptureStats", "CudaProbe", "IterationRecord", "RunPrediction", "RunSession"]


class _DeviceProbe(Protocol):
    def allocated_bytes(self) -> tuple[int, int]: ...  # (now, peak)
    def is_rank0(self) -> bool: ...


class CudaProbe:
    """The real device, through the caching allocator's counters: host-side, so reading them
    waits for nothing on the device."""

    def allocated_bytes(self) -> tuple[int, int]:
        import torch

        # torch.cuda.memory_allocated() and max_memory_allocated() each flatten and sort every
        # allocator statistic (122, 172-184 us for the two, measured on a GPU host): one nested read gives both.
        allocated = torch.cuda.memory_stats_as_nested_dict().get("allocated_bytes", {}).get("all", {})
        return allocated.get("current", 0), allocated.get("peak", 0)

    def is_rank0(self) -> bool:
        import torch.distributed as dist

        return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


@dataclasses.dataclass(frozen=True)
class IterationRecord:
    """One logged iteration. ``seconds`` is its time as Megatron's ``interval-time`` timer gives
    it per iteration (its TensorBoard ``iteration-time``): host wall clock from this iteration's
    ``train_step`` start to the next one's. Nothing here synchronizes: Megatron's step itself waits
    for the device (its optimizer reads the grad norm, and train_step the reduced grad norm and the
    loss scale, to the host), so in steady state the step's GPU work is done before the next start.
    It ends earlier where a graph capture starts before the next iteration (capture is no step's
    time; the report gives it apart), and at its own ``training_log`` when no next start comes (the
    run's last iteration: the loss reduction launched after Megatron's last host read is left out).
    Unlike Megatron's timer it includes an evaluation or checkpoint save run after the step
    (Megatron stops its timer for those). None when the start was not marked (no train_step
    timer)."""

    iteration: int
    seconds: float | None
    graphed: bool


@dataclasses.dataclass
class _Logged:
    """One ``training_log`` call: its iteration's start and the host clock at the call, the next
    iteration's start once it comes, and the values as Megatron handed them (device tensors until
    ``RunSession`` reads them)."""

    iteration: int
    graphed: bool
    start: float | None
    logged_at: float
    values: dict[str, Any]
    end: float | None = None  # the next iteration's start, or the start of a capture before it

    @property
    def seconds(self) -> float | None:
        if self.start is None:
            return None
        return (self.logged_at if self.end is None else self.end) - self.start


@dataclasses.dataclass(frozen=True)
class CaptureStats:
    """What one helper captured; filled in by the helper after ``create_cudagraphs``."""

    scope: str
    layers: int
    graphs: int
    seconds: float
    pool_bytes: int
    replays: accounting.ReplayTotals  # a ReplayCounter; for graph banks, BankReplayCounts
    failure: str | None = None  # "<layer>: <cause>" when capture failed and was rolled back
    banks: Callable[[], list[dict[str, int]]] | None = None  # graph banks: live per-bank counts
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per capture phase
    slot_layers: Callable[[], tuple] | None = None  # --cg-slot-capture: live per-layer slot_backend.LayerSlotStats


def _slot_fields(stats: CaptureStats) -> dict[str, Any]:
    """Slot-shared capture's arenas, and the bytes its graphs offloaded: each layer's per-replay
    bytes times the forward replays counted for that layer."""
    if stats.slot_layers is None:
        return {}
    layers = stats.slot_layers()
    return {
        "arena_bytes": sum(layer.arena_bytes for layer in layers),
        "host_arena_bytes": sum(layer.host_arena_bytes for layer in layers),
        "boundary_bytes": sum(layer.boundary_bytes for layer in layers),
        "offloaded_bytes": sum(layer.offloaded_bytes * replays for layer, replays in zip(layers, stats.replays.counts)),
        "offload_groups_flushed": sum(layer.offload_groups_flushed for layer in layers),
    }


class RunSession:
    def __init__(
        self,
        config: PluginConfig | Callable[[], PluginConfig] | None = None,
        *,
        probe: _DeviceProbe | None = None,
        clock: Callable[[], float] = time.perf_counter,
        launcher: bool = False,
        read_every: int = 1000,
        parsed_args: Callable[[], Any] | None = None,
    ) -> None:
        # A callable defers the config until first use: install() may run before Megatron has
        # parsed the --cg-* flags (Megatron's validate_args then resolves it, see resolve_config).
        self._explicit = config if isinstance(config, PluginConfig) else None
        self._config: PluginConfig | None = self._explicit
        self._config_source: Callable[[], PluginConfig] = config if callable(config) else PluginConfig
        # Megatron's parsed args (None before its parser ran), for a run whose flags its validate_args never
        # took (ensure_checked); None once they were, or where nothing is to be checked (a session of its own).
        self._unchecked_args = parsed_args
        self.launcher = launcher  # the plugin's launcher feeds the data: its own rules apply
        self.probe: _DeviceProbe = probe or CudaProbe()
        self.clock = clock
        if read_every < 1:
            raise ValueError(f"read_every={read_every}: read the kept device values every 1 or more iterations.")
        # Each kept device value holds a small allocator block (512 bytes) until it is read, and a
        # read synchronizes once: every 1000 iterations bounds the one and amortizes the other.
        self.read_every = read_every
        self.helpers: list[Any] = []
        self._logged: list[_Logged] = []
        self._read_upto = 0  # _logged[:_read_upto] hold host numbers only
        self._iteration_start: float | None = None
        self.step_marks = StepMarks()  # entered around each schedule run train_step makes (train-step-timer patch)
        self._pending_mtp: dict[str, Any] = {}  # this iteration's mtp_N loss, until training_log records it
        self._finished: RunReport | None = None
        self.settings: RunSettings | None = None  # the run's settings, once the rules passed them (take_settings)
        self.prediction = RunPrediction()  # until the rules' check makes one (predict)
        self.moe_dropped_fraction: float | None = None  # --cg-moe-drop-stats: rank 0's routers over the run
        # Megatron's evaluations during training: their losses by the iteration they followed (device values until
        # read, like the training ones), and what the graphed layers did inside them.
        self._validations: list[tuple[int, dict[str, Any]]] = []
        self.evaluations = 0
        self.evaluation_eager_layer_calls = 0
        self.evaluation_replays = 0

    def check_flags(self, args: Any, *, environ: Mapping[str, str], host_rules: bool = False) -> None:
        """Megatron's parsed ``args`` through the rules: the run's settings read from them and every rule on
        those (``rules.check_run``; the host's too unless ``host_rules`` is off: the validate-args hook asks
        them once the flags passed, ``refusal.refuse_host``), a broken one turned into the refusal that stops
        the run here (``refusal.refuse``); for the launcher, its model config's own checks too
        (``refusal.enforce_model_config``). The session's explicit config wins, else the flags' resolves it,
        and the session takes the run's settings."""
        self._unchecked_args = None  # checked once, whatever the verdict
        try:
            settings, resolved = rules.check_run(
                args, env=environ, launcher=self.launcher, config=self._explicit, host_rules=host_rules
            )
        except rules.RuleViolation as violation:
            raise refusal.refuse(violation.violations, environ=environ) from None
        if self.launcher:
            refusal.enforce_model_config(args, environ=environ)
        self.resolve_config(resolved)
        self.take_settings(settings)

    def take_settings(self, settings: RunSettings) -> None:
        """The rules passed the run's ``settings``: kept, and the planners predict the run under the
        config in force (``planner.prediction.predict_run``) for the report."""
        self.settings = settings
        self.predict(predict_run(settings, self.config))

    def predict(self, prediction: RunPrediction) -> None:
        """The rules' check predicted the run (once its flags were validated)."""
        self.prediction = prediction

    def record_moe_drops(self, fraction: float) -> None:
        """``--cg-moe-drop-stats``: the fraction of assignments rank 0's routers dropped over the run."""
        self.moe_dropped_fraction = fraction

    @property
    def config_resolved(self) -> bool:
        return self._config is not None

    def adopt_config(self, config: PluginConfig) -> None:
        """A config given explicitly before the deferred one was used: it wins from now on."""
        assert self._config is None, "the config was already used"
        self._explicit = self._config = config

    def resolve_config(self, config: PluginConfig | None) -> None:
        """Megatron validated the flags: the run's config is the one they describe (unless one was
        given explicitly, or already used)."""
        if self._config is None and config is not None:
            self._config = config

    def ensure_checked(self) -> None:
        """The run's flags through the rules where Megatron's ``validate_args`` did not take them (a
        ``--yaml-cfg`` run calls ``validate_yaml`` instead): at the first read of the config or the
        settings, before any capture; nothing where they were checked or no args were parsed."""
        if self.settings is not None or self._unchecked_args is None:
            return
        args = self._unchecked_args()
        if args is not None:
            self.check_flags(args, environ=os.environ, host_rules=True)  # this host runs them: ask it too

    @property
    def config(self) -> PluginConfig:
        if self._config is None:
            self.ensure_checked()  # resolves it from the flags Megatron parsed
        if self._config is None:
            self._config = self._config_source()
        return self._config

    @property
    def keeps_values(self) -> bool:
        """Each iteration's values (loss, num-zeros, MTP losses, memory) are kept only where the run
        writes its metrics (``--cg-metrics-out``): nothing else reads them."""
        return self.config.metrics_out is not None

    @property
    def times_steps(self) -> bool:
        """Iterations are timed (one host clock read at each start) where the metrics, the report
        file, the printed report or TensorBoard will show them; with none of these the hooks do nothing."""
        config = self.config
        return (
            config.metrics_out is not None
            or config.report_out is not None
            or config.print_report
            or config.log_to_tensorboard
        )

    # -- hooks -------------------------------------------------------------------------------
    def attach_helper(self, helper: Any) -> None:
        self.ensure_checked()  # before any capture, for a run whose flags Megatron's validation did not take
        _ = self.config
        self.helpers.append(helper)

    def model_config_seen(self, model_config: Any) -> None:
        """The built model's ``TransformerConfig``, before capture: a field a user's script set on
        it beyond the flags (FP8 attention has no flag in 0.19.2) is in the report's prediction."""
        if self.prediction.repredict is not None:
            self.prediction = dataclasses.replace(self.prediction, graph_memory=self.prediction.repredict(model_config))

    def mark_iteration_start(self) -> None:
        """Called as each iteration starts (and by any caller per microbatch); only the first of an
        iteration counts. It reads the host clock only: it ends the iteration logged before."""
        if self._iteration_start is None and self.times_steps:
            now = self.clock()
            self._end_last_iteration(now)
            self._iteration_start = now

    def mark_capture_start(self) -> None:
        """A graph capture starts (Megatron captures between iterations, before the train_step of
        the first graphed one): the iteration logged before ends here, so no step carries it."""
        if self._iteration_start is None:
            self._end_last_iteration(self.clock())

    def _end_last_iteration(self, now: float) -> None:
        if self._logged and self._logged[-1].end is None:
            self._logged[-1].end = now

    def on_training_log(self, *, iteration: int, loss_dict: Mapping[str, Any], num_zeros_in_grad: Any = None) -> None:
        """The iteration's values as Megatron's ``training_log`` gets them; device tensors are kept
        (detached), not read: Megatron builds each iteration's loss as a new tensor and neither
        it nor training_log writes to it afterwards (0.19.2 train_step and training_log)."""
        if not self.times_steps:  # resolves a deferred config at the first iteration at the latest
            return
        if self._logged and iteration <= self._logged[-1].iteration:
            raise ValueError(
                f"training_log at iteration {iteration} after iteration {self._logged[-1].iteration}: "
                "iterations must increase; log each iteration once, in order."
            )
        values: dict[str, Any] = {}
        if self.keeps_values:
            allocated, peak = self.probe.allocated_bytes()
            values["mem-allocated-bytes"], values["mem-max-allocated-bytes"] = float(allocated), float(peak)
            if "lm loss" in loss_dict:
                values["lm loss"] = _kept(loss_dict["lm loss"])
            if num_zeros_in_grad is not None:
                values["num-zeros"] = _kept(num_zeros_in_grad)
            values.update(self._pending_mtp)  # recorded inside this training_log call (patch mtp-loss-tap)
        self._pending_mtp = {}
        graphed = any(helper.graphs_created() for helper in self.helpers)
        self._logged.append(_Logged(iteration, graphed, self._iteration_start, self.clock(), values))
        self._iteration_start = None
        if len(self._logged) - self._read_upto >= self.read_every:
            self._read()

    def on_mtp_losses(self, losses: Mapping[str, Any]) -> None:
        """The iteration's multi-token-prediction losses (``mtp_1 loss`` ...), kept for its record."""
        if self.keeps_values:
            self._pending_mtp.update({name: _kept(value) for name, value in losses.items()})

    @contextlib.contextmanager
    def evaluating(self, model_chunks: Iterable[Any]) -> Iterator[None]:
        """Around one Megatron evaluation: counts the calls of graphed layers (those holding graphs) inside it,
        which run eagerly (Megatron replays only in training mode), and the replays, which must stay none. The
        hooks live for the evaluation only: training steps pay nothing."""
        graphed = [
            module
            for chunk in model_chunks
            for module in chunk.modules()
            if getattr(module, "cuda_graphs", None)  # Megatron's TE graph path: a layer's captured graphs
        ]
        calls = [0]

        def count(module: Any, args: Any) -> None:
            calls[0] += 1

        handles = [layer.register_forward_pre_hook(count) for layer in graphed]
        replays_before = self._replays()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.evaluations += 1
            self.evaluation_eager_layer_calls += calls[0]
            self.evaluation_replays += self._replays() - replays_before

    def _replays(self) -> int:
        stats = [getattr(helper, "capture_stats", None) for helper in self.helpers]
        return sum(stat.replays.total for stat in stats if stat is not None)

    def on_evaluation(self, loss_dict: Mapping[str, Any]) -> None:
        """An evaluation's losses (Megatron's ``evaluate`` result), recorded as ``<name> validation`` (its
        TensorBoard tag) at the iteration the evaluation followed, a further validation set of that iteration
        (``--multiple-validation-sets``) as ``<name> validation-<k>``; kept only with ``--cg-metrics-out``."""
        if self.keeps_values and loss_dict:
            iteration = self.last_iteration
            earlier = sum(step == iteration for step, _ in self._validations)
            suffix = f"-{earlier}" if earlier else ""
            self._validations.append(
                (iteration, {f"{name} validation{suffix}": _kept(value) for name, value in loss_dict.items()})
            )

    @property
    def last_iteration(self) -> int:
        """The last iteration logged (0 before the first)."""
        return self._logged[-1].iteration if self._logged else 0

    def _read(self) -> None:
        """Reads every kept device value to the host (each read waits for the device)."""
        for logged in self._logged[self._read_upto :]:
            logged.values = {name: _as_float(value) for name, value in logged.values.items()}
        self._read_upto = len(self._logged)
        self._validations = [(step, {n: _as_float(v) for n, v in values.items()}) for step, values in self._validations]

    # -- results -----------------------------------------------------------------------------
    @property
    def iterations(self) -> list[IterationRecord]:
        """Every logged iteration with its time so far (the last one's may still grow: it ends at
        the next start)."""
        return [IterationRecord(logged.iteration, logged.seconds, logged.graphed) for logged in self._logged]

    def metrics(self) -> GoldenValues:
        """The run's per-iteration metrics in Megatron's golden-values schema (``iteration-time``:
        ``IterationRecord.seconds``). Reads the values still on the device first."""
        self._read()
        recorder = MetricsRecorder()
        for logged in self._logged:
            seconds = logged.seconds
            recorder.record(
                logged.iteration, logged.values if seconds is None else {**logged.values, "iteration-time": seconds}
            )
        for iteration, values in self._validations:
            recorder.record(iteration, values)
        return recorder.golden()

    def report(self) -> RunReport:
        eager = [r.seconds for r in self.iterations if not r.graphed and r.seconds is not None]
        graphed = [r.seconds for r in self.iterations if r.graphed and r.seconds is not None]
        eager_median = accounting.steady_median(eager)
        graphed_median = accounting.steady_median(graphed)
        memory, moe = self.prediction.graph_memory, self.prediction.moe_capacity
        scopes = tuple(
            ScopeReport(
                scope=stats.scope,
                layers=stats.layers,
                graphs_captured=stats.graphs,
                replays=stats.replays.total,
                capture_seconds=stats.seconds,
                pool_bytes=stats.pool_bytes,
                replays_per_layer=tuple(stats.replays.counts),
                rejected=stats.replays.total_rejected,
                failure=stats.failure,
                teardown_allocated_delta_bytes=None if teardown is None else teardown.allocated_delta_bytes,
                teardown_pool_bytes_left=None if teardown is None else teardown.pool_bytes_left,
                teardown_pool_holders=() if teardown is None else teardown.pool_holders,
                banks=() if stats.banks is None else tuple(stats.banks()),
                capture_phases=dict(stats.phases),
                **_slot_fields(stats),
            )
            for stats, teardown in (
                (getattr(h, "capture_stats", None), getattr(h, "teardown_stats", None)) for h in self.helpers
            )
            if stats is not None
        )
        return RunReport(
            preset=self.config.preset,
            iterations=len(self.iterations),
            scopes=scopes,
            eager_steps=len(eager),
            graphed_steps=len(graphed),
            eager_step_ms=None if eager_median is None else 1e3 * eager_median,
            graphed_step_ms=None if graphed_median is None else 1e3 * graphed_median,
            predicted_pool_bytes=None if memory is None else memory.pool_bytes,
            prediction_leaves_out=() if memory is None else memory.unpredicted,
            predicted_host_arena_bytes=None if memory is None else memory.host_arena_bytes,
            predicted_arena_bytes=None if memory is None else memory.arena_bytes,
            predicted_boundary_bytes=None if memory is None else memory.boundary_bytes,
            moe_dropped_fraction=self.moe_dropped_fraction,
            moe_planned_capacity=None if moe is None else moe.capacity,
            moe_uniform_dropped_fraction=None if moe is None else moe.dropped_fraction(uniform_load(moe.num_experts)),
            evaluations=self.evaluations,
            evaluation_eager_layer_calls=self.evaluation_eager_layer_calls,
            evaluation_replays=self.evaluation_replays,
        )

    def finish(self, *, print_fn: Callable[[str], None] = print) -> RunReport:
        """Once per run, when training ends: writes the metrics and report files and prints the
        report (rank 0 only). Returns the report; later calls return the same one."""
        if self._finished is not None:
            return self._finished
        report = self._finished = self.report()
        self._read()  # the run is over: the kept device values are read (and freed) on every rank
        if self.probe.is_rank0():
            if self.config.metrics_out is not None:
                self.metrics().save(self.config.metrics_out)
            if self.config.report_out is not None:
                report.save(self.config.report_out)
            if self.config.print_report:
                print_fn(report.format_table())
        return report


def _kept(value: Any) -> Any:
    """A device value as it is, without its autograd graph (detaching reads nothing)."""
    return value.detach() if callable(getattr(value, "detach", None)) else value


def _as_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)
