"""Megatron's command-line parser, and the plugin's own, made to fail in one line.

Megatron's parser prints its whole usage (about 700 lines) before the line that matters, and a
bad ``--cuda-graph-modules`` value escapes argparse as a ``KeyError`` traceback (its type function
indexes an enum). ``shorten`` fixes both on one parser object: an unknown flag gets one line naming
it and the closest valid flags, a bad value one line listing the valid ones. Nothing global changes:
the parser lives for one ``parse_args`` call. ``reported_as`` names the plugin's command in those lines,
and the plugin's own parsers (``OneLineErrors``) put the error first as well, not their usage.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import difflib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, cast

from megatron_cg_plugin.config import add_plugin_args

__all__ = [
    "GRAPH_MODULE_FLAGS",
    "OneLineErrors",
    "plugin_args_provider",
    "printable_help",
    "reported_as",
    "short_message",
    "shorten",
    "suggestions",
    "unknown_own_flag",
]

GRAPH_MODULE_FLAGS = frozenset({"--cuda-graph-modules", "--cuda-graph-scope"})


def suggestions(flag: str, options: list[str]) -> list[str]:
    """The valid flags closest to ``flag`` (its name only, without ``=value``)."""
    return difflib.get_close_matches(flag.split("=", 1)[0], options, n=3, cutoff=0.6)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def short_message(parser: argparse.ArgumentParser, message: str, *, prog: str | None = None) -> str:
    """One line for an argparse error: unknown flags with their closest valid spellings; ``prog`` (default
    the parser's) names the command whose flags they are."""
    prog = prog or parser.prog
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return f"{prog}: error: {message}"
    options = [option for option in parser._option_string_actions if option.startswith("--")]
    unknown = [token for token in message[len(prefix) :].split() if token.startswith("-") and not _is_number(token)]
    parts = []
    for flag in unknown or message[len(prefix) :].split():
        close = suggestions(flag, options)
        parts.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
    return f"{prog}: error: unknown flag{'s' if len(parts) > 1 else ''} {', '.join(parts)}"


# The command a user typed, where Megatron's parser (whose prog is the script's name, ``pretrain_gpt`` for the
# plugin's dry run) reads flags for it: ``megatron-cg check``, ``megatron-cg run``.
_REPORTED_AS: contextvars.ContextVar[str | None] = contextvars.ContextVar("reported_as", default=None)


@contextlib.contextmanager
def reported_as(command: str) -> Iterator[None]:
    """Inside the block, Megatron's parser errors (``shorten``) name ``command``, not the script's name."""
    token = _REPORTED_AS.set(command)
    try:
        yield
    finally:
        _REPORTED_AS.reset(token)


def _error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    print(short_message(parser, message, prog=_REPORTED_AS.get()), file=sys.stderr)
    parser.exit(2)


class OneLineErrors(argparse.ArgumentParser):
    """The plugin's own command parsers: an error is one line naming the argument (``short_message``), then
    where the command's help is, instead of argparse's usage block before the error. Its subparsers are of
    this class too (argparse makes them of the parser's own class)."""

    def error(self, message: str) -> NoReturn:
        print(f"{short_message(self, message)}\n  ({self.prog} --help lists its arguments)", file=sys.stderr)
        self.exit(2)


def _graph_module_type(parse: Callable[[str], Any], valid: list[str]) -> Callable[[str], Any]:
    """Megatron's ``--cuda-graph-modules`` type with a bad value reported as argparse errors are."""

    @functools.wraps(parse)
    def parse_module(value: str) -> Any:
        try:
            return parse(value)
        except KeyError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a CUDA graph module; use any of {' '.join(valid)} (none: the whole layer)"
            ) from None

    return parse_module


def _graph_module_names() -> list[str]:
    from megatron.core.transformer.enums import CudaGraphModule

    return [member.name for member in CudaGraphModule]


def plugin_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: the ``--cg-*`` flags and one-line errors (both idempotent)."""
    return shorten(add_plugin_args(parser))


def printable_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Escapes each help string argparse cannot expand (megatron-core 0.19.2's help of
    ``--moe-paged-stash-buffer-size-factor-cuda`` holds a bare '%', so Megatron's own ``--help`` raises
    a ValueError); returns the parser, whose ``format_help()`` then works."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            try:
                formatter._expand_help(action)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")
    return parser


def shorten(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Makes this parser's errors one line (see the module docstring); returns it. Idempotent."""
    if getattr(parser, "_megatron_cg_short_errors", False):
        return parser
    parser.error = functools.partial(_error, parser)  # type: ignore[method-assign]
    parser._megatron_cg_short_errors = True  # type: ignore[attr-defined]
    for action in parser._actions:
        if GRAPH_MODULE_FLAGS & set(action.option_strings) and action.type is not None:
            # Megatron's --cuda-graph-modules type is a parsing function (argparse also allows a FileType or a name)
            action.type = _graph_module_type(cast(Callable[[str], Any], action.type), _graph_module_names())
    return parser


def unknown_own_flag(parser: argparse.ArgumentParser, rest: Sequence[str], prefix: str, what: str) -> str | None:
    """A flag of ``rest`` (what ``parser.parse_known_args`` left) that starts with the command's own ``prefix``
    (``--bench-``, ``--tune-``), which Megatron has none of: a typo of one of ``parser``'s, not a flag to pass on.
    Its message names the closest of them, or None where there is none."""
    typos = [flag.split("=", 1)[0] for flag in rest if flag.startswith(prefix)]
    if not typos:
        return None
    known = [action.option_strings[0] for action in parser._actions]
    close = difflib.get_close_matches(typos[0], known, n=1)
    return (
        f"unknown {what} flag {typos[0]}"
        + (f" (did you mean {close[0]}?)" if close else "")
        + f"; the {what}'s flags: {', '.join(known)}."
    )
