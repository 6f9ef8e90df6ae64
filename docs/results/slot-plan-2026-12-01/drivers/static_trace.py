"""What is alive when Megatron's STEP-th train_step begins, by where it was allocated (history recorded
from the start): python static_trace.py OUT.json STEP <launcher flags>."""
import collections
import functools
import json
import sys

import torch

torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
from megatron.training import training  # noqa: E402

from megatron_cg_plugin.launch import pretrain_gpt  # noqa: E402

OUT, STEP, ARGV = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
KEEP = ("megatron_cg_plugin", "transformer_engine", "megatron/core", "megatron/training", "torch/autograd", "torch/optim")
original = training.train_step
calls = [0]


def where(frames):
    picked = [f"{f['filename'].split('site-packages/')[-1].split('/work/main/')[-1]}:{f['line']}:{f['name']}"
              for f in frames if any(key in f.get("filename", "") for key in KEEP)]
    return " < ".join(picked[:4]) or "(no python frame)"


@functools.wraps(original)  # the plugin checks train_step's signature
def traced(*args, **kwargs):
    calls[0] += 1
    if calls[0] == STEP:
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        groups = collections.Counter()
        for segment in snapshot["segments"]:
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    groups[where(block.get("frames", []))] += block["size"]
        with open(OUT, "w") as f:
            json.dump({"allocated_mib": torch.cuda.memory_allocated() / 2**20,
                       "by_site_mib": [(s, b / 2**20) for s, b in groups.most_common(40)]}, f, indent=1)
        torch.cuda.memory._record_memory_history(enabled=None)
    return original(*args, **kwargs)


training.train_step = traced
sys.exit(pretrain_gpt.main(ARGV))
