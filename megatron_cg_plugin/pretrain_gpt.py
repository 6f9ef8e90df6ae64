"""``python -m megatron_cg_plugin.pretrain_gpt``: see ``megatron_cg_plugin.launch.pretrain_gpt``."""

import sys

from megatron_cg_plugin import console

__all__ = []

if __name__ == "__main__":
    console.hide_optional_package_warnings()  # before the launcher imports Megatron
    from megatron_cg_plugin.launch.pretrain_gpt import main

    sys.exit(main())
