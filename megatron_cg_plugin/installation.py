"""Install and uninstall the plugin: the module that sets Megatron's globals for a run (every change
listed in ``patching.ledger``; a ``with`` block elsewhere changes only what ``ledger.SCOPED`` lists,
through ``foreign_state``).

``install()`` checks versions and the private functions the plugin relies on
(``ledger.PRIVATE_API``), applies every patch in ``ledger.PATCHES`` (all or nothing), saves the
attributes the run may lend (``ledger.LENT``) and creates the run's ``RunSession``; ``uninstall()``
restores each patched and lent attribute to the very object it replaced. Both are idempotent. A CPU
dry run stands in for the GPU host through ``host_stand_ins``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from megatron_cg_plugin import compat, foreign_state, rules
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.patching.ledger import PATCHES, PatchSet, check_private_api, hold_lent
from megatron_cg_plugin.refusal import refuse
from megatron_cg_plugin.session import RunSession

__all__ = ["active_session", "finish", "install", "uninstall"]


@dataclasses.dataclass
class _Installed:
    """The install's handle: the run's session, the applied patches, and the lent attributes as
    they were before the run (restored by ``uninstall()``)."""

    session: RunSession
    patches: PatchSet
    lent: foreign_state.Changes


_installed: _Installed | None = None


def _parsed_megatron_args() -> Any:
    """Megatron's parsed args, or None before its parser ran."""
    from megatron.training.global_vars import get_args

    try:
        return get_args()
    except AssertionError:  # Megatron asserts when its args were never parsed
        return None


def install(config: PluginConfig | None = None, *, launcher: bool = False) -> RunSession:
    """Hooks the plugin into Megatron and returns the run's session.

    Called before the script parses its arguments, it makes Megatron's parser accept the ``--cg-*``
    flags whatever ``extra_args_provider`` the script passes, and runs the plugin's rules when
    Megatron validates the arguments (a broken run stops there, one line per rule). Without
    ``config`` the run's config is what the ``--cg-*`` flags say. When training ends, rank 0 prints
    the run report and writes the files the flags ask for. Called after the arguments were parsed,
    it runs the rules on them at once. ``launcher`` is for the plugin's own launcher, whose data
    path has rules of its own. Calling it again returns the same session: a ``config`` given then
    is taken while the first call's config is still deferred (not yet used), else a different one
    is refused.
    """
    global _installed
    if _installed is not None:
        session = _installed.session
        if config is not None and not session.config_resolved:
            session.adopt_config(config)  # e.g. a script's own install(config) under megatron-cg run
        if config is not None and config != session.config:
            raise RuntimeError(
                "megatron_cg_plugin is already installed with a different config; call "
                "megatron_cg_plugin.uninstall() first."
            )
        return _installed.session
    # Megatron's parser reads WORLD_SIZE and RANK with int() before any rule runs: the environment's rules first.
    broken_environment = rules.environment_violations(os.environ)
    if broken_environment:
        raise refuse(broken_environment, environ=os.environ)
    versions = compat.installed_versions()
    compat.check_versions(versions, require_te=False)
    with_te = versions.transformer_engine is not None
    check_private_api(with_te=with_te)
    # Megatron's validate_args hands the session its flags; a run whose validation does not (--yaml-cfg) has the
    # session take them itself at the first read of its config or settings (RunSession.ensure_checked).
    session = RunSession(config, launcher=launcher, parsed_args=_parsed_megatron_args)
    patch_set = PatchSet(PATCHES)
    patch_set.apply_all(session, with_te=with_te)
    lent = foreign_state.Changes()
    try:
        hold_lent(lent, with_te=with_te)
        _enforce_on_parsed_args(session)
    except BaseException:
        lent.restore()
        patch_set.revert_all()
        raise
    _installed = _Installed(session, patch_set, lent)
    return session


def _enforce_on_parsed_args(session: RunSession) -> None:
    """A script that parsed its arguments before ``install()``: its flags get the rules now, the host's too (no
    validation follows that would ask them)."""
    args = _parsed_megatron_args()
    if args is not None:
        session.check_flags(args, environ=os.environ, host_rules=True)


def uninstall() -> None:
    """Restores every patched Megatron attribute by identity; harmless when not installed."""
    global _installed
    if _installed is None:
        return
    _installed.lent.restore()
    _installed.patches.revert_all()
    _installed = None


def active_session() -> RunSession | None:
    return None if _installed is None else _installed.session


def finish(print_fn: Any = print) -> Any:
    """Ends the run's session (done by itself when Megatron's ``train()`` returns): report and
    metrics files on rank 0. Returns the report, or None when not installed."""
    if _installed is None:
        return None
    return _installed.session.finish(print_fn=print_fn)
