"""The CPU stand-in of ``session-2026-12-04b/drivers/insitu.py`` with two codes in one process: arms
``noop``, ``before`` (the package under ``sys.argv[1]``, e.g. a ``git archive`` of a commit) and
``after`` (the importable one), interleaved cycle by cycle, each cycle a marked step of 4 microbatches
over three Megatron-shaped layers, each check after a forward that pushes it out of cache. Processes
on this host differ more than the codes do (a noop of 0.5 to 2.9 us); one process compares them.
Usage: ``PYTHONPATH=. python insitu_ab.py ROOT_BEFORE [CYCLES]``. Host microseconds a check."""
import importlib
import sys
import time
import types

import torch
import torch.distributed as dist


def load(root: str | None):
    """``contracts``, ``ContractCheck`` and ``StepMarks`` of the package under ``root`` (None: the
    importable one), its modules then dropped from ``sys.modules`` so another copy can load."""
    if root:
        sys.path.insert(0, root)
    try:
        contracts = importlib.import_module("megatron_cg_plugin.capture.contracts")
        found = contracts, importlib.import_module("megatron_cg_plugin.config").ContractCheck
    finally:
        if root:
            sys.path.remove(root)
            for name in [name for name in sys.modules if name.startswith("megatron_cg_plugin")]:
                del sys.modules[name]
    return found


CODES = {"before": load(sys.argv[1]), "after": load(None)}
from megatron_cg_plugin.step_marks import StepMarks  # noqa: E402  (after the copy under test is unloaded)

torch.manual_seed(0)
torch.set_num_threads(1)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
        self.d = torch.nn.Linear(8, 8, bias=False)
        self.pg_collection = types.SimpleNamespace(**{f"g{i}": dist.ProcessGroup(dist.HashStore(), 0, 1)
                                                      for i in range(12)})


model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True) for _ in range(2)])
x = torch.randn(2, 64, 256)
marks, keep, rope = StepMarks(), [], torch.zeros(4, 1, 1, 8)


def replay_kwargs(first):
    return {"attention_mask": None, "rotary_pos_emb": rope, "packed_seq_params": None, "is_first_microbatch": first}


def checker(arm):
    if arm == "noop":
        return lambda args, kwargs: None
    contracts, contract_check = CODES[arm]
    hidden = torch.zeros(4, 2, 8, requires_grad=True)
    keep.append(hidden)
    contract = contracts.ReplayContract.record(
        "g", (hidden,), replay_kwargs(None) | {"rotary_pos_emb": torch.zeros(4, 1, 1, 8)}, module=Layer(),
        step_marks=marks)
    return contract.replay_check(contract_check.FULL)


arms = {arm: [checker(arm) for _ in range(3)] for arm in ("noop", "before", "after")}
times = {arm: [] for arm in arms}
with torch.no_grad():
    for cycle in range(int(sys.argv[2]) if len(sys.argv) > 2 else 300):
        order = list(arms)[cycle % 3:] + list(arms)[:cycle % 3]
        for arm in (order if cycle % 2 else order[::-1]):
            with marks:
                for microbatch in range(4):
                    for check in arms[arm]:
                        model(x)
                        args, kwargs = (torch.zeros(4, 2, 8, requires_grad=True),), replay_kwargs(microbatch == 0)
                        start = time.perf_counter_ns()
                        check(args, kwargs)
                        if cycle >= 20:
                            times[arm].append(time.perf_counter_ns() - start)
for arm, values in times.items():
    values.sort()
    print(f"{arm:6s} median {values[len(values) // 2] / 1e3:6.1f} us  p10 {values[len(values) // 10] / 1e3:6.1f}  "
          f"p90 {values[9 * len(values) // 10] / 1e3:6.1f}  mean {sum(values) / len(values) / 1e3:6.1f}")
