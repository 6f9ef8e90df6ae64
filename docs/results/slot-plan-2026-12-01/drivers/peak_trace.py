"""What is alive at the peak of one training step: python peak_trace.py OUT.json STEP <launcher flags>.
Records the caching allocator's history during Megatron's STEP-th train_step call, then finds the
moment the step's own allocations peak and groups what is alive then by where it was allocated."""
import collections
import functools
import json
import sys

import torch
from megatron.training import training

from megatron_cg_plugin.launch import pretrain_gpt

OUT, STEP, ARGV = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
KEEP = ("megatron_cg_plugin", "transformer_engine", "megatron/core", "megatron/training", "torch/autograd")
original = training.train_step
calls = [0]


def where(frames):
    picked = [f"{f['filename'].split('site-packages/')[-1].split('/work/main/')[-1]}:{f['line']}:{f['name']}"
              for f in frames if any(key in f.get("filename", "") for key in KEEP)]
    return " < ".join(picked[:3]) or "(no python frame)"


def analyse(snapshot, start_allocated):
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups = collections.Counter()
    for size, site in at_peak.values():
        groups[site] += size
    return {"allocated_at_step_start_mib": start_allocated / 2**20, "step_peak_over_start_mib": peak / 2**20,
            "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "alive_at_peak_by_site_mib": [(site, size / 2**20) for site, size in groups.most_common(25)]}


@functools.wraps(original)  # the plugin checks train_step's signature
def traced(*args, **kwargs):
    calls[0] += 1
    if calls[0] != STEP:
        return original(*args, **kwargs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        return original(*args, **kwargs)
    finally:
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(OUT, "w") as f:
            json.dump(analyse(snapshot, start), f, indent=1)


training.train_step = traced
sys.exit(pretrain_gpt.main(ARGV))
