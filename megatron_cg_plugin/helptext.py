"""What ``--help`` and ``--version`` print, and the README's flag table, all from one source: the
``--cg-*`` flag definitions in ``config.PLUGIN_FLAGS`` (pure Python: no torch, no Megatron).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Mapping

from megatron_cg_plugin import __version__, compat
from megatron_cg_plugin.config import FLAG_GROUPS, PLUGIN_FLAGS, SLOT_DEBUG_ENV, add_plugin_args

__all__ = ["flags_markdown_table", "plugin_flags_help", "usage", "versions_text"]

_ENVIRONMENT = (
    f"{SLOT_DEBUG_ENV}=1: slot-shared graphs check, at every replay, that no live frame owns the slot "
    "about to be reused."
)
_DOCS = "README.md, docs/troubleshooting.md (every error and rule), docs/flags.md, docs/architecture.md"
# Where Megatron's own flags are described, since megatron-core 0.19.2's --help cannot print them.
_MEGATRON_FLAGS_DOC = (
    "megatron/training/arguments.py in megatron-core (python -c 'import megatron.training.arguments "
    "as a; print(a.__file__)'), or Megatron-LM's docs"
)
_STACK = (
    ("torch", ("torch",)),
    ("megatron-core", ("megatron-core", "megatron_core")),
    ("transformer-engine", ("transformer-engine", "transformer_engine")),
)


def plugin_flags_help(width: int = 100) -> str:
    """Every ``--cg-*`` flag with its help, grouped, as argparse formats them (plain text)."""
    formatter = lambda prog: argparse.HelpFormatter(prog, max_help_position=38, width=width)  # noqa: E731
    parser = argparse.ArgumentParser(
        prog="megatron-cg", add_help=False, usage=argparse.SUPPRESS, formatter_class=formatter
    )
    add_plugin_args(parser)
    environment = textwrap.fill(_ENVIRONMENT, width, initial_indent="  ", subsequent_indent="    ")
    return f"{parser.format_help().strip()}\n\nenvironment:\n{environment}"


def flags_markdown_table() -> str:
    """The README's table of plugin flags: one row per flag, in the help's groups and order."""
    rows = ["| flag | group | what it does |", "| --- | --- | --- |"]
    for group in FLAG_GROUPS:
        for flag in (f for f in PLUGIN_FLAGS if f.group == group):
            text = flag.full_help
            if flag.doc is not None:
                text = text.replace(f"See {flag.doc}.", f"See [{flag.doc}]({flag.doc}).")
            rows.append(f"| `{flag.synopsis}` | {group} | {text} |")
    return "\n".join(rows)


def _command_lines(commands: Mapping[str, Callable]) -> str:
    """One entry per subcommand: its docstring (synopsis, then what it does), else its name."""
    entries = []
    for name, function in commands.items():
        doc = (function.__doc__ or "").strip().splitlines()
        entries.append(f"  megatron-cg {name} {doc[0].strip() if doc else ''}".rstrip())
        entries += [f"      {line.strip()}" for line in doc[1:] if line.strip()]
    return "\n".join(entries)


def usage(commands: Mapping[str, Callable]) -> str:
    """``megatron-cg --help``: the subcommands, then every plugin flag they (and the launcher) take."""
    return "\n".join(
        [
            "usage: megatron-cg COMMAND [ARGS...]   (megatron-cg --version: the plugin's and the stack's versions)",
            "",
            (
                "Megatron-LM's Transformer Engine CUDA graphs over more of training: "
                "keep Megatron's flags, add --cg-* ones."
            ),
            (
                "The launcher: python -m megatron_cg_plugin.pretrain_gpt "
                "[--cg-preset NAME] <Megatron flags> <--cg-* flags>"
            ),
            "",
            "commands:",
            _command_lines(commands),
            "",
            "plugin flags (check, plan, bench, run, the launcher and install() take them beside Megatron's):",
            "",
            plugin_flags_help(),
            "",
            f"docs: {_DOCS}",
        ]
    )


def versions_text() -> str:
    """``megatron-cg --version``: from package metadata only (importing TE is slow and needs CUDA)."""
    lines = [f"megatron-cg-plugin {__version__}"]
    lines += [f"{label} {compat.distribution_version(*names) or 'not installed'}" for label, names in _STACK]
    return "\n".join(lines)
