"""The memory guard's decision (pure Python): will the capture fit in the memory free at that moment,
and if not, which other setups the planner predicts would.

Before the first capture the run compares what the planner predicts the capture reserves
(``CaptureNeed``: TE's graph pool, slot capture's GPU arenas, the static buffers outside the pool, the
pinned host arenas of in-graph offload) with what the device and the host have free
(``FreeMemory``, read by ``capture_lifecycle.read_free_memory``, or the GPU's share given by
``--cg-memory-budget-gib``). ``judge`` says whether it fits, fits close to the limit (``_CLOSE_FRACTION``,
``CLOSE_HEADROOM_BYTES``) or does not fit; ``check_capture_memory`` adds, for a capture that does not
fit, the setups that would (``fitting_setups``): of the run's setups (``setups.graph_setups``, the list
``megatron-cg tune`` weighs too), each re-predicted by the same planner and passed by the same rules as
the run's own flags, those that differ from the run's and fit.
"""

from __future__ import annotations

import dataclasses
import enum

from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.planner.graph_memory import GraphMemoryPlan
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.setups.graph_setups import CaptureNeed, GraphSetup, ModelKind, Setup, enumerate_setups, scopes

__all__ = [
    "CLOSE_HEADROOM_BYTES",
    "GIB",
    "CaptureNeed",
    "Fit",
    "FreeMemory",
    "MemoryVerdict",
    "alternative_setups",
    "check_capture_memory",
    "device_parts",
    "fitting_setups",
    "gib",
    "judge",
]

GIB = 2**30
# A capture is close to the limit where it would leave less than 10% of the free memory, or less than
# 1 GiB, unused: the planner's pools were within 8% of the measured ones (benchmarks/planner_pool), and the
# eager parts of each step (embedding, output layer, loss) allocate beside the graphs after capture.
_CLOSE_FRACTION = 0.10
CLOSE_HEADROOM_BYTES = GIB


def gib(nbytes: int) -> str:
    """Bytes as the guard's messages write them: GiB with two decimals."""
    return f"{nbytes / GIB:.2f} GiB"


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
    CLOSE = 1  # fits, within _CLOSE_FRACTION or CLOSE_HEADROOM_BYTES of the limit
    DOES_NOT_FIT = 2


def _judge_bytes(need: int, free: int | None) -> Fit:
    if free is None or need <= 0:
        return Fit.FITS
    if need > free:
        return Fit.DOES_NOT_FIT
    if need > free * (1 - _CLOSE_FRACTION) or free - need < CLOSE_HEADROOM_BYTES:
        return Fit.CLOSE
    return Fit.FITS


def judge(need: CaptureNeed, free: FreeMemory) -> Fit:
    """Whether ``need`` fits ``free``: on the GPU, and on the host for the pinned arenas of every rank
    that shares it. A part whose free bytes are not known is not checked."""
    return max(
        _judge_bytes(need.device_bytes, free.device),
        _judge_bytes(need.pinned_host * free.host_ranks, free.host),
    )


def device_parts(need: CaptureNeed) -> str:
    """``graph pool 1.00 GiB, GPU arenas 0.50 GiB``: the parts on the GPU that are not zero."""
    parts = (
        ("graph pool", need.graph_pool),
        ("GPU arenas", need.gpu_arenas),
        ("static buffers", need.static_buffers),
    )
    return ", ".join(f"{name} {gib(nbytes)}" for name, nbytes in parts if nbytes or name == "graph pool")


def alternative_setups(settings: RunSettings, config: PluginConfig) -> tuple[Setup, ...]:
    """Every other way to graph the run (``graph_setups.enumerate_setups``, built from the run's settings) that
    the rules accept and the planner predicts: the run's scope first, then the others most graphed first,
    each in the enumeration's order (TE's graphs, slot-shared, slot-shared with attention's saves offloaded
    inside the graphs). None for runs without TE graphs, or with graph banks (not predicted)."""
    if not settings.te_graphs or settings.graph_banks or config.graph_banks:
        return ()
    kind = ModelKind.of(settings)
    current = GraphSetup.of(settings)
    most_graphed_first = scopes(kind)[::-1]
    found = [
        setup
        for setup in enumerate_setups(settings, config, kind=kind)
        if setup.graph != current and not setup.refused and setup.plan is not None
    ]
    return tuple(
        sorted(
            found,
            key=lambda setup: (setup.graph.modules != settings.modules, most_graphed_first.index(setup.graph.modules)),
        )
    )


def fitting_setups(settings: RunSettings, config: PluginConfig, free: FreeMemory) -> tuple[Setup, ...]:
    """The ``alternative_setups`` of the run whose predicted need fits ``free`` (``judge``: fits or is
    close to the limit), in the same order: the setups a run that does not fit can switch to."""
    return tuple(
        setup for setup in alternative_setups(settings, config) if judge(_need(setup), free) < Fit.DOES_NOT_FIT
    )


def _need(setup: Setup) -> CaptureNeed:
    need = setup.need
    assert need is not None, "alternative_setups keeps predicted setups only"
    return need


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
        device = f"{gib(self.need.device_bytes)} on the GPU ({device_parts(self.need)}) against " + (
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
                f"{_CLOSE_FRACTION:.0%} or {gib(CLOSE_HEADROOM_BYTES)} to spare; capture goes ahead, but the eager "
                f"parts of each step allocate beside the graphs.{left_out}"
            )
        assert self.fit is Fit.DOES_NOT_FIT, self.fit
        lines = [f"{what} would not fit in memory, so nothing was captured: the planner predicts {self._comparison()}."]
        if left_out:
            lines.append(left_out.strip())
        if self.setups:
            lines.append(
                "These setups fit (the planner's prediction; add the flags to yours, replacing any of the same name, "
                "and drop those named after 'without'):"
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
    need = _need(setup)
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
