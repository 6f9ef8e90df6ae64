"""How a run whose flags break a rule stops: before any GPU work, with one line per broken rule
(printed by rank 0 and each node's first rank), exit code 2 and no traceback.

``enforce(args, ...)`` runs the shared rule list (``rules.check_run``) on Megatron's parsed
arguments; ``install()`` calls it from Megatron's ``validate_args`` in any training script, the
launcher through the same hook. Megatron's own argument assertions are shortened the same way.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_cg_plugin import rules
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.megatron_builds import failure_text
from megatron_cg_plugin.settings import RunSettings

__all__ = [
    "MEGATRON_HEADING",
    "MEGATRON_REJECTIONS",
    "RunRefused",
    "enforce_for_session",
    "megatron_rejection",
    "missing_required_flags",
    "refuse",
    "refuse_megatron",
    "transformer_config_backstop",
]

_EXIT_REFUSED = 2
# What Megatron raises for flags it refuses: bare asserts, ValueError/TypeError/RuntimeError from validate_args
# and TransformerConfig.__post_init__, and arithmetic on a size that makes no sense (a division by zero).
MEGATRON_REJECTIONS = (AssertionError, ValueError, TypeError, RuntimeError, ArithmeticError)
MEGATRON_HEADING = "Megatron rejects these flags:"
# Flags megatron-core 0.19.2's validate_args asserts are given (one at a time, some without a message).
_REQUIRED_FLAGS = (
    "--micro-batch-size",
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--max-position-embeddings",
)
# How those asserts read: "assert args.micro_batch_size is not None", "hidden_size argument is None".
_NOT_GIVEN = re.compile(r"args\.(\w+) is not None|^(\w+) argument is None")


class RunRefused(SystemExit):
    """The run stops before any GPU work; ``violations`` are the (rule, message) pairs, ``megatron``
    standing for Megatron's own checks, listed after the plugin's rules under a heading of their own."""

    def __init__(self, violations: list[tuple[str, str]], heading: str) -> None:
        super().__init__(_EXIT_REFUSED)
        self.violations = violations
        self.heading = heading

    @property
    def text(self) -> str:
        plugin = [f"  [{name}] {message}" for name, message in self.violations if name != "megatron"]
        megatron = [f"  [{name}] {message}" for name, message in self.violations if name == "megatron"]
        if plugin and megatron:
            return "\n".join([self.heading, *plugin, MEGATRON_HEADING, *megatron])
        return "\n".join([self.heading, *plugin, *megatron])


def megatron_rejection(error: BaseException) -> str:
    """Megatron's assert messages are sometimes empty: name the failing check's line too."""
    frames = traceback.extract_tb(error.__traceback__)
    text = failure_text(error)
    if not frames:
        return text
    match = _NOT_GIVEN.search(str(error).strip()) or _NOT_GIVEN.search(frames[-1].line or "")
    if match is None:
        return text
    return f"--{(match.group(1) or match.group(2)).replace('_', '-')} is not given, and Megatron needs it: {text}"


def missing_required_flags(args: Any) -> list[str]:
    """The ``_REQUIRED_FLAGS`` that parsed ``args`` lack (all of them at once, where Megatron names one)."""
    return [flag for flag in _REQUIRED_FLAGS if getattr(args, flag[2:].replace("-", "_"), None) is None]


def refuse(violations: list[tuple[str, str]], heading: str, *, environ: Mapping[str, str]) -> RunRefused:
    """Prints the refusal on rank 0 and on each node's first rank (every rank stops) and returns
    the exception to raise."""
    refusal = RunRefused(violations, heading)
    # Once per node: files and environment differ between hosts, so another node's verdict may too.
    if environ.get("RANK", "0") == "0" or environ.get("LOCAL_RANK", "0") == "0":
        print(f"megatron-cg-plugin: {refusal.text}", file=sys.stderr, flush=True)
    return refusal


def refuse_megatron(
    error: BaseException, *, environ: Mapping[str, str], plugin: Sequence[tuple[str, str]] = ()
) -> RunRefused:
    """Megatron's refusal, after the plugin's rules the flags break too (``plugin``, from
    ``rules.unvalidated_plugin_violations``: Megatron stops at its first assertion, often the world
    size, before the rules run, and a rule names the flag to change)."""
    megatron = ("megatron", megatron_rejection(error))
    if plugin:
        return refuse([*plugin, megatron], rules.RuleViolation.HEADING, environ=environ)
    return refuse([megatron], MEGATRON_HEADING, environ=environ)


def transformer_config_backstop(args: Any) -> None:
    """``TransformerConfig``'s own checks, as the launcher's model build will run them
    (``gpt_config_from_args``): raises what Megatron raises."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    core_transformer_config_from_args(args)


def enforce(
    args: Any, *, environ: Mapping[str, str], launcher: bool, config: PluginConfig | None = None
) -> PluginConfig | None:
    """Runs every rule on ``args``; raises ``RunRefused`` listing the broken ones, else returns the
    plugin config the flags describe (``config`` itself when given). For the plugin's launcher,
    whose model config is Megatron's ``TransformerConfig`` of these flags, that config's checks run
    too, as ``megatron-cg check`` runs them (a user's script builds its own config)."""
    return _enforce(args, environ=environ, launcher=launcher, config=config)[1]


def _enforce(
    args: Any, *, environ: Mapping[str, str], launcher: bool, config: PluginConfig | None
) -> tuple[RunSettings, PluginConfig | None]:
    try:
        settings, resolved = rules.check_run(args, env=environ, launcher=launcher, config=config)
    except rules.RuleViolation as violation:
        raise refuse(violation.violations, rules.RuleViolation.HEADING, environ=environ) from None
    if launcher:
        try:
            transformer_config_backstop(args)
        except MEGATRON_REJECTIONS as error:
            raise refuse_megatron(error, environ=environ) from None
    return settings, resolved


def enforce_for_session(args: Any, session: Any, *, environ: Mapping[str, str]) -> None:
    """``enforce`` for an installed run: the session's explicit config wins, else the flags' resolves
    it, and the session takes the run's settings (``RunSession.take_settings``, which has the planners
    predict the run for the report)."""
    settings, resolved = _enforce(args, environ=environ, launcher=session.launcher, config=session.explicit_config)
    session.resolve_config(resolved)
    session.take_settings(settings)
