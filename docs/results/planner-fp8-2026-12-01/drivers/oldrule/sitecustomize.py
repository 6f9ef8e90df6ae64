"""Diagnostic only (s58): with $CG_OLD_OFFLOAD_RULE=1, in-graph offload plans each layer's frame alone
(the rule before OffloadStack: every layer offloads its groups, the last one too)."""
import os

if os.environ.get("CG_OLD_OFFLOAD_RULE") == "1":
    from megatron_cg_plugin.plan import offload

    offload.OffloadStack.plan = lambda self, saves, index: offload.plan_offload(saves, self.policy)
