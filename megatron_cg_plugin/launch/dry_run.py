"""``megatron-cg check``'s dry run: the launcher's flags parsed and validated on CPU as the launcher
would on the GPU host (Megatron's ``validate_args``, then every rule of ``rules.check_run``, then
``TransformerConfig``'s own checks), with the process as it was afterwards. ``megatron-cg plan`` and
the farm's refusals (``farm.runner.refusal_of``) run the same.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Sequence

import torch

from megatron_cg_plugin import compat, megatron_builds, rules
from megatron_cg_plugin.host_stand_ins import gpu_host_stand_ins
from megatron_cg_plugin.launch import pretrain_gpt
from megatron_cg_plugin.planner.capture_plan import plan_capture
from megatron_cg_plugin.refusal import MEGATRON_REJECTIONS, megatron_rejection, transformer_config_backstop
from megatron_cg_plugin.settings import read_settings

__all__ = ["CheckError", "check", "scoped_environ", "validated_args"]


class CheckError(ValueError):
    """The flags would not train; the message says what to change. ``violations`` are its (rule,
    message) pairs, ``megatron`` standing for Megatron's own checks."""

    def __init__(self, message: str, violations: Sequence[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.violations = list(violations) if violations is not None else [("megatron", message)]


@contextlib.contextmanager
def scoped_environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block (Megatron's validation reads it), put back after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Megatron's ``validate_args`` sets the process up for a run (``--deterministic-mode`` sets
    ``NVTE_ALLOW_NONDETERMINISTIC_ALGO`` and ``CUBLAS_WORKSPACE_CONFIG`` and turns torch's deterministic
    algorithms on); a dry run puts the environment and those switches back, so the runs a farm starts
    after its checks inherit nothing from them."""
    environ = dict(os.environ)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def _megatron_rejects(error: BaseException, plugin: Sequence[tuple[str, str]] = ()) -> CheckError:
    """Megatron's refusal, after the plugin's own rules that the flags break too (``plugin``)."""
    violations = [*plugin, ("megatron", megatron_rejection(error))]
    return CheckError("\n".join(rules.refusal_lines(violations)), violations)


def _required_flags_missing(flags: Sequence[str], args) -> CheckError | None:
    start = "a preset, e.g. megatron-cg check --cg-preset tiny-gpt --cuda-graph-impl transformer_engine"
    if not flags:
        return CheckError(
            f"no flags given: it checks the launcher's flags (Megatron's and --cg-*); start from {start}."
        )
    try:
        missing = read_settings(args)[0].missing_required_flags  # the flags as parsed, before validate_args
    except (TypeError, ValueError, AttributeError):  # unreadable before validate_args: Megatron's check names them
        missing = []
    if missing:
        return CheckError(
            f"Megatron needs {', '.join(missing)}, which the flags do not give; add "
            f"{'it' if len(missing) == 1 else 'them'}, or start from {start}, and override what differs."
        )
    return None


def check(flags: Sequence[str], *, nproc: int, env: dict[str, str], capability: tuple[int, int] = (9, 0)) -> str:
    """Validates ``flags`` as the launcher would on ``nproc`` ranks; returns the capture plan text.

    Megatron's ``validate_args`` runs first (it also normalizes deprecated flags and derives sizes
    such as the virtual pipeline), then the plugin's rules on the normalized flags (the list the
    launcher and ``install()`` run), then ``TransformerConfig``'s own checks as a backstop.
    """
    _args, settings, _config = validated_args(flags, nproc=nproc, env=env, capability=capability)
    plan = plan_capture(settings).describe()
    if settings.te_graphs and not compat.te_available():
        plan += "\nnote: Transformer Engine is not installed here; the GPU host running this needs it."
    unbuilt = megatron_builds.tokenizer_note(settings)
    if unbuilt is not None:
        plan += f"\nnote: {unbuilt}."
    return plan


def validated_args(
    flags: Sequence[str],
    *,
    nproc: int,
    env: dict[str, str],
    capability: tuple[int, int] = (9, 0),
    launcher: bool = True,
):
    """The launcher's flags parsed and checked as ``check`` describes; returns Megatron's args, the
    run's settings (``settings.RunSettings``) and the plugin's config, or raises ``RuleViolation`` /
    ``CheckError``. ``launcher`` False: the rules as ``megatron-cg run SCRIPT`` applies them (a user's
    script builds its own data)."""
    from megatron.training.arguments import validate_args

    with _process_state_kept(), scoped_environ(WORLD_SIZE=str(nproc), RANK="0", LOCAL_RANK="0"):
        args = pretrain_gpt.parse_megatron_args(flags, validate=False)
        missing = _required_flags_missing(flags, args)
        if missing is not None:
            raise missing
        sizes = rules.early_violations(args)  # before validate_args computes from them
        if sizes:
            raise rules.RuleViolation(sizes)
        early = rules.unvalidated_plugin_violations(args, env=env)  # before validate_args changes args
        with contextlib.redirect_stdout(io.StringIO()), gpu_host_stand_ins(capability=capability):
            try:
                validate_args(args, pretrain_gpt.ARGS_DEFAULTS)
            except MEGATRON_REJECTIONS as error:
                raise _megatron_rejects(error, early) from error
            # TE is needed where the run happens, not on this machine.
            settings, config = rules.check_run(args, env=env, launcher=launcher, te_present=True)
            try:
                transformer_config_backstop(args)
            except MEGATRON_REJECTIONS as error:
                raise _megatron_rejects(error) from error
    return args, settings, config
