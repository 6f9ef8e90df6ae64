"""How a run whose flags break a rule stops: before any GPU work, with one line per broken rule, the
first broken rule on the first line (``rules.refusal_lines``, printed by rank 0 and each node's first
rank), exit code 2 and no traceback.

This module only enforces: it reads no settings. The session checks Megatron's parsed arguments
against the shared rule list (``rules.check_run``, in ``RunSession.check_flags``) and has ``refuse``
turn the rules it broke into the refusal; ``install()`` has that run from Megatron's ``validate_args``
in any training script, the launcher through the same hook. Megatron's own argument assertions are
shortened the same way (``refuse_megatron``, ``enforce_model_config``). The flags come before the host:
on a host without a GPU the validation runs as on the GPU host (``host_stand_ins``), and what the host
lacks is asked once the flags passed (``refuse_host``).
"""

from __future__ import annotations

import re
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_cg_plugin import host_stand_ins, rules
from megatron_cg_plugin.megatron_builds import failure_text
from megatron_cg_plugin.settings import RunSettings

__all__ = [
    "MEGATRON_REJECTIONS",
    "SILENT_RANK_GRACE_S",
    "RunRefused",
    "enforce_model_config",
    "megatron_rejection",
    "refuse",
    "refuse_host",
    "refuse_megatron",
    "transformer_config_backstop",
]

_EXIT_REFUSED = 2
# What Megatron raises for flags it refuses: bare asserts, ValueError/TypeError/RuntimeError from validate_args
# and TransformerConfig.__post_init__, and arithmetic on a size that makes no sense (a division by zero).
MEGATRON_REJECTIONS = (AssertionError, ValueError, TypeError, RuntimeError, ArithmeticError)
# How megatron-core 0.19.2's validate_args asserts a flag it needs is given (RunSettings.missing_required_flags
# lists them): "assert args.micro_batch_size is not None", "hidden_size argument is None".
_NOT_GIVEN = re.compile(r"args\.(\w+) is not None|^(\w+) argument is None")
# megatron-core 0.19.2's batch check (arguments.py), on the eval sizes, which default to --global-batch-size and
# --micro-batch-size: the first batch check a run meets.
_EVAL_BATCH = re.compile(
    r"^eval_global_batch_size \((\d+)\) must be divisible by eval_micro_batch_size \((\d+)\) \* "
    r"data_parallel_size \((\d+)\)"
)
# How long a rank that does not print a refusal waits before it stops (``_announced``).
SILENT_RANK_GRACE_S = 10.0


class RunRefused(SystemExit):
    """The run stops before any GPU work; ``violations`` are the (rule, message) pairs, ``megatron``
    standing for Megatron's own checks, printed cause first (``rules.refusal_lines``). ``host`` instead
    says what this host lacks for flags that pass every check."""

    def __init__(self, violations: list[tuple[str, str]], host: str | None = None) -> None:
        super().__init__(_EXIT_REFUSED)
        self.violations = violations
        self.host = host

    @property
    def text(self) -> str:
        return self.host if self.host is not None else "\n".join(rules.refusal_lines(self.violations))


def megatron_rejection(error: BaseException) -> str:
    """Megatron's assert messages are sometimes empty: name the failing check's line too."""
    frames = traceback.extract_tb(error.__traceback__)
    text = failure_text(error)
    if not frames:
        return text
    batch = _EVAL_BATCH.search(str(error))
    if batch is not None:  # the eval batch defaults to the training one: name the flags a user gave
        global_batch, micro_batch, data_parallel = batch.groups()
        return (
            f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro_batch} x the "
            f"data-parallel size {data_parallel} (ranks / (TP x PP x CP)): change either (or "
            f"--eval-global-batch-size / --eval-micro-batch-size, where given): {text}"
        )
    match = _NOT_GIVEN.search(str(error).strip()) or _NOT_GIVEN.search(frames[-1].line or "")
    if match is None:
        return text
    return f"--{(match.group(1) or match.group(2)).replace('_', '-')} is not given, and Megatron needs it: {text}"


def refuse(violations: list[tuple[str, str]], *, environ: Mapping[str, str]) -> RunRefused:
    """Prints the refusal on rank 0 and on each node's first rank (every rank stops) and returns
    the exception to raise."""
    return _announced(RunRefused(violations), environ)


def refuse_host(settings: RunSettings | None, *, environ: Mapping[str, str]) -> RunRefused | None:
    """What this host lacks for flags that passed every other check (which ran as on the GPU host,
    ``host_validation``), as the refusal to raise: the host's rules (``rules.HOST_RULES``: TE, APEX, the
    GPU's recipes) on the run's ``settings``, then a GPU. None where the host has all it needs."""
    broken = [] if settings is None else rules.violations(settings, rules.HOST_RULES)
    if broken:
        return refuse(broken, environ=environ)
    if not host_stand_ins.gpu_missing():
        return None
    return _announced(
        RunRefused(
            [],
            host="this host has no CUDA GPU, which training needs (the flags pass Megatron's checks and the "
            "plugin's rules; megatron-cg check validates flags on a machine without one).",
        ),
        environ,
    )


def _announced(refusal: RunRefused, environ: Mapping[str, str]) -> RunRefused:
    # Once per node: files and environment differ between hosts, so another node's verdict may too. A rank
    # that is no number (rule environment-values refuses it) cannot tell whether it is the first: it prints.
    ranks = [environ.get(name, "0").strip() for name in ("RANK", "LOCAL_RANK")]
    if any(rank == "0" or not rank.isdigit() for rank in ranks):
        print(f"megatron-cg-plugin: {refusal.text}", file=sys.stderr, flush=True)
    elif environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        # A launcher (torchrun) stops every rank when the first one exits: a silent rank waits, so that the
        # rank saying why is not stopped before it has.
        time.sleep(SILENT_RANK_GRACE_S)
    return refusal


def refuse_megatron(
    error: BaseException, *, environ: Mapping[str, str], plugin: Sequence[tuple[str, str]] = ()
) -> RunRefused:
    """Megatron's refusal, after the plugin's rules the flags break too (``plugin``, from
    ``rules.unvalidated_plugin_violations``: Megatron stops at its first assertion, often the world
    size, before the rules run, and a rule names the flag to change)."""
    return refuse([*plugin, ("megatron", megatron_rejection(error))], environ=environ)


def transformer_config_backstop(args: Any) -> None:
    """``TransformerConfig``'s own checks, as the launcher's model build will run them
    (``gpt_config_from_args``): raises what Megatron raises."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    core_transformer_config_from_args(args)


def enforce_model_config(args: Any, *, environ: Mapping[str, str]) -> None:
    """For the plugin's launcher, whose model config is Megatron's ``TransformerConfig`` of these flags, that
    config's checks, as ``megatron-cg check`` runs them (a user's script builds its own config): raises
    ``RunRefused`` with Megatron's refusal where they fail."""
    try:
        transformer_config_backstop(args)
    except MEGATRON_REJECTIONS as error:
        raise refuse_megatron(error, environ=environ) from None
