"""Rank script: bank and group selection under Megatron's own hybrid DP x CP groups (gloo).

Each rank builds the groups with megatron.core.parallel_state.create_hybrid_dp_cp_groups, a router
with one bank per power-of-two CP size, then checks selection, group identity and that each bank's
group really spans the ranks it should (an all_reduce). Writes one JSON line per rank.
"""

import json
import os

import torch
import torch.distributed as dist

from megatron_cg_plugin.banks.router import BankRouter, BankSelectionError
from megatron_cg_plugin.banks.sizes import bank_sizes


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    from megatron.core.parallel_state import create_hybrid_dp_cp_groups

    ranks = list(range(world))
    hybrid = create_hybrid_dp_cp_groups(rank, ranks, None)

    def resolve(size):  # what Megatron hands a microbatch of that CP size
        if size == 1:
            return None
        return dist.group.WORLD if size == world else hybrid[size]

    router = BankRouter.build(bank_sizes(world), resolve)
    result = {"rank": rank, "sizes": list(router.banks), "group_sums": {}, "errors": {}}
    for size in router.banks:
        bank = router.select(size, resolve(size))
        value = torch.tensor([rank])
        if bank.group is not None:
            dist.all_reduce(value, group=bank.group)
        result["group_sums"][size] = value.item()
    other = dist.new_group(ranks[:2]) if world > 2 else None  # same ranks as size 2 on rank 0/1, new object
    for name, size, group in (
        ("wrong_size_group", 2, dist.group.WORLD),
        ("unknown_size", 2 * world, None),
        ("look_alike_group", 2, other),
    ):
        try:
            router.select(size, group)
            result["errors"][name] = None
        except BankSelectionError as error:
            result["errors"][name] = str(error)
    result["report"] = router.report()
    print("BANKS " + json.dumps(result), flush=True)
    dist.barrier()
    # Leave without gloo's teardown: with several groups, a rank at times dies there with
    # "terminate called without an active exception" (exit -6) after its work is done and reported.
    os._exit(0)


if __name__ == "__main__":
    main()
