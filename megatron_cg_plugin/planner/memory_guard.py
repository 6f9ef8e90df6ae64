"""The memory guard's decision (pure Python): will the capture fit in the memory free at that moment,
and if not, which other setups the planner predicts would.

Before the first capture the run compares what the planner predicts the capture reserves
(``CaptureNeed``: TE's graph pool, slot capture's GPU arenas, the static buffers outside the pool, the
pinned host arenas of in-graph offload) with what the device and the host have free
(``FreeMemory``, read by ``capture_lifecycle.read_free_memory``, or the GPU's share given by
``--cg-memory-budget-gib``). ``judge`` says whether it fits, fits close to the limit (``CLOSE_FRACTION``,
``CLOSE_HEADROOM_BYTES``) or does not fit; ``check_capture_memory`` adds, for a capture that does not
fit, the setups that would (``fitting_setups``), each re-predicted by the same planner and passed by
the same rules as the run's own flags. ``megatron-cg tune`` reuses ``alternative_setups`` and
``fitting_setups``.
"""

from __future__ import annotations

import dataclasses
import enum

from megatron_cg_plugin import rules
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.planner.graph_memory import GraphMemoryPlan, plan_for_run
from megatron_cg_plugin.settings import RunSettings

__all__ = [
    "CLOSE_FRACTION",
    "CLOSE_HEADROOM_BYTES",
    "GIB",
    "IN_GRAPH_OFFLOAD_MODULES",
    "OFFLOAD_ENVIRONMENT",
    "CaptureNeed",
    "Fit",
    "FreeMemory",
    "MemoryVerdict",
    "Setup",
    "alternative_setups",
    "check_capture_memory",
    "fitting_setups",
    "gib",
    "judge",
]

GIB = 2**30
# A capture is close to the limit where it would leave less than 10% of the free memory, or less than
# 1 GiB, unused: the planner's pools were within 8% of the measured ones (docs/planner.md), and the
# eager parts of each step (embedding, output layer, loss) allocate beside the graphs after capture.
CLOSE_FRACTION = 0.10
CLOSE_HEADROOM_BYTES = GIB
# Megatron's offload groups of attention (the planner's in-graph offload moves attention's saves):
# the modules docs/offload.md offloads inside the graphs.
IN_GRAPH_OFFLOAD_MODULES = ("core_attn", "attn_proj")
OFFLOAD_ENVIRONMENT = "NVTE_CPU_OFFLOAD_V1=1"
# Smaller --cuda-graph-modules scopes to try, most graphed first: an MoE layer keeps its router and
# the dispatcher's preprocess in the graph, a dense layer its attention or its MLP.
_MOE_SCOPES = (("attn", "moe_router", "moe_preprocess"), ("attn",))
_DENSE_SCOPES = (("attn",), ("mlp",))


def gib(nbytes: int) -> str:
    """Bytes as the guard's messages write them: GiB with two decimals."""
    return f"{nbytes / GIB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class CaptureNeed:
    """What the planner predicts one rank's capture reserves, by part, in bytes."""

    graph_pool: int  # the graphs' private pool (TE's, or slot capture's)
    gpu_arenas: int = 0  # --cg-slot-capture: the layers' saved-tensor arenas, with the offload staging ring
    static_buffers: int = 0  # slot capture's graph outputs, gradients and parameter-gradient buffers; THD offsets
    pinned_host: int = 0  # in-graph offload: the layers' pinned host arenas

    @classmethod
    def of(cls, plan: GraphMemoryPlan) -> CaptureNeed:
        return cls(
            graph_pool=plan.pool_bytes,
            gpu_arenas=plan.arena_bytes or 0,
            static_buffers=(plan.boundary_bytes or 0) + (plan.thd_buffer_bytes or 0),
            pinned_host=plan.host_arena_bytes or 0,
        )

    @property
    def device_bytes(self) -> int:
        return self.graph_pool + self.gpu_arenas + self.static_buffers

    def device_parts(self) -> str:
        """``graph pool 1.00 GiB, GPU arenas 0.50 GiB``: the parts on the GPU that are not zero."""
        parts = (
            ("graph pool", self.graph_pool),
            ("GPU arenas", self.gpu_arenas),
            ("static buffers", self.static_buffers),
        )
        return ", ".join(f"{name} {gib(nbytes)}" for name, nbytes in parts if nbytes or name == "graph pool")


@dataclasses.dataclass(frozen=True)
class FreeMemory:
    """What capture may take at the moment it would start. ``device``: bytes free on this rank's GPU
    (None: not known, not checked); ``host``: bytes of host memory available (None: not known, not
    checked), shared by the ``host_ranks`` ranks of this host, which pin their arenas at the same time;
    ``device_source`` says where ``device`` comes from, for the messages."""

    device: int | None
    host: int | None = None
    host_ranks: int = 1
    device_source: str = "torch.cuda.mem_get_info"

    def __post_init__(self) -> None:
        assert self.device is None or self.device >= 0, self.device
        assert self.host is None or self.host >= 0, self.host
        assert self.host_ranks >= 1, self.host_ranks


class Fit(enum.IntEnum):
    """How a capture fits; a larger value is worse (``max`` of two is the verdict of both)."""

    FITS = 0
    CLOSE = 1  # fits, within CLOSE_FRACTION or CLOSE_HEADROOM_BYTES of the limit
    DOES_NOT_FIT = 2


def _judge_bytes(need: int, free: int | None) -> Fit:
    if free is None or need <= 0:
        return Fit.FITS
    if need > free:
        return Fit.DOES_NOT_FIT
    if need > free * (1 - CLOSE_FRACTION) or free - need < CLOSE_HEADROOM_BYTES:
        return Fit.CLOSE
    return Fit.FITS


def judge(need: CaptureNeed, free: FreeMemory) -> Fit:
    """Whether ``need`` fits ``free``: on the GPU, and on the host for the pinned arenas of every rank
    that shares it. A part whose free bytes are not known is not checked."""
    return max(
        _judge_bytes(need.device_bytes, free.device),
        _judge_bytes(need.pinned_host * free.host_ranks, free.host),
    )


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way to graph the run: ``flags`` to add to the run's (each replacing a flag of the same
    name: ``--cuda-graph-modules attn``, ``--cg-slot-capture``, Megatron's offload flags), the
    ``settings`` and ``config`` the run would have with them, and what the planner predicts it
    reserves (``need``)."""

    flags: tuple[str, ...]
    settings: RunSettings
    config: PluginConfig
    need: CaptureNeed
    environment: tuple[str, ...] = ()  # NAME=value the run needs with the flags

    @property
    def command_line(self) -> str:
        return " ".join(self.flags)


def _predicted(settings: RunSettings, config: PluginConfig) -> CaptureNeed | None:
    """The planner's prediction for ``settings`` (None where it does not model them)."""
    try:
        return CaptureNeed.of(plan_for_run(settings, config=config))
    except (ValueError, TypeError, AttributeError):  # the planner's refusals of a layout it does not model
        return None


def _smaller_scopes(settings: RunSettings) -> tuple[tuple[str, ...], ...]:
    return _MOE_SCOPES if settings.has_moe_layers else _DENSE_SCOPES


def _offload_modules(settings: RunSettings) -> tuple[str, ...]:
    """The run's offload modules with attention's groups added (the planner offloads attention's saves)."""
    kept = settings.offload_modules if settings.activation_offloading else ()
    return (*kept, *(module for module in IN_GRAPH_OFFLOAD_MODULES if module not in kept))


def _variant(settings: RunSettings, modules: tuple[str, ...], level: int) -> RunSettings:
    """``settings`` with graph scope ``modules``, captured by TE (level 0), slot-shared (1) or
    slot-shared with attention's saves offloaded inside the graphs (2)."""
    changed = dataclasses.replace(settings, modules=modules, slot_capture=settings.slot_capture or level >= 1)
    if level >= 2:
        changed = dataclasses.replace(changed, activation_offloading=True, offload_modules=_offload_modules(settings))
    return changed


def _environment(current: RunSettings, changed: RunSettings) -> tuple[str, ...]:
    """Megatron's validate_args asserts NVTE_CPU_OFFLOAD_V1=1 for fine-grained offload under TE >= 2.10;
    a run that offloads already has it."""
    return (OFFLOAD_ENVIRONMENT,) if changed.activation_offloading and not current.activation_offloading else ()


def _flags(current: RunSettings, changed: RunSettings) -> tuple[str, ...]:
    """The flags that turn ``current`` into ``changed``, as one pastes them."""
    flags = []
    if changed.modules != current.modules:
        flags.append(f"--cuda-graph-modules {' '.join(changed.modules)}")
    if changed.slot_capture and not current.slot_capture:
        flags.append("--cg-slot-capture")
    if changed.activation_offloading and not current.activation_offloading:
        flags.append("--fine-grained-activation-offloading")
    if changed.offload_modules != current.offload_modules:
        flags.append(f"--offload-modules {' '.join(changed.offload_modules)}")
    return tuple(flags)


def _key(settings: RunSettings) -> tuple:
    """What tells one setup from another."""
    return settings.modules, settings.slot_capture, settings.activation_offloading, settings.offload_modules


def _level(settings: RunSettings) -> int:
    if not settings.slot_capture:
        return 0
    return 2 if settings.activation_offloading and set(IN_GRAPH_OFFLOAD_MODULES) <= set(settings.offload_modules) else 1


def alternative_setups(settings: RunSettings, config: PluginConfig) -> tuple[Setup, ...]:
    """Every other way to graph the run that the planner predicts and the rules accept, most graphed
    first: the run's scope, then each smaller one (an MoE model: ``attn moe_router moe_preprocess``,
    then ``attn``; a dense one: ``attn``, then ``mlp``), each captured as the run captures or
    further along: slot-shared (``--cg-slot-capture``, whose arenas hold each layer's saves outside a
    pool the layers share), then slot-shared with attention's saves offloaded to pinned host arenas
    inside the graphs (``--fine-grained-activation-offloading --offload-modules core_attn attn_proj``
    with ``NVTE_CPU_OFFLOAD_V1=1``, copied as ``--cg-offload-copies`` says, in-graph by default; not
    for the ``moe`` scope, which Megatron refuses to offload). A setup offloading nothing more than
    the one before it is left out. None for runs without TE graphs, or with graph banks (not
    predicted). Each setup's need is the planner's prediction of it (``planner.graph_memory``)."""
    if not settings.te_graphs or settings.graph_banks or config.graph_banks:
        return ()
    current = _level(settings)
    found: list[Setup] = []
    seen = {_key(settings)}
    for modules in (settings.modules, *_smaller_scopes(settings)):
        slot_host: int | None = None  # the slot-shared capture's pinned arenas of this scope
        # Megatron's TransformerConfig refuses fine-grained offload with the moe scope (0.19.2: "Token-drop
        # MoE is temporarily not supported with activation offloading"), which the rules do not repeat.
        top = 1 if "moe" in modules else 2
        for level in range(current, top + 1):
            changed = _variant(settings, modules, level)
            if rules.violations(changed):
                continue
            changed_config = dataclasses.replace(config, slot_capture=changed.slot_capture)
            need = _predicted(changed, changed_config)
            if need is None:
                continue
            if level == 1:
                slot_host = need.pinned_host
            elif level == 2 and slot_host is not None and need.pinned_host <= slot_host:
                continue  # nothing more of this scope is big enough to offload
            if _key(changed) not in seen:
                seen.add(_key(changed))
                found.append(
                    Setup(_flags(settings, changed), changed, changed_config, need, _environment(settings, changed))
                )
    return tuple(found)


def fitting_setups(settings: RunSettings, config: PluginConfig, free: FreeMemory) -> tuple[Setup, ...]:
    """The ``alternative_setups`` of the run whose predicted need fits ``free`` (``judge``: fits or is
    close to the limit), in the same order: the setups a run that does not fit can switch to."""
    return tuple(setup for setup in alternative_setups(settings, config) if judge(setup.need, free) < Fit.DOES_NOT_FIT)


@dataclasses.dataclass(frozen=True)
class MemoryVerdict:
    """The guard's verdict on one capture: how it fits, what it needs, what was free, what the
    prediction leaves out, and (when it does not fit) the setups that would."""

    fit: Fit
    need: CaptureNeed
    free: FreeMemory
    unpredicted: tuple[str, ...] = ()
    setups: tuple[Setup, ...] = ()

    def _comparison(self) -> str:
        """Predicted against free, on the GPU and (with pinned arenas) on the host."""
        free = self.free
        device = f"{gib(self.need.device_bytes)} on the GPU ({self.need.device_parts()}) against " + (
            "an unknown amount free" if free.device is None else f"{gib(free.device)} free ({free.device_source})"
        )
        if not self.need.pinned_host:
            return device
        ranks = "" if free.host_ranks == 1 else f" x {free.host_ranks} ranks on this host"
        host = (
            f"pinned host arenas {gib(self.need.pinned_host)}{ranks} = {gib(self.need.pinned_host * free.host_ranks)} "
            + (
                "against an unknown amount available"
                if free.host is None
                else f"against {gib(free.host)} available (MemAvailable and the pinned blocks torch holds free)"
            )
        )
        return f"{device}; {host}"

    def message(self, what: str) -> str:
        """``what`` (``CUDA graph capture (layer)``) in the verdict's words: one line where it fits
        close to the limit; where it does not fit, the setups that would, as flags to paste, or eager."""
        left_out = f" The prediction leaves out: {'; '.join(self.unpredicted)}." if self.unpredicted else ""
        if self.fit is Fit.CLOSE:
            return (
                f"{what} is close to the memory limit: the planner predicts {self._comparison()}, less than "
                f"{CLOSE_FRACTION:.0%} or {gib(CLOSE_HEADROOM_BYTES)} to spare; capture goes ahead, but the eager "
                f"parts of each step allocate beside the graphs.{left_out}"
            )
        assert self.fit is Fit.DOES_NOT_FIT, self.fit
        lines = [f"{what} would not fit in memory, so nothing was captured: the planner predicts {self._comparison()}."]
        if left_out:
            lines.append(left_out.strip())
        if self.setups:
            lines.append(
                "These setups fit (the planner's prediction; add the flags to yours, replacing any of the same name):"
            )
            lines += [f"  {setup.command_line}  ({_in_words(setup, self.free)})" for setup in self.setups]
        else:
            lines.append(
                "No other graphed setup the planner knows fits: train eagerly with --cuda-graph-impl none, or "
                "free memory."
            )
        lines.append(
            "--cg-memory-budget-gib GIB sets the GPU memory capture may take in place of what is free "
            "(docs/troubleshooting.md)."
        )
        return "\n".join(lines)


def _in_words(setup: Setup, free: FreeMemory) -> str:
    """A fitting setup's prediction, how close it comes to the limit, and the environment it needs."""
    need = setup.need
    words = f"{gib(need.device_bytes)} on the GPU"
    if need.pinned_host:
        words += f", pinned host {gib(need.pinned_host)} a rank"
    if judge(need, free) is Fit.CLOSE:
        words += "; close to the limit"
    if setup.environment:
        words += f"; with {' '.join(setup.environment)} in the environment"
    return words


def check_capture_memory(
    plan: GraphMemoryPlan, free: FreeMemory, *, settings: RunSettings, config: PluginConfig
) -> MemoryVerdict:
    """The guard's verdict on the run's capture (``plan``, predicted for ``settings`` under
    ``config``) against ``free``; only a capture that does not fit looks for ``fitting_setups``."""
    need = CaptureNeed.of(plan)
    fit = judge(need, free)
    setups = fitting_setups(settings, config, free) if fit is Fit.DOES_NOT_FIT else ()
    return MemoryVerdict(fit, need, free, plan.unpredicted, setups)
