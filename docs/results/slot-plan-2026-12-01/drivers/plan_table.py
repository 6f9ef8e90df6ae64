"""Predicted (megatron-cg plan's model, on CPU) against measured graph memory, for farm run reports
and bench.json files: python plan_table.py OUT.json FILE... where each FILE is a
<case>.graphed.report.json of a farm case or a bench.json. Prints a markdown table, writes JSON."""
import json
import os
import sys
import tempfile
from pathlib import Path

from megatron_cg_plugin import cli
from megatron_cg_plugin.enforce import predict_graph_memory
from megatron_cg_plugin.testing import farm

OUT, FILES = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
# The farm's and the bench's environment; Megatron's own flag check reads NVTE_CPU_OFFLOAD_V1 from os.environ.
os.environ["NVTE_CPU_OFFLOAD_V1"] = "1"
BASE_ENV = dict(os.environ, NVTE_ALLOW_NONDETERMINISTIC_ALGO="0")
FIELDS = ("pool_bytes", "arena_bytes", "host_arena_bytes", "boundary_bytes")
OFFLOAD_FLAGS = ("--fine-grained-activation-offloading", "--offload-modules")


def predict(flags, env):
    args, facts = cli.validated_args(flags, nproc=1, env=env)
    plan = predict_graph_memory(args, facts, environ=env)
    return {field: getattr(plan, field, None) for field in FIELDS}, list(plan.unpredicted)


def without_offload(flags):
    """The flags with Megatron's offload flags (and --offload-modules' values) taken out."""
    kept, skipping = [], False
    for flag in flags:
        if flag.startswith("--"):
            skipping = flag in OFFLOAD_FLAGS
        if not skipping:
            kept.append(flag)
    return kept


def farm_rows(report, scratch):
    name = report.name.split(".")[0]
    folder = next(Path("tests/functional/test_cases").glob(f"*/{name}"))
    case, _ = farm.prepare_case(folder, out_dir=scratch)
    scopes = [s for s in json.loads(report.read_text())["scopes"] if not s.get("failure")]
    if not scopes:
        return []  # a capture-failure case captures nothing
    measured = {field: sum(s.get(field) or 0 for s in scopes) if any(field in s for s in scopes) else None
                for field in FIELDS}
    predicted, left_out = predict(case.run_flags(graphed=True, out_dir=scratch), dict(BASE_ENV, **dict(case.env)))
    return [("farm", name, predicted, measured, left_out)]


def bench_rows(path):
    bench = json.loads(path.read_text())
    flags = list(bench["flags"])
    env = BASE_ENV
    rows = []
    for arm in ("plugin", "slot", "slot-offload"):
        block = next((b for b in bench["blocks"] if b["arm"] == arm), None)
        if block is None:
            continue
        arm_flags = flags if arm == "plugin" else (without_offload(flags) if arm == "slot" else flags) + ["--cg-slot-capture"]
        predicted, left_out = predict(arm_flags, env)
        measured = {field: block.get(field) for field in FIELDS}
        rows.append(("bench", f"{path.parent.name} ({arm})", predicted, measured, left_out))
    return rows


rows = []
with tempfile.TemporaryDirectory() as scratch:
    for file in FILES:
        rows += bench_rows(file) if file.name == "bench.json" else farm_rows(file, Path(scratch))
OUT.write_text(json.dumps([dict(kind=k, name=n, predicted=p, measured=m, unpredicted=u) for k, n, p, m, u in rows],
                          indent=1) + "\n")


def cell(predicted, measured, field):
    p, m = predicted.get(field), measured.get(field)
    if not m or p is None:
        return "-"
    return f"{p / 2**20:.1f} / {m / 2**20:.1f} ({p / m:.2f})"


print("| set | case | pool MiB predicted / measured | GPU arenas | pinned host arenas | boundary buffers | "
      "not modelled |\n| --- | --- | --- | --- | --- | --- | --- |")
for kind, name, predicted, measured, left_out in rows:
    print(f"| {kind} | `{name}` | " + " | ".join(cell(predicted, measured, f) for f in FIELDS)
          + f" | {'; '.join(left_out)} |")
