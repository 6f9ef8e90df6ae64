"""A process as ``install()`` leaves it, for tests of what runs inside one (the bench's trainer)."""

from __future__ import annotations

from typing import Any


def plugin_installed(monkeypatch: Any, helper_base: type, session: Any) -> None:
    """The plugin's helper (over ``helper_base``) in Megatron's training loop, and ``session`` the
    installed one."""
    from megatron.training import training

    from megatron_cg_plugin import installation
    from megatron_cg_plugin.capture_lifecycle import bind_helper_class

    monkeypatch.setattr(training, "TECudaGraphHelper", bind_helper_class(helper_base, session))
    monkeypatch.setattr(installation, "active_session", lambda: session)
