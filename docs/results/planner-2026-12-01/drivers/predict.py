"""Predicted graph pool for launcher flag sets: python predict.py NAME -- FLAGS [--- NAME -- FLAGS ...] (CPU)."""
import json
import os
import sys

from megatron_cg_plugin import cli
from megatron_cg_plugin.enforce import predict_graph_memory


def predict(flags, env):
    args, facts = cli.validated_args(flags, nproc=1, env=env)
    plan = predict_graph_memory(args, facts, environ=env)
    return None if plan is None else {"pool_bytes": plan.pool_bytes, "peak_live_bytes": plan.peak_live_bytes,
                                      "graphs": plan.graphs, "unpredicted": list(plan.unpredicted)}


if __name__ == "__main__":
    out = {}
    for chunk in " ".join(sys.argv[1:]).split(" --- "):
        name, flags = chunk.split(" -- ", 1)
        env = dict(os.environ, NVTE_ALLOW_NONDETERMINISTIC_ALGO="1" if name.endswith("_nondet") else "0")
        out[name] = predict(flags.split(), env)
    json.dump(out, sys.stdout, indent=1)
