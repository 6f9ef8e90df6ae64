"""The plugin's one configuration object and the ``--cg-*`` flags that fill it.

Everything the plugin does is decided by a ``PluginConfig``; no other module reads argparse or the
environment. Megatron owns the rest of the flags (``--cuda-graph-*`` and friends); the plugin only
adds its own here, through Megatron's ``extra_args_provider`` hook.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_cg_plugin.inputs import output_file_problem

__all__ = [
    "ConfigError",
    "ContractCheck",
    "FLAG_GROUPS",
    "OFFLOAD_COPIES",
    "PLUGIN_FLAGS",
    "PRESETS",
    "PluginConfig",
    "SLOT_DEBUG_ENV",
    "add_plugin_args",
    "config_from_args",
    "graph_only_flags",
    "has_plugin_flags",
    "is_power_of_two",
    "missing_plugin_flags",
    "slot_debug_from_environment",
]

PRESETS = ("tiny-gpt", "tiny-moe", "tiny-gpt-hybrid-cp")
_ON_CAPTURE_ERROR = ("raise", "eager")
_STALE_GRAPH_CHECKS = ("refuse", "before", "off")
OFFLOAD_COPIES = ("in-graph", "between-replays")
SLOT_DEBUG_ENV = "MEGATRON_CG_SLOT_DEBUG"
_DEFAULT_THD_MAX_SEQS = 8  # graph banks' packs when --cg-thd-max-seqs is not given


class ContractCheck(enum.StrEnum):
    """``--cg-contract-check``: what each graph replay checks against its capture. A str enum, so it
    prints, compares and serializes as the flag spells it (``PluginConfig`` takes either)."""

    FULL = "full"  # tensor metadata, aliasing, control values, parameter storage, process groups
    SHAPES = "shapes"  # tensor shapes and dtypes
    OFF = "off"


_CONTRACT_CHECKS = tuple(mode.value for mode in ContractCheck)  # the flag's choices


def is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PluginConfig:
    """What the plugin should do in one run.

    Attributes:
        preset: name of a launcher preset whose Megatron flags were expanded in front of the
            user's flags (recorded for the report; expansion happens before parsing).
        metrics_out: where to write this run's per-step metrics in Megatron's golden-values schema.
        report_out: where to write the run report as JSON (the text table always goes to stdout
            on rank 0 unless ``print_report`` is False).
        print_report: print the run report table on rank 0 when training ends.
        on_capture_error: after a failed (and fully rolled back) capture, ``raise`` stops the run
            naming the layer and the cause; ``eager`` continues training without graphs.
        contract_check: what each replay checks against its capture (``full``: tensor metadata,
            aliasing, control values, parameter storage, process groups; ``shapes``: tensor shape
            and dtype; ``off``).
        stale_graph_check: ``refuse`` capture while eager autograd graphs that reach graphed
            parameters are still alive (after collecting garbage), looking for them only once a
            capture failed and was rolled back with CUDA's symptoms of such graphs, and naming their
            holders in place of CUDA's error; ``before``: look before every capture (~0.2 s in a
            Megatron process); ``off``. Graph banks look before each layer's capture whatever is set.
        memory_budget_gib: the GPU memory (GiB) the memory guard lets capture take, in place of what the
            device has free when capture would start (``torch.cuda.mem_get_info``); None: what is free.
            The guard compares the planner's prediction of the capture with it and stops a capture that
            would not fit before it starts (``setups.memory_guard``).
        inject_capture_failure: test hook: fail capture inside the capture of the N-th graphed
            layer (1-based), to exercise the rollback.
        bank_min_cp: under hybrid context parallelism, the smallest CP size that gets a graph bank
            (powers of two from it up to DP x CP).
        graph_banks: under --hybrid-context-parallel, capture one graph bank per power-of-two CP
            size (from ``bank_min_cp`` to DP x CP) for every layer, all in one pool, and replay the
            bank of each packed microbatch's CP size.
        thd_max_seqs: the most packed sequences a THD microbatch may hold: graphs fix their
            ``cu_seqlens`` buffers at capture. Hybrid CP's packs (graph banks) take
            ``_DEFAULT_THD_MAX_SEQS`` when it is not given (``thd_capacity``); packed data without
            hybrid CP (``--dataloader-inter-document-masking``, ``--sft``) is laid out at this capacity,
            eager and graphed alike, only when it is given (``packed.graphs``).
        thd_max_seqlen: the longest packed sequence (document) such a microbatch may hold: the
            ``max_seqlen`` packed data without hybrid CP is laid out and captured with (None:
            ``--seq-length``). Under deterministic mode TE 2.20.2 on Hopper keeps THD attention in
            cuDNN only while ``thd_max_seqs x heads per rank x max_seqlen^2 < 2^30`` (rules).
        log_to_tensorboard: write the run report's figures (graphs, replays, pool bytes, capture time, step
            times, evaluations' eager layer calls) to Megatron's TensorBoard writer (``--tensorboard-dir``) when
            training ends, under ``cuda-graphs/``.
        moe_drop_stats: count, in the run, the token-to-expert assignments MoE routers drop at a
            fixed capacity (forward hooks on the routers; the report gives the fraction).
        slot_capture: capture every graphed layer of a plain run (PP=1) through slot-shared capture
            instead of TE's ``make_graphed_callables``: each layer's backward state in an arena
            outside the pool, and, with Megatron's fine-grained offload flags, the offloaded
            modules inside the graphed scope moved to pinned host arenas inside the graphs.
        offload_copies: where slot-shared capture copies offloaded saves: ``in-graph`` (D2H and H2D
            copies captured in each layer's graphs on side streams, joined before each graph ends)
            or ``between-replays`` (the graphs stage them in a ring of GPU buffers shared by the
            layers, and one copy per layer and direction runs between replays). Which is faster depends
            on the model: ``megatron-cg bench`` arms ``slot-offload`` and ``slot-offload-staged`` compare them.
        offload_window: how far the offload copies may run beside the compute. In-graph copies:
            how many of Megatron's offload groups' copies may run beside the group being staged
            (forward) or unpacked (backward); up to ``window + 1`` groups' staging and reload buffers
            are alive in the graph pool at once. Between replays: the staging ring holds
            ``window + 1`` buffers, each sized by the first layer that offloads at its ring
            position (a larger layer there gets one of its own). A larger window overlaps more of
            the copying with compute and holds more GPU memory.
        slot_debug: slot-shared graphs check on the host, at every replay, that no other live frame
            owns the slot (arena and output storage) about to be reused (``MEGATRON_CG_SLOT_DEBUG=1``).
    """

    preset: str | None = None
    metrics_out: Path | None = None
    report_out: Path | None = None
    print_report: bool = True
    on_capture_error: str = "raise"
    contract_check: ContractCheck = ContractCheck.FULL
    stale_graph_check: str = "refuse"
    memory_budget_gib: float | None = None
    inject_capture_failure: int | None = None
    bank_min_cp: int = 1
    graph_banks: bool = False
    thd_max_seqs: int | None = None
    thd_max_seqlen: int | None = None
    moe_drop_stats: bool = False
    log_to_tensorboard: bool = False
    slot_capture: bool = False
    offload_copies: str = "in-graph"
    offload_window: int = 1
    slot_debug: bool = False

    def __post_init__(self) -> None:
        _validate_config(self)
        # Checked above, in the one list of problems; held as the enum from here on (the flag gives a str).
        object.__setattr__(self, "contract_check", ContractCheck(self.contract_check))

    @property
    def thd_capacity(self) -> int:
        """The sequences per packed microbatch of hybrid CP's fixed-capacity packs."""
        return _DEFAULT_THD_MAX_SEQS if self.thd_max_seqs is None else self.thd_max_seqs


class ConfigError(ValueError):
    """Plugin flags with bad values; ``problems`` holds one message per flag, each naming the fix."""

    def __init__(self, problems: list[str], given: Mapping[str, Any] | None = None) -> None:
        self.problems = problems
        # The values as the flags gave them, by PluginConfig field (config_from_args fills it): what the
        # rules read of a refused config, so that its other rules still report beside the refusal.
        self.given: Mapping[str, Any] = dict(given or {})
        super().__init__(" ".join(problems))


def _config_problems(config: PluginConfig) -> list[str]:
    """What is wrong with ``config``, one message per problem (empty when it is valid)."""
    problems = []
    if config.preset is not None and config.preset not in PRESETS:
        problems.append(f"--cg-preset {config.preset!r} is unknown; use one of {', '.join(PRESETS)}.")
    for flag, value, allowed in (
        ("--cg-on-capture-error", config.on_capture_error, _ON_CAPTURE_ERROR),
        ("--cg-contract-check", config.contract_check, _CONTRACT_CHECKS),
        ("--cg-stale-graph-check", config.stale_graph_check, _STALE_GRAPH_CHECKS),
        ("--cg-offload-copies", config.offload_copies, OFFLOAD_COPIES),
    ):
        if value not in allowed:
            problems.append(f"{flag} {value!r} is unknown; use one of {', '.join(allowed)}.")
    if config.memory_budget_gib is not None and not 0 < config.memory_budget_gib < math.inf:
        problems.append(
            f"--cg-memory-budget-gib {config.memory_budget_gib} must be a number of GiB above 0 (the GPU memory "
            "capture may take), e.g. 40 or 12.5; leave it out to use what the GPU has free."
        )
    if config.inject_capture_failure is not None and config.inject_capture_failure < 1:
        problems.append("--cg-inject-capture-failure counts graphed layers from 1; give N >= 1.")
    if config.thd_max_seqs is not None and config.thd_max_seqs < 1:
        problems.append(f"--cg-thd-max-seqs {config.thd_max_seqs} must be >= 1 (sequences per packed microbatch).")
    if config.thd_max_seqlen is not None and config.thd_max_seqlen < 1:
        problems.append(
            f"--cg-thd-max-seqlen {config.thd_max_seqlen} must be >= 1 (tokens of the longest document "
            "in a packed microbatch)."
        )
    if not is_power_of_two(config.bank_min_cp):
        problems.append(f"--cg-bank-min-cp {config.bank_min_cp} must be a power of two (1, 2, 4, ...).")
    for flag, path in (("--cg-metrics-out", config.metrics_out), ("--cg-report-out", config.report_out)):
        problem = output_file_problem(flag, path)
        problems += [] if problem is None else [problem]
    if config.offload_window < 0:
        problems.append(f"--cg-offload-window {config.offload_window} must be >= 0 (offload groups copied ahead).")
    for flag, given, default in (
        ("--cg-offload-copies", config.offload_copies, PluginConfig.offload_copies),
        ("--cg-offload-window", config.offload_window, PluginConfig.offload_window),
    ):
        if given != default and not (config.slot_capture or config.graph_banks):
            problems.append(
                f"{flag} {given} only chooses how slot-shared capture copies offloaded saves: add "
                "--cg-slot-capture (or --cg-graph-banks), or drop it."
            )
    if config.slot_capture and config.graph_banks:
        problems.append(
            "--cg-slot-capture and --cg-graph-banks both ask for slot-shared capture; graph banks already "
            "capture that way: drop --cg-slot-capture."
        )
    if (
        config.metrics_out is not None
        and config.report_out is not None
        and Path(config.metrics_out).resolve() == Path(config.report_out).resolve()
    ):
        problems.append("--cg-metrics-out and --cg-report-out name the same file; give them different paths.")
    return problems


def _validate_config(config: PluginConfig) -> None:
    """The single place where a ``PluginConfig`` is checked; raises ``ConfigError`` (a ``ValueError``)
    listing every problem, each saying what to change."""
    problems = _config_problems(config)
    if problems:
        raise ConfigError(problems)


@dataclasses.dataclass(frozen=True)
class _PluginFlag:
    """One ``--cg-*`` flag: what argparse needs, its group in the help, and its one help text, which
    ``--help`` and the README's table both print (``megatron_cg_plugin.helptext``)."""

    flag: str
    group: str
    help: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # add_argument's keywords
    doc: str | None = None  # the docs page that says more
    graphs_only: bool = False  # does something only with --cuda-graph-impl transformer_engine
    field: str | None = None  # the PluginConfig field it sets (default: the flag's name without cg-)
    invert: bool = False  # a switch that turns its field off (--cg-no-report)

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def config_field(self) -> str:
        return self.field or self.dest[len("cg_") :]

    @property
    def switch(self) -> bool:
        return self.options.get("action") == "store_true"

    @property
    def synopsis(self) -> str:
        """The flag as the help and the README write it: ``--cg-preset {a,b}``, ``--cg-report-out FILE``."""
        if self.switch:
            return self.flag
        choices = self.options.get("choices")
        return f"{self.flag} {{{','.join(choices)}}}" if choices else f"{self.flag} {self.options['metavar']}"

    @property
    def full_help(self) -> str:
        """The help text with the default and the page that says more (plain text)."""
        default = self.options.get("default")
        text = self.help if default is None or self.switch else f"{self.help.rstrip('.')} (default {default})."
        return text if self.doc is None else f"{text} See {self.doc}."

    def config_value(self, args: Any) -> Any:
        value = getattr(args, self.dest)
        return (not value) if self.invert else value


FLAG_GROUPS = (
    "first run",
    "capture",
    "slot-shared capture and offload",
    "graph banks (hybrid context parallelism)",
    "outputs and report",
    "testing hooks",
)

PLUGIN_FLAGS: tuple[_PluginFlag, ...] = (
    _PluginFlag(
        "--cg-preset",
        "first run",
        "Megatron flags for a first run, placed before yours (yours win): tiny-gpt (a 2-layer GPT on mock "
        "data), tiny-moe (4 dropless alltoall experts, graphing attn moe_router moe_preprocess), "
        "tiny-gpt-hybrid-cp (hybrid context parallelism, on 2 or more ranks); presets never turn graphs on.",
        {"choices": PRESETS, "default": None},
    ),
    _PluginFlag(
        "--cg-on-capture-error",
        "capture",
        "After a failed capture (always rolled back): stop, naming the layer and the cause (raise), or train "
        "on without graphs (eager).",
        {"choices": _ON_CAPTURE_ERROR, "default": "raise"},
        graphs_only=True,
    ),
    _PluginFlag(
        "--cg-contract-check",
        "capture",
        "What each graph replay checks against its capture before it runs: tensor metadata, aliasing, control "
        "values, parameter storage and process groups (full), tensor shapes and dtypes (shapes), or nothing "
        "(off).",
        {"choices": _CONTRACT_CHECKS, "default": ContractCheck.FULL.value},
        graphs_only=True,
    ),
    _PluginFlag(
        "--cg-stale-graph-check",
        "capture",
        "Refuse capture while eager autograd graphs reaching graphed parameters are alive, naming their "
        "holders: looked for after a failed capture (refuse, no cost when capture succeeds) or before every "
        "capture (before, about 0.2 s).",
        {"choices": _STALE_GRAPH_CHECKS, "default": "refuse"},
        graphs_only=True,
    ),
    _PluginFlag(
        "--cg-memory-budget-gib",
        "capture",
        "The GPU memory capture may take, in GiB, in place of what the GPU has free when capture would start: "
        "before it, the planner's prediction of the capture (graph pool, slot arenas, static buffers) is "
        "compared with it, and a capture that would not fit stops with the setups that would (or, with "
        "--cg-on-capture-error eager, training goes on without graphs).",
        {"type": float, "default": None, "metavar": "GIB"},
        doc="docs/planner.md",
        graphs_only=True,
    ),
    _PluginFlag(
        "--cg-slot-capture",
        "slot-shared capture and offload",
        "PP = 1: capture every graphed layer through slot-shared capture inside Megatron's own "
        "create_cudagraphs (one pool, each layer's backward state in an arena); with "
        "--fine-grained-activation-offloading --offload-modules ..., the offloaded modules inside the graphed "
        "scope go to pinned host arenas inside the graphs.",
        {"action": "store_true"},
        doc="docs/slot-shared-capture.md",
        graphs_only=True,
    ),
    _PluginFlag(
        "--cg-offload-copies",
        "slot-shared capture and offload",
        "Where slot-shared offload copies: in each layer's graphs on side streams (in-graph), or between "
        "replays through a ring of staging buffers shared by the layers (between-replays).",
        {"choices": OFFLOAD_COPIES, "default": "in-graph"},
        graphs_only=True,
        doc="docs/offload.md",
    ),
    _PluginFlag(
        "--cg-offload-window",
        "slot-shared capture and offload",
        "How far those copies run beside the compute: N offload groups ahead inside the graphs, or a ring of "
        "N + 1 staging buffers between replays; more overlap, more GPU memory.",
        {"type": int, "default": 1, "metavar": "N"},
        graphs_only=True,
        doc="docs/offload.md",
    ),
    _PluginFlag(
        "--cg-graph-banks",
        "graph banks (hybrid context parallelism)",
        "With --hybrid-context-parallel: one graph bank per power-of-two CP size for every layer (whole layer, "
        "attn, mlp or attn moe scope; fused RoPE), all in one slot-shared pool; each packed microbatch replays "
        "the bank of its CP size through Megatron's replay path.",
        {"action": "store_true"},
        doc="docs/graph-banks.md",
        graphs_only=True,
    ),
    _PluginFlag(
        "--cg-bank-min-cp",
        "graph banks (hybrid context parallelism)",
        "The smallest CP size that gets a bank (powers of two from K to DP x CP).",
        {"type": int, "default": 1, "metavar": "K"},
        graphs_only=True,
    ),
    _PluginFlag(
        "--cg-thd-max-seqs",
        "graph banks (hybrid context parallelism)",
        "The most packed sequences (documents) per microbatch: graphs fix their cu_seqlens buffers at capture. "
        "Needed to graph --dataloader-inter-document-masking or --sft data (no hybrid CP), whose microbatches "
        "are then laid out at this capacity, eager and graphed alike; hybrid CP's packs take 8 when it is not "
        "given. A microbatch with more is refused.",
        {"type": int, "default": None, "metavar": "N"},
        doc="docs/packed-sequences.md",
    ),
    _PluginFlag(
        "--cg-thd-max-seqlen",
        "graph banks (hybrid context parallelism)",
        "The longest packed sequence (document) per microbatch, at most --seq-length (the default): the "
        "max_seqlen that --cg-thd-max-seqs lays packed data out and captures its graphs with. With "
        "--deterministic-mode set it to the longest document of the data: TE 2.20 keeps cuDNN attention on "
        "Hopper only while N x heads per rank x L^2 < 2^30 (with --sft a sample's end padding belongs to its last "
        "conversation). A microbatch with a longer document is refused.",
        {"type": int, "default": None, "metavar": "L"},
        doc="docs/packed-sequences.md",
    ),
    _PluginFlag(
        "--cg-metrics-out",
        "outputs and report",
        "Write the per-step lm loss, num-zeros, iteration time and memory in Megatron's golden-values JSON to FILE.",
        {"type": Path, "default": None, "metavar": "FILE"},
    ),
    _PluginFlag(
        "--cg-report-out",
        "outputs and report",
        "Write the run report (graphs captured and replayed, capture time, pool bytes, step times) as JSON to FILE.",
        {"type": Path, "default": None, "metavar": "FILE"},
        doc="docs/report.md",
    ),
    _PluginFlag(
        "--cg-no-report",
        "outputs and report",
        "Do not print the run report table when training ends.",
        {"action": "store_true"},
        field="print_report",
        invert=True,
    ),
    _PluginFlag(
        "--cg-moe-drop-stats",
        "outputs and report",
        "Count the token-to-expert assignments the MoE routers drop at a fixed capacity (forward hooks on the "
        "routers, counted on the device, inside graphs too); the report sets the fraction beside the capacity "
        "plan, and the farm turns it on for its MoE cases.",
        {"action": "store_true"},
        doc="docs/moe-capacity.md",
    ),
    _PluginFlag(
        "--cg-log-to-tensorboard",
        "outputs and report",
        "Write the run report's figures (graphs, replays, refused replays, pool bytes, capture time, step times, "
        "the evaluations' eager layer calls) to Megatron's TensorBoard writer under cuda-graphs/ when training "
        "ends; needs --tensorboard-dir.",
        {"action": "store_true"},
        doc="docs/report.md",
    ),
    _PluginFlag(
        "--cg-inject-capture-failure",
        "testing hooks",
        "Testing only: fail inside the capture of the N-th graphed layer (from 1), to exercise the rollback.",
        {"type": int, "default": None, "metavar": "N"},
        graphs_only=True,
    ),
)


def add_plugin_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: adds the ``--cg-*`` flags (``PLUGIN_FLAGS``, one argument group
    per ``FLAG_GROUPS`` entry) and returns the parser. Adding them twice is harmless (``install()`` adds
    them to every Megatron parser, and a script may too)."""
    if "--cg-preset" in parser._option_string_actions:
        return parser
    groups = {name: parser.add_argument_group(f"megatron-cg-plugin: {name}") for name in FLAG_GROUPS}
    for flag in PLUGIN_FLAGS:
        groups[flag.group].add_argument(flag.flag, help=flag.full_help, **flag.options)
    return parser


def graph_only_flags(config: PluginConfig) -> tuple[str, ...]:
    """The ``--cg-*`` flags ``config`` sets away from their defaults that shape TE graphs only (they do
    nothing in a run without ``--cuda-graph-impl transformer_engine``), as written: ``--cg-slot-capture``,
    ``--cg-contract-check off``."""
    defaults, found = PluginConfig(), []
    for flag in PLUGIN_FLAGS:
        value = getattr(config, flag.config_field)
        if flag.graphs_only and value != getattr(defaults, flag.config_field):
            found.append(flag.flag if flag.switch else f"{flag.flag} {value}")
    return tuple(found)


def slot_debug_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """``MEGATRON_CG_SLOT_DEBUG``: unset, ``0`` or empty is off, ``1`` is on; anything else is refused."""
    value = (os.environ if environ is None else environ).get(SLOT_DEBUG_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SLOT_DEBUG_ENV}={value!r} is not understood; set it to 1 (on) or 0 (off).")
    return value == "1"


def has_plugin_flags(args: Any) -> bool:
    """``args`` came from a parser ``add_plugin_args`` extended (a user's script may parse without it);
    ``--cg-preset`` marks it, as it does for ``add_plugin_args`` itself."""
    return hasattr(args, "cg_preset")


def missing_plugin_flags(args: Any) -> list[str]:
    """The ``--cg-*`` destinations a parsed namespace lacks (a parser ``add_plugin_args`` did not extend)."""
    return [flag.dest for flag in PLUGIN_FLAGS if not hasattr(args, flag.dest)]


def config_from_args(args: Any, environ: Mapping[str, str] | None = None) -> PluginConfig:
    """Builds the frozen config from a parsed Megatron namespace that went through ``add_plugin_args``
    (and the environment, for the debug switch). Bad values raise ``ConfigError`` holding the values as
    given (``ConfigError.given``); ``settings.read_settings`` is the one caller."""
    missing = missing_plugin_flags(args)
    if missing:
        raise ValueError(
            "Megatron's arguments lack the plugin's --cg-* flags "
            f"({', '.join(missing)}); parse them with extra_args_provider=megatron_cg_plugin.config.add_plugin_args."
        )
    given = {flag.config_field: flag.config_value(args) for flag in PLUGIN_FLAGS}
    try:
        slot_debug = slot_debug_from_environment(environ)
    except ValueError as error:
        raise ConfigError([str(error)], given) from None
    try:
        return PluginConfig(**given, slot_debug=slot_debug)
    except ConfigError as error:
        raise ConfigError(error.problems, given) from None
