"""Trace only (s56, s66): with $MEMTRACE_DIR set, records the caching allocator's events during the
plugin's capture (graph pools only) into $MEMTRACE_DIR/<pid>.json.gz, as drivers/memtrace.py of
planner-2026-12-01 does for the launcher, here for any process (farm cases, user scripts).
s66: the capture's pools are the ones absent before it, found by pool id; s56's copy kept segments
by address, and a new pool segment at an address a freed default-pool segment had before was left
out (s65's MoE traces held 782 of the 1468 MiB pool)."""
import os

DIR = os.environ.get("MEMTRACE_DIR")
if DIR:
    import gzip
    import json

    import torch
    from megatron_cg_plugin import helper

    KEEP = ("transformer_engine", "megatron/core", "torch/autograd", "torch/nn/functional", "torch/cuda/graphs")
    original = helper.PluginHelperMixin.create_cudagraphs
    dumped = []

    def frames_of(entry):
        out = []
        for frame in entry.get("frames", []):
            name = frame.get("filename", "")
            if any(key in name for key in KEEP):
                out.append(f"{name.split('site-packages/')[-1]}:{frame.get('line')}:{frame.get('name')}")
            if len(out) == 6:
                break
        return out

    def traced(self, *args, **kwargs):
        before = {tuple(seg.get("segment_pool_id", (0, 0))) for seg in torch.cuda.memory_snapshot()}
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        try:
            return original(self, *args, **kwargs)
        finally:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            segments = [s for s in snap["segments"] if tuple(s.get("segment_pool_id", (0, 0))) not in before]
            spans = [(s["address"], s["address"] + s["total_size"]) for s in segments]
            inside = lambda addr: any(lo <= addr < hi for lo, hi in spans)
            events = [{"a": e["action"], "s": e["size"], "addr": e["addr"], "stream": e.get("stream", 0),
                       "f": frames_of(e)}
                      for trace in snap["device_traces"] for e in trace if inside(e["addr"])]
            dumped.append({"segments": [{"address": s["address"], "total_size": s["total_size"],
                                         "pool": list(s["segment_pool_id"]), "stream": s.get("stream", 0),
                                         "allocated": s["allocated_size"]} for s in segments],
                           "events": events})
            os.makedirs(DIR, exist_ok=True)
            # Named after the run's report file where it has one (matrix cells run side by side).
            import sys
            report = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--cg-report-out"), None)
            name = os.path.basename(report).replace(".report.json", "") if report else str(os.getpid())
            with gzip.open(os.path.join(DIR, f"{name}.json.gz"), "wt") as f:
                json.dump(dumped, f)

    helper.PluginHelperMixin.create_cudagraphs = traced
