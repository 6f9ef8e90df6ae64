"""CPU stand-in for a replay check inside a training step (issue 31): three Megatron-shaped layers'
contracts (12 process groups, 7 parameters each) checked as Megatron replays them (4 microbatches a
marked step, ``is_first_microbatch`` on the first), each check after a forward of a small transformer
that pushes the check's code and objects out of cache. Arms interleaved: ``noop`` (the timer alone)
and ``check`` (the importable package's replay check, full mode). Compare two commits by running this
with PYTHONPATH set to each. Diagnosis only; figures are host microseconds a check."""
import functools
import sys
import time
import types

import torch
import torch.distributed as dist

from megatron_cg_plugin.capture.contracts import ReplayContract
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.step_marks import StepMarks

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
    hidden, layer = torch.zeros(4, 2, 8, requires_grad=True), Layer()
    keep.extend((hidden, layer))  # as TE holds the static buffers and the model its layers (since 6638deb a
    # contract holds its layer weakly)
    contract = ReplayContract.record("g", (hidden,), replay_kwargs(None) | {"rotary_pos_emb": torch.zeros(4, 1, 1, 8)},
                                     module=layer, step_marks=marks)
    if hasattr(contract, "replay_check"):  # 1896ced on
        return contract.replay_check(ContractCheck.FULL)
    return functools.partial(contract.check, mode=ContractCheck.FULL)


def run(arms: dict, cycles: int, rotate: bool = False) -> None:
    """Each cycle a marked step of 4 microbatches per arm, the arms' order mirrored from cycle to
    cycle (and ``rotate``d by one, for three arms); prints each arm's check times (the first 20
    cycles are warmup)."""
    times = {arm: [] for arm in arms}
    names = list(arms)
    with torch.no_grad():
        for cycle in range(cycles):
            shift = cycle % len(names) if rotate else 0
            order = names[shift:] + names[:shift]
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


if __name__ == "__main__":
    run({arm: [checker(arm) for _ in range(3)] for arm in ("noop", "check")},
        int(sys.argv[1]) if len(sys.argv) > 1 else 300)
