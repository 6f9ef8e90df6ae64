"""megatron-cg-plugin: Transformer Engine CUDA graphs for Megatron-LM that cover more of training.

Importing this package never imports Transformer Engine or touches CUDA; ``install()`` does the
version checks and the (reversible) hook-in.
"""

__version__ = "0.1.0"

from megatron_cg_plugin.config import PluginConfig, add_plugin_args  # no torch, no TE

__all__ = ["__version__", "PluginConfig", "add_plugin_args", "install", "uninstall"]


def install(config=None):
    """Hook the plugin into Megatron's training loop. See ``megatron_cg_plugin.installation``."""
    from megatron_cg_plugin import installation  # deferred: imports torch; the package must not

    return installation.install(config)


def uninstall():
    """Undo ``install()``: every patched Megatron global is restored by identity."""
    from megatron_cg_plugin import installation  # deferred: imports torch; the package must not

    installation.uninstall()
