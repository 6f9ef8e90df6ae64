"""The only module that touches Megatron's globals: install and uninstall the plugin.

``install()`` checks versions and the private functions the plugin relies on
(``patches.PRIVATE_API``), applies every patch in ``patches.PATCHES`` (all or nothing) and creates
the run's ``RunSession``; ``uninstall()`` restores each patched and lent attribute
(``patches.LENT``) to the very object it replaced. Both are idempotent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_cg_plugin import compat
from megatron_cg_plugin.config import PluginConfig, config_from_args, has_plugin_flags
from megatron_cg_plugin.patches import PatchSet, check_private_api, revert_lent, start_lending
from megatron_cg_plugin.session import RunSession


@dataclasses.dataclass
class _Installed:
    session: RunSession
    patches: PatchSet


_installed: _Installed | None = None


def _config_from_megatron_args() -> PluginConfig:
    """The ``--cg-*`` flags Megatron parsed, or defaults when the script did not add them."""
    from megatron.training.global_vars import get_args

    try:
        args = get_args()
    except AssertionError:  # Megatron asserts when its args were never parsed
        return PluginConfig()
    if args is None or not has_plugin_flags(args):
        return PluginConfig()
    return config_from_args(args)


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
    versions = compat.installed_versions()
    compat.check_versions(versions, require_te=False)
    with_te = versions.transformer_engine is not None
    check_private_api(with_te=with_te)
    session = RunSession(config if config is not None else _config_from_megatron_args, launcher=launcher)
    patches = PatchSet()
    patches.apply_all(session, with_te=with_te)
    start_lending()
    try:
        _enforce_on_parsed_args(session)
    except BaseException:
        revert_lent()
        patches.revert_all()
        raise
    _installed = _Installed(session, patches)
    return session


def _enforce_on_parsed_args(session: RunSession) -> None:
    """A script that parsed its arguments before ``install()``: its flags get the rules now."""
    import os

    from megatron.training.global_vars import get_args

    from megatron_cg_plugin.enforce import enforce_for_session

    try:
        args = get_args()
    except AssertionError:  # Megatron asserts when its args were never parsed
        return
    if args is not None:
        enforce_for_session(args, session, environ=os.environ)


def uninstall() -> None:
    """Restores every patched Megatron attribute by identity; harmless when not installed."""
    global _installed
    if _installed is None:
        return
    revert_lent()
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
