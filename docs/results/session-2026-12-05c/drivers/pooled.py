"""The Llama-like plugin / stock cycles of several bench runs, each run's per-cycle ratios as the bench
made them (``summarize_steps``: one process each, arms interleaved), pooled into one median and its
order-statistic interval. Diagnosis beside each run's own figure, not in place of it: the runs are
separate processes (each ratio is in-process) and not all at one commit.
Usage: ``PYTHONPATH=. python pooled.py BENCH_JSON_GZ...``."""
import gzip
import json
import sys

from megatron_cg_plugin.plan.bench_schedule import Step, median_interval, summarize_steps

pooled = []
for path in sys.argv[1:]:
    run = json.load(gzip.open(path))
    steps = [(Step(record["cycle"], record["arm"]), record["seconds"]) for record in run["steps"]]
    ratios = summarize_steps(steps, skip_cycles=run["skip_steps"]).ratios[("plugin", "stock")].values
    print(path, median_interval(ratios))
    pooled.extend(ratios)
print("pooled", median_interval(pooled))
