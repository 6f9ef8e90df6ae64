"""The ways to graph one model, each checked and predicted (pure: no torch, no Megatron).

A setup is the part of a run's flags that chooses its CUDA graphs: the graphed scope
(``--cuda-graph-modules``, none for the whole layer), TE's graphs or slot-shared capture
(``--cg-slot-capture``), whether the run's own offload flags are kept, and whether attention's saves
are offloaded inside slot-shared graphs (``--fine-grained-activation-offloading --offload-modules
core_attn attn_proj``, the planner's in-graph offload). ``graph_setups`` lists the setups that fit a
model's kind (``ModelKind``); ``enumerate_setups`` builds each one's settings and plugin config, checks
them with the one rule list (``rules.violations``) and predicts their graph memory with the planner
(``prediction.predict_graph_memory``). A setup the rules refuse stays in the list with its rules.

Two tools read the list: the memory guard before capture keeps the setups that differ from the run's,
pass the rules and fit the memory free (``memory_guard.fitting_setups``); ``megatron-cg tune`` adds
eager and times them (``tune.command``), building each setup from its own flags through Megatron's
validation (the ``build`` argument) where the guard, inside the run, builds them from the run's settings
(``setup_settings``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron_cg_plugin import rules
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.planner.graph_memory import GraphMemoryPlan
from megatron_cg_plugin.planner.prediction import predict_graph_memory
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.slot_sharing.offload_plan import MEGATRON_MIN_OFFLOADED_TENSOR_SIZE

__all__ = [
    "EAGER",
    "OFFLOAD_ENVIRONMENT",
    "TE_IMPL",
    "Build",
    "CaptureNeed",
    "GraphSetup",
    "ModelKind",
    "Setup",
    "enumerate_setups",
    "graph_bytes",
    "graph_setups",
    "scopes",
    "setup_offload_modules",
    "setup_settings",
]

EAGER = "eager"
TE_IMPL = "transformer_engine"
# Megatron's offload groups of attention, which the planner's in-graph offload moves to pinned host arenas
# (docs/offload.md offloads them inside the graphs).
_IN_GRAPH_OFFLOAD_MODULES = ("core_attn", "attn_proj")
# Megatron's validate_args asserts it for fine-grained offload under TE >= 2.10.
OFFLOAD_ENVIRONMENT = "NVTE_CPU_OFFLOAD_V1=1"
_MOE_PARTIAL = ("moe_router", "moe_preprocess")  # the dropless MoE scope beside attn (Megatron's static part)
# PluginConfig fields of the plugin's slot offload knobs, which only slot-shared capture or graph banks take.
_SLOT_OFFLOAD_FIELDS = ("offload_copies", "offload_window")


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


def graph_bytes(plan: GraphMemoryPlan | None) -> int | None:
    """What a setup's graphs take on the GPU beside an eager step (``CaptureNeed.device_bytes``: the pool,
    and under slot-shared capture the arenas and boundary buffers outside it, and packed graphs' offsets);
    None: not predicted."""
    return None if plan is None else CaptureNeed.of(plan).device_bytes


def _offloads(settings: RunSettings) -> bool:
    """The run offloads through Megatron's flags: the switch, and modules to offload."""
    return settings.activation_offloading and bool(settings.offload_modules)


@dataclasses.dataclass(frozen=True)
class GraphSetup:
    """One way to graph the model: ``graphed`` False is eager (the run's flags without graphs);
    ``modules`` the ``--cuda-graph-modules`` (empty: the whole layer); ``slot`` slot-shared capture;
    ``offload`` the run's own offload flags kept (eager always keeps them: it is the run's own);
    ``attention_offload`` attention's groups (``_IN_GRAPH_OFFLOAD_MODULES``) offloaded too, inside the
    slot-shared graphs."""

    graphed: bool
    modules: tuple[str, ...] = ()
    slot: bool = False
    offload: bool = False
    attention_offload: bool = False

    @classmethod
    def of(cls, settings: RunSettings) -> GraphSetup:
        """The setup a run's settings describe (TE's graphs or none)."""
        if not settings.te_graphs:
            return cls(graphed=False)
        return cls(graphed=True, modules=settings.modules, slot=settings.slot_capture, offload=_offloads(settings))

    @property
    def offloads(self) -> bool:
        return self.offload or self.attention_offload

    @property
    def label(self) -> str:
        if not self.graphed:
            return EAGER
        parts = [" ".join(self.modules) or "whole layer"]
        parts += ["slot"] if self.slot else []
        parts += ["offload"] if self.offload else []
        parts += ["attention offloaded"] if self.attention_offload else []
        return ", ".join(parts)

    @property
    def graph_flags(self) -> tuple[str, ...]:
        """The setup's graph flags: what it adds to the run's flags once their graph flags are gone."""
        if not self.graphed:
            return ()
        return (
            "--cuda-graph-impl",
            TE_IMPL,
            *(("--cuda-graph-modules", *self.modules) if self.modules else ()),
            *(("--cg-slot-capture",) if self.slot else ()),
        )


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """What of a model decides which setups fit it, read from its settings (``RunSettings``)."""

    moe: bool = False  # MoE layers (more than one expert)
    dense_layers: bool = True  # some layers have a dense MLP
    capacity_factor: float | None = None  # --moe-expert-capacity-factor (None: dropless)
    offload: bool = False  # --fine-grained-activation-offloading with --offload-modules
    recompute_norms: bool = False  # selective recompute of the layernorms
    offload_modules: tuple[str, ...] = ()  # the run's --offload-modules, where it offloads
    modules: tuple[str, ...] | None = None  # the run's own --cuda-graph-modules, where it graphs

    @classmethod
    def of(cls, settings: RunSettings) -> ModelKind:
        layers = settings.num_layers or 0
        offload = _offloads(settings)
        return cls(
            moe=settings.moe,
            dense_layers=not settings.has_moe_layers or not all(settings.is_moe_layer(i) for i in range(layers)),
            capacity_factor=settings.capacity_factor if settings.moe else None,
            offload=offload,
            recompute_norms=settings.recompute_granularity == "selective" and "layernorm" in settings.recompute_modules,
            offload_modules=settings.offload_modules if offload else (),
            modules=settings.modules if settings.te_graphs else None,
        )

    def describe(self) -> str:
        model = "dense"
        if self.moe:
            model = (
                "MoE, dropless" if self.capacity_factor is None else f"MoE, capacity factor {self.capacity_factor:g}"
            )
            model += "" if not self.dense_layers else " (with dense layers)"
        return model + (", with activation offload flags" if self.offload else "")


def scopes(kind: ModelKind) -> tuple[tuple[str, ...], ...]:
    """The graphed scopes that fit ``kind``, smallest first, the whole layer last; the run's own scope
    first where it is none of these. Dense: ``attn``, ``attn mlp``; MoE: ``attn``, ``attn moe_router
    moe_preprocess`` and, with a capacity factor, ``attn moe`` (the MoE block whole needs the capacity the
    user chose); MoE with dense layers: ``attn mlp``, and ``mlp`` in each MoE scope."""
    dense = ("mlp",) if kind.dense_layers else ()
    found: list[tuple[str, ...]] = [("attn",)]
    if kind.dense_layers:
        found.append(("attn", "mlp"))
    if kind.moe:
        found.append(("attn", *dense, *_MOE_PARTIAL))
        if kind.capacity_factor is not None:
            found.append(("attn", *dense, "moe"))
    found.append(())
    if kind.modules is not None and kind.modules not in found:
        found.insert(0, kind.modules)
    return tuple(found)


def graph_setups(kind: ModelKind) -> tuple[GraphSetup, ...]:
    """Every scope of ``kind`` (``scopes``) under TE's graphs and under slot-shared capture, each with and
    without the run's offload where the run gives offload flags, and slot-shared with attention's saves
    offloaded inside the graphs where that offloads more than the run does. Nothing here decides what the
    rules allow: a setup they refuse (the whole layer of a dropless MoE, slot capture of a partial MoE
    block, offload with the ``moe`` scope) is listed, and ``enumerate_setups`` carries their refusal."""
    offloads = (True, False) if kind.offload else (False,)
    adds_attention = not set(_IN_GRAPH_OFFLOAD_MODULES) <= set(kind.offload_modules)
    found = []
    for scope in scopes(kind):
        for slot in (False, True):
            found += [GraphSetup(graphed=True, modules=scope, slot=slot, offload=offload) for offload in offloads]
        if adds_attention:
            found.append(dataclasses.replace(found[-1], offload=kind.offload, attention_offload=True))
    return tuple(found)


def setup_offload_modules(run_modules: tuple[str, ...], setup: GraphSetup) -> tuple[str, ...]:
    """The ``--offload-modules`` ``setup`` runs with, from the run's (``run_modules``, empty where the run
    does not offload): the run's where kept, with attention's groups added for ``attention_offload``."""
    kept = run_modules if setup.offload else ()
    if not setup.attention_offload:
        return kept
    return (*kept, *(module for module in _IN_GRAPH_OFFLOAD_MODULES if module not in kept))


def _setup_environment(run: RunSettings, setup: GraphSetup) -> tuple[str, ...]:
    """The ``NAME=value`` ``setup`` needs in the environment beyond the run's: Megatron's offload switch
    where it offloads and the run did not (a run that offloads has it already)."""
    return (OFFLOAD_ENVIRONMENT,) if setup.attention_offload and not run.activation_offloading else ()


def _run_offload_modules(run: RunSettings) -> tuple[str, ...]:
    return run.offload_modules if run.activation_offloading else ()


def setup_settings(run: RunSettings, config: PluginConfig, setup: GraphSetup) -> tuple[RunSettings, PluginConfig]:
    """The settings and plugin config the run (``run``, ``config``) would have with ``setup``'s flags in
    place of its graph flags, as ``tune.candidates.setup_flags`` writes them: without the run's offload,
    Megatron's offload settings at their defaults; the plugin's slot offload knobs only where slot-shared
    capture (or graph banks) offloads."""
    assert setup.graphed, "eager is the run's own settings"
    defaults_config = PluginConfig()
    settings = dataclasses.replace(run, cuda_graph_impl=TE_IMPL, modules=setup.modules, slot_capture=setup.slot)
    if not setup.offload:
        # The settings Megatron's offload flags set, as Megatron reads them without those flags.
        settings = dataclasses.replace(
            settings,
            activation_offloading=False,
            offload_modules=(),
            min_offloaded_tensor_size=MEGATRON_MIN_OFFLOADED_TENSOR_SIZE,
            activation_offload_fraction=1.0,
        )
    if setup.attention_offload:
        modules = setup_offload_modules(_run_offload_modules(run), setup)
        settings = dataclasses.replace(settings, activation_offloading=True, offload_modules=modules)
    knobs_taken = setup.offloads and (setup.slot or config.graph_banks)
    knobs = {} if knobs_taken else {name: getattr(defaults_config, name) for name in _SLOT_OFFLOAD_FIELDS}
    return settings, dataclasses.replace(config, slot_capture=setup.slot, **knobs)  # one replace: one validation


def _changes(run: RunSettings, setup: GraphSetup) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The flags that turn the run's into ``setup``'s, as one pastes them, and the run's flags to drop."""
    add: list[str] = []
    drop: list[str] = []
    if not run.te_graphs:
        add.append(f"--cuda-graph-impl {TE_IMPL}")
    if setup.modules != run.modules:
        if setup.modules:
            add.append(f"--cuda-graph-modules {' '.join(setup.modules)}")
        else:
            drop.append("--cuda-graph-modules")
    if setup.slot and not run.slot_capture:
        add.append("--cg-slot-capture")
    elif run.slot_capture and not setup.slot:
        drop.append("--cg-slot-capture")
    run_modules = _run_offload_modules(run)
    modules = setup_offload_modules(run_modules, setup)
    offloading = setup.attention_offload or (setup.offload and run.activation_offloading)
    if offloading and not run.activation_offloading:
        add.append("--fine-grained-activation-offloading")
    elif run.activation_offloading and not offloading:
        drop.append("--fine-grained-activation-offloading")
    if offloading and modules != run_modules:
        add.append(f"--offload-modules {' '.join(modules)}")
    elif run.offload_modules and not offloading:
        drop.append("--offload-modules")
    return tuple(add), tuple(drop)


@dataclasses.dataclass(frozen=True)
class Setup:
    """One setup of a run, built, checked and predicted: ``flags`` to add to the run's (each replacing a
    flag of the same name) and ``dropped``, the run's flags it goes without; the ``environment`` it needs
    beyond the run's; the ``settings`` and ``config`` it runs with (None where its build refused it before
    they were read); the rules that refuse it (``refused``: (rule, message)); the planner's prediction
    (``plan``; None where refused or not modelled)."""

    graph: GraphSetup
    flags: tuple[str, ...]
    dropped: tuple[str, ...] = ()
    environment: tuple[str, ...] = ()
    settings: RunSettings | None = None
    config: PluginConfig | None = None
    refused: tuple[tuple[str, str], ...] = ()
    plan: GraphMemoryPlan | None = None

    @property
    def need(self) -> CaptureNeed | None:
        return None if self.plan is None else CaptureNeed.of(self.plan)

    @property
    def command_line(self) -> str:
        """``--cuda-graph-modules attn, without --cg-slot-capture``: the flags to add, then those to drop."""
        parts = [" ".join(self.flags)] if self.flags else []
        if self.dropped:
            parts.append(f"without {' '.join(self.dropped)}")
        return ", ".join(parts)


# Builds a setup's settings and plugin config (the plugin's defaults where None) from its ``GraphSetup`` and the
# environment it needs beyond the run's (``_setup_environment``); raises ``rules.RuleViolation`` where they are
# refused before its settings are read.
Build = Callable[[GraphSetup, tuple[str, ...]], tuple[RunSettings, PluginConfig | None]]


def enumerate_setups(
    settings: RunSettings, config: PluginConfig, *, kind: ModelKind | None = None, build: Build | None = None
) -> tuple[Setup, ...]:
    """Every setup of ``graph_setups`` for the run's kind (``kind``, else ``ModelKind.of(settings)``), in
    that order: built (``build``, else ``setup_settings`` from the run's ``settings`` and ``config``),
    checked by the one rule list, and predicted by the planner where the rules pass it."""
    kind = ModelKind.of(settings) if kind is None else kind
    found = []
    for graph in graph_setups(kind):
        environment = _setup_environment(settings, graph)
        flags, dropped = _changes(settings, graph)
        try:
            built, built_config = (
                setup_settings(settings, config, graph) if build is None else build(graph, environment)
            )
        except rules.RuleViolation as refusal:
            found.append(Setup(graph, flags, dropped, environment, refused=tuple(refusal.violations)))
            continue
        built_config = built_config or PluginConfig()
        refused = tuple(rules.violations(built))
        plan = None if refused else predict_graph_memory(built, built_config)
        found.append(Setup(graph, flags, dropped, environment, built, built_config, refused, plan))
    return tuple(found)
