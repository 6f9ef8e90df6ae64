"""The pure modules (plans, rules, banks' router, golden values) run without torch: they are
imported here in a fresh interpreter and torch must not come along."""

import subprocess
import sys

PURE = ("megatron_cg_plugin", "megatron_cg_plugin.config", "megatron_cg_plugin.rules", "megatron_cg_plugin.banks",
        "megatron_cg_plugin.plan.banks", "megatron_cg_plugin.plan.capture", "megatron_cg_plugin.plan.slots",
        "megatron_cg_plugin.plan.thd", "megatron_cg_plugin.plan.moe", "megatron_cg_plugin.plan.bench", "megatron_cg_plugin.plan.offload",
        "megatron_cg_plugin.plan.allocator", "megatron_cg_plugin.plan.graph_memory",
        "megatron_cg_plugin.data", "megatron_cg_plugin.parse_errors")


def test_pure_modules_import_no_torch():
    code = "import sys\n" + "".join(f"import {name}\n" for name in PURE) + \
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
