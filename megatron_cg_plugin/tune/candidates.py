"""The tune's side of the setups it weighs for one model (pure: no torch, no Megatron): the flags each
one runs with, and where one process can time it.

The setups themselves, and what each is, come from ``setups.graph_setups`` (the list the memory guard reads
too). ``setup_flags`` writes a setup over the user's flags, replacing their graph flags; the rules then
judge each setup's flags as ``megatron-cg check`` does (``tune.command``); nothing here decides what the
rules allow.

``placement`` says how one process can time a setup beside the others (``bench.command``): with
every graphed arm alive and single steps alternating (the bench's step schedule), one capture at a
time (its block schedule, as the bench times slot arms), or not at all, where the setup differs
from the model the process built in what is fixed at build time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from megatron_cg_plugin.config import PLUGIN_FLAGS
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.setups.graph_setups import TE_IMPL, GraphSetup, ModelKind, setup_offload_modules

__all__ = [
    "Placement",
    "build_time_notes",
    "built_setup",
    "dispatcher_dtoh_point",
    "given_modules",
    "given_setup",
    "placement",
    "same_graphs",
    "setup_flags",
    "strip_flags",
]

# Flags that choose the graphs, with the values each takes (None: a list, up to the next flag).
_GRAPH_FLAGS: dict[str, int | None] = {
    "--cuda-graph-impl": 1,
    "--cuda-graph-modules": None,
    "--cuda-graph-scope": None,  # Megatron's deprecated spelling of --cuda-graph-modules
    "--enable-cuda-graph": 0,  # deprecated: --cuda-graph-impl local
    "--external-cuda-graph": 0,  # deprecated: --cuda-graph-impl transformer_engine
    "--cg-slot-capture": 0,
}
# Megatron's fine-grained activation offload and its knobs: dropped together for a setup without offload.
_OFFLOAD_FLAGS: dict[str, int | None] = {
    "--fine-grained-activation-offloading": 0,
    "--offload-modules": None,
    "--min-offloaded-tensor-size": 1,
    "--delay-offload-until-cuda-graph": 0,
    "--activation-offload-fraction": 1,
    "--fine-grained-offloading-max-inflight-offloads": 1,
    "--delta-offload-bytes-across-pp-ranks": 1,
}
# The offload flags a setup that offloads attention's saves writes anew.
_OFFLOAD_SWITCHES = ("--fine-grained-activation-offloading", "--offload-modules")
# The plugin's slot-shared offload knobs: only slot-shared capture (or graph banks) takes them.
_SLOT_OFFLOAD_FLAGS: dict[str, int | None] = {"--cg-offload-copies": 1, "--cg-offload-window": 1}
# The plugin's flags that shape TE graphs only, which a run without graphs refuses (rule graph-only-flags).
_GRAPH_ONLY_PLUGIN_FLAGS: dict[str, int | None] = {
    flag.flag: 0 if flag.switch else 1 for flag in PLUGIN_FLAGS if flag.graphs_only
}


_EAGER_SETUP = GraphSetup(graphed=False)
_ATTN_MLP = ("attn", "mlp")
# Megatron 0.19.2's --cuda-graph-modules choices, in its order: the setups write their scopes in it.
_MODULE_ORDER = {
    name: index for index, name in enumerate(("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"))
}


def strip_flags(argv: Sequence[str], flags: Mapping[str, int | None]) -> list[str]:
    """``argv`` without ``flags`` and their values (``FLAG V``, ``FLAG=V``; a list flag's values run to
    the next ``--`` token)."""
    kept: list[str] = []
    dropping = 0  # values still to drop; -1: a list's, up to the next flag
    for token in argv:
        if dropping and not (dropping == -1 and token.startswith("--")):
            dropping = dropping - 1 if dropping > 0 else -1
            continue
        dropping = 0
        name, has_value = token.split("=", 1)[0], "=" in token
        if name in flags:
            count = flags[name]
            dropping = 0 if has_value else (-1 if count is None else count)
            continue
        kept.append(token)
    return kept


def _graph_banks(argv: Sequence[str]) -> bool:
    return any(token.split("=", 1)[0] == "--cg-graph-banks" for token in argv)


def _last_values(argv: Sequence[str], flag: str) -> list[str] | None:
    """The values of the last ``flag`` in ``argv`` (a list flag's, up to the next ``--`` token), None if absent."""
    found = None
    for index, token in enumerate(argv):
        name, _, value = token.partition("=")
        if name != flag:
            continue
        if value:
            found = [value]
            continue
        found = []
        for following in argv[index + 1 :]:
            if following.startswith("--"):
                break
            found.append(following)
    return found


def given_setup(base: Sequence[str], kind: ModelKind) -> GraphSetup:
    """The setup the user's own flags (preset expanded) describe (TE's graphs or none), Megatron's deprecated
    spellings read as Megatron reads them."""
    impl = _last_values(base, "--cuda-graph-impl")
    if impl is None and "--external-cuda-graph" in base:
        impl = [TE_IMPL]
    if not impl or impl[0] != TE_IMPL:
        return _EAGER_SETUP
    return GraphSetup(
        graphed=True,
        modules=given_modules(base) or (),
        slot="--cg-slot-capture" in base,
        offload=kind.offload,
    )


def setup_flags(base: Sequence[str], setup: GraphSetup) -> list[str]:
    """The user's flags (``base``, preset expanded) as ``setup`` runs them: their graph flags replaced by
    the setup's; without offload, Megatron's offload flags gone; with attention's saves offloaded, their
    ``--offload-modules`` with attention's groups added (``graph_setups.setup_offload_modules``); the
    plugin's slot offload knobs kept only where slot-shared capture (or graph banks) offloads; eager, the
    plugin's graph-only flags gone."""
    flags = strip_flags(base, _GRAPH_FLAGS)
    if setup.graphed and not setup.offload:
        flags = strip_flags(flags, _OFFLOAD_FLAGS)
    if setup.attention_offload:
        modules = setup_offload_modules(tuple(_last_values(flags, "--offload-modules") or ()), setup)
        flags = strip_flags(flags, {flag: _OFFLOAD_FLAGS[flag] for flag in _OFFLOAD_SWITCHES})
        flags += ["--fine-grained-activation-offloading", "--offload-modules", *modules]
    if not setup.graphed:
        flags = strip_flags(flags, _GRAPH_ONLY_PLUGIN_FLAGS)
    elif not setup.offloads or not (setup.slot or _graph_banks(base)):
        flags = strip_flags(flags, _SLOT_OFFLOAD_FLAGS)
    return [*flags, *setup.graph_flags]


@dataclasses.dataclass(frozen=True)
class Placement:
    """How the tune's one process times a setup: ``steps`` (captured once, alive beside the others, single
    steps alternating), ``blocks`` (captured, stepped and released in turn, as the bench times slot arms),
    or ``None``: not in this process (``why``)."""

    schedule: str | None
    why: str = ""


def placement(setup: GraphSetup, settings: RunSettings, kind: ModelKind, environment: Sequence[str] = ()) -> Placement:
    """Where ``setup`` (whose validated ``settings`` these are, and which needs ``environment`` beyond the
    user's) is timed in a process built with the user's offload flags (``kind.offload``). The step schedule
    switches the layers' graph lists between steps, so what a capture keeps elsewhere cannot take it (the
    bench refuses the same, ``_refuse_unswitchable``)."""
    if not setup.graphed:
        return Placement("steps")
    # Megatron sets its offload up when it builds the layers; slot capture keeps its hooks out, TE's cannot.
    if setup.attention_offload or (not setup.slot and setup.offload != kind.offload):
        with_env = f" and {' '.join(environment)}" if environment else ""
        return Placement(
            None,
            f"{'with attention offloaded' if setup.attention_offload else 'without the offload flags'} the model is "
            f"built otherwise (Megatron sets its offload hooks up in the layers): run megatron-cg tune with these "
            f"flags{with_env} to time it",
        )
    reasons = [
        why
        for why, present in (
            ("slot-shared arenas and saved-tensor hooks live outside the layers' graph lists", settings.slot_capture),
            ("graph banks live outside the layers' graph lists", settings.graph_banks),
            ("Megatron's offload manager keeps one capture's state", settings.activation_offloading),
            ("TE keeps FP8/FP4 scaling state per capture", settings.fp8 or settings.fp4),
        )
        if present
    ]
    if reasons:
        return Placement("blocks", "; ".join(reasons))
    return Placement("steps")


def same_graphs(setup: GraphSetup, kind: ModelKind) -> GraphSetup | None:
    """The ``attn mlp`` setup that captures what ``setup``, the whole layer of a model without MoE layers,
    captures: Megatron 0.19.2 graphs a dense layer's attention and MLP in one graph for either scope
    (``TransformerLayer._te_cuda_graph_capture``), so one of the two is timed. None for other setups."""
    if not setup.graphed or setup.modules or kind.moe:
        return None
    return dataclasses.replace(setup, modules=_ATTN_MLP)


def built_setup(timed: Sequence[GraphSetup], kind: ModelKind, modules: tuple[str, ...] | None) -> GraphSetup | None:
    """The setup whose flags the timing process builds its model with: every arm then captures the same
    layers with its own scope. Built with the user's offload flags, under TE's graphs where any such setup
    is timed (every TE arm's helper is the plugin's own), preferring the user's ``--cuda-graph-modules``
    (``modules``; None: not given) where the user gave them."""
    graphed = [setup for setup in timed if setup.graphed and setup.offload == kind.offload]
    preferred = sorted(graphed, key=lambda setup: (setup.slot, setup.modules != modules))
    return next(iter(preferred), None)


def given_modules(base: Sequence[str]) -> tuple[str, ...] | None:
    """The user's own ``--cuda-graph-modules`` (or ``--cuda-graph-scope``, its deprecated spelling; preset
    expanded) in the order of Megatron's choices, as the setups name their scopes; None where not given."""
    found = _last_values(base, "--cuda-graph-modules")
    if found is None:
        found = _last_values(base, "--cuda-graph-scope")
    if found is None:
        return None
    return tuple(sorted(dict.fromkeys(found), key=lambda name: _MODULE_ORDER.get(name, len(_MODULE_ORDER))))


def dispatcher_dtoh_point(setup: GraphSetup) -> str:
    """Where Megatron 0.19.2's alltoall token dispatcher copies its routing counts to the host, which it
    fixes from the scope when it builds the layers (token_dispatcher.py ``MoEAlltoAllTokenDispatcher.__init__``):
    before the expert-parallel alltoall where the graphs hold the MoE preprocess (or the whole layer), else
    before the first permutation. The timing process sets it per arm as that arm's own build would."""
    if setup.graphed and (not setup.modules or "moe_preprocess" in setup.modules):
        return "before_ep_alltoall"
    return "before_permutation_1"


def build_time_notes(setup: GraphSetup, built: GraphSetup, kind: ModelKind) -> tuple[str, ...]:
    """What Megatron 0.19.2 fixes from the scope when it builds the layers and the timing process cannot set
    per arm, where ``setup``'s scope would fix it otherwise than the built model's: ``setup`` is then timed
    with the built model's choice."""
    if not setup.graphed or setup.modules == built.modules:
        return ()
    if kind.recompute_norms and ("moe_router" in setup.modules) != ("moe_router" in built.modules):
        return (f"the pre-MLP layernorm recompute of {built.label} (transformer_layer.py decides it at build)",)
    return ()
