"""``python -m megatron_cg_plugin.pretrain_gpt``: see ``megatron_cg_plugin.launch.pretrain_gpt``."""

import sys

from megatron_cg_plugin.launch.pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
