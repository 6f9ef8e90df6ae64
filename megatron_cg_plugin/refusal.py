"""How a run whose flags break a rule stops: before any GPU work, with one line per broken rule
(printed by rank 0 and each node's first rank), exit code 2 and no traceback.

``enforce(args, ...)`` runs the shared rule list (``rules.check_run``) on Megatron's parsed
arguments; ``install()`` calls it from Megatron's ``validate_args`` in any training script, the
launcher through the same hook. Megatron's own argument assertions are shortened the same way.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import traceback
from typing import Any, Mapping, Sequence

from megatron_cg_plugin import rules
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.planner.graph_memory import plan_from_args
from megatron_cg_plugin.moe.capacity import capacity_plan_from_args
from megatron_cg_plugin.session import RunPrediction

EXIT_REFUSED = 2
# What Megatron raises for flags it refuses: bare asserts, and ValueError/TypeError/RuntimeError
# from validate_args and TransformerConfig.__post_init__.
MEGATRON_REJECTIONS = (AssertionError, ValueError, TypeError, RuntimeError)
MEGATRON_HEADING = "Megatron rejects these flags:"
# Flags megatron-core 0.19.2's validate_args asserts are given (one at a time, some without a message).
REQUIRED_FLAGS = ("--micro-batch-size", "--num-layers", "--hidden-size", "--num-attention-heads",
                  "--max-position-embeddings")
# How those asserts read: "assert args.micro_batch_size is not None", "hidden_size argument is None".
_NOT_GIVEN = re.compile(r"args\.(\w+) is not None|^(\w+) argument is None")


class RunRefused(SystemExit):
    """The run stops before any GPU work; ``violations`` are the (rule, message) pairs, ``megatron``
    standing for Megatron's own checks, listed after the plugin's rules under a heading of their own."""

    def __init__(self, violations: list[tuple[str, str]], heading: str) -> None:
        super().__init__(EXIT_REFUSED)
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
    message = str(error).strip() or "(no message)"
    if not frames:
        return message
    frame = frames[-1]
    text = f"{message} [{frame.filename.split('site-packages/')[-1]}:{frame.lineno}: {frame.line}]"
    match = _NOT_GIVEN.search(message) or _NOT_GIVEN.search(frame.line or "")
    if match is None:
        return text
    return f"--{(match.group(1) or match.group(2)).replace('_', '-')} is not given, and Megatron needs it: {text}"


def missing_required_flags(args: Any) -> list[str]:
    """The ``REQUIRED_FLAGS`` that parsed ``args`` lack (all of them at once, where Megatron names one)."""
    return [flag for flag in REQUIRED_FLAGS if getattr(args, flag[2:].replace("-", "_"), None) is None]


def refuse(violations: list[tuple[str, str]], heading: str, *, environ: Mapping[str, str]) -> RunRefused:
    """Prints the refusal on rank 0 and on each node's first rank (every rank stops) and returns
    the exception to raise."""
    refusal = RunRefused(violations, heading)
    # Once per node: files and environment differ between hosts, so another node's verdict may too.
    if environ.get("RANK", "0") == "0" or environ.get("LOCAL_RANK", "0") == "0":
        print(f"megatron-cg-plugin: {refusal.text}", file=sys.stderr, flush=True)
    return refusal


def refuse_megatron(error: BaseException, *, environ: Mapping[str, str],
                    plugin: Sequence[tuple[str, str]] = ()) -> RunRefused:
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


def enforce(args: Any, *, environ: Mapping[str, str], launcher: bool,
            config: PluginConfig | None = None) -> PluginConfig | None:
    """Runs every rule on ``args``; raises ``RunRefused`` listing the broken ones, else returns the
    plugin config the flags describe (``config`` itself when given). For the plugin's launcher,
    whose model config is Megatron's ``TransformerConfig`` of these flags, that config's checks run
    too, as ``megatron-cg check`` runs them (a user's script builds its own config)."""
    return _enforce(args, environ=environ, launcher=launcher, config=config)[1]


def _enforce(args: Any, *, environ: Mapping[str, str], launcher: bool,
             config: PluginConfig | None) -> tuple[rules.GraphFacts, PluginConfig | None]:
    try:
        facts, resolved = rules.check_run(args, env=environ, launcher=launcher, config=config)
    except rules.RuleViolation as violation:
        raise refuse(violation.violations, rules.RuleViolation.HEADING, environ=environ) from None
    if launcher:
        try:
            transformer_config_backstop(args)
        except MEGATRON_REJECTIONS as error:
            raise refuse_megatron(error, environ=environ) from None
    return facts, resolved


def enforce_for_session(args: Any, session: Any, *, environ: Mapping[str, str]) -> None:
    """``enforce`` for an installed run: the session's explicit config wins, else the flags' resolves
    it. The session also gets the planner's predictions (``session.RunPrediction``), for the report
    to set beside what the run measures."""
    facts, resolved = _enforce(args, environ=environ, launcher=session.launcher, config=session.explicit_config)
    session.resolve_config(resolved)

    def repredict(model_config: Any) -> Any:
        if not model_config_adds(args, model_config):
            return session.prediction.graph_memory  # as it stands
        return repredict_graph_memory(args, facts, session.config, model_config, environ=environ)

    session.predict(RunPrediction(graph_memory=predict_graph_memory(args, facts, session.config, environ=environ),
                                  moe_capacity=_capacity_plan(args), repredict=repredict))


def _capacity_plan(args: Any) -> Any:
    try:
        return capacity_plan_from_args(args)
    except (ValueError, AttributeError) as error:  # Megatron's own checks refuse these flags first
        logging.getLogger(__name__).warning("MoE capacity not planned: %s", error)
        return None


# TransformerConfig fields that change the prediction and that megatron-core 0.19.2 has no flag for
# (a user's script sets them on the model config after the flags are parsed), with their defaults.
MODEL_CONFIG_ONLY_FIELDS = {"fp8_dot_product_attention": False}


def model_config_adds(args: Any, model_config: Any) -> bool:
    """The built model's ``TransformerConfig`` differs from the flags in a field the prediction reads."""
    return any(hasattr(model_config, name) and getattr(model_config, name) != getattr(args, name, default)
               for name, default in MODEL_CONFIG_ONLY_FIELDS.items())


def repredict_graph_memory(args: Any, facts: rules.GraphFacts, config: PluginConfig, model_config: Any, *,
                           environ: Mapping[str, str]) -> Any:
    """``predict_graph_memory`` with the ``MODEL_CONFIG_ONLY_FIELDS`` the built model's
    ``TransformerConfig`` holds in place of the flags' (None: not predicted, as there). ``args`` is
    left as it is: the prediction reads a copy."""
    seen = {name: getattr(model_config, name) for name in MODEL_CONFIG_ONLY_FIELDS if hasattr(model_config, name)}
    return predict_graph_memory(argparse.Namespace(**{**vars(args), **seen}), facts, config, environ=environ)


def predict_graph_memory(args: Any, facts: rules.GraphFacts, config: PluginConfig, *,
                         environ: Mapping[str, str]) -> Any:
    """``plan.graph_memory``'s prediction for the run under the plugin ``config`` in force, or None
    where the planner cannot model its layers (the reason is logged; a prediction never stops a run)."""
    if not facts.te_graphs:
        return None
    deterministic = environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0" or bool(getattr(args, "deterministic_mode", False))
    try:
        return plan_from_args(args, facts, config=config, deterministic=deterministic)
    except (ValueError, AttributeError) as error:  # a user script's parser may lack flags
        logging.getLogger(__name__).warning("graph memory not predicted: %s", error)
        return None
