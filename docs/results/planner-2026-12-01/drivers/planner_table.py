"""Predicted vs measured graph pool for the farm cases (measured: the farm reports under MEASURED)
and the bench models (measured: bench.json); prints a markdown table and writes JSON (CPU)."""
import json
import os
import sys
from pathlib import Path

from megatron_cg_plugin import cli
from megatron_cg_plugin.enforce import predict_graph_memory
from megatron_cg_plugin.testing import farm

BENCH, OUT, MEASURED = Path(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
ENV = dict(os.environ, NVTE_ALLOW_NONDETERMINISTIC_ALGO="0")  # the farm's and the bench's environment
G = ["--cuda-graph-impl", "transformer_engine"]
BENCH_MODELS = {
    "gpt4": ["--cg-preset", "tiny-gpt", "--num-layers", "4", *G],
    "llama": ("--cg-preset tiny-gpt --num-layers 3 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 "
              "--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm "
              "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 512 "
              "--max-position-embeddings 512").split() + G,
    "moe": ("--cg-preset tiny-moe --cuda-graph-modules attn moe --moe-expert-capacity-factor 1.5 "
            "--moe-pad-expert-input-to-capacity").split() + G,
    "dense1b": ("--cg-preset tiny-gpt --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 "
                "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 "
                "--vocab-size 32768").split() + G,
}


def predicted(flags):
    args, facts = cli.validated_args(flags, nproc=1, env=ENV)
    return predict_graph_memory(args, facts, environ=ENV)


def launcher_flags(case):
    argv = case.argv(graphed=True, out_dir=Path("/tmp/unused"))
    # The launcher's flags, or those after `megatron-cg run SCRIPT`.
    start = argv.index("megatron_cg_plugin.pretrain_gpt") + 1 if "megatron_cg_plugin.pretrain_gpt" in argv \
        else argv.index("run") + 2
    flags = argv[start:]
    cut = [i for i, f in enumerate(flags) if f in ("--cg-metrics-out", "--cg-report-out")]
    return [f for i, f in enumerate(flags) if not any(i in (c, c + 1) for c in cut)]


rows = []
for report in sorted(r for m in MEASURED for r in m.glob("*/*.graphed.report.json")):
    name = report.name.split(".")[0]
    ours = next(Path("tests/functional/test_cases").glob(f"*/{name}"), None)
    folder = ours or next(Path(".megatron-lm/test_cases").glob(f"*/{name}"))
    case, _ = farm.prepare_case(folder, out_dir=Path("/tmp/unused"), gpus=None if ours else 1)
    measured = sum(s["pool_bytes"] for s in json.loads(report.read_text())["scopes"])
    if not measured:
        continue  # the capture-failure case captures nothing
    plan = predicted(launcher_flags(case))
    rows.append(("farm" if ours else "Megatron-LM case, --fit-gpus 1", name, plan.pool_bytes, measured,
                 plan.unpredicted))
for model, flags in BENCH_MODELS.items():
    bench = json.loads((BENCH / model / "bench.json").read_text())
    measured = next(b["pool_bytes"] for b in bench["blocks"] if b["arm"] == "plugin")
    plan = predicted(flags)
    rows.append(("bench", model, plan.pool_bytes, measured, plan.unpredicted))
OUT.write_text(json.dumps([dict(kind=k, name=n, predicted_bytes=p, measured_bytes=m, unpredicted=list(u))
                           for k, n, p, m, u in rows], indent=1) + "\n")
print("| set | case | predicted MiB | measured MiB | predicted / measured | notes |\n| --- | --- | --- | --- | --- | --- |")
for kind, name, pred, meas, unpredicted in rows:
    print(f"| {kind} | `{name}` | {pred / 2**20:.0f} | {meas / 2**20:.0f} | {pred / meas:.2f} |"
          + (f" leaves out: {'; '.join(unpredicted)}" if unpredicted else ""))
