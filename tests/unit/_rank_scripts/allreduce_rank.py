"""Rank script: gloo all_reduce of rank+1 over the env:// rendezvous set by torch.distributed.run."""

import os

import torch
import torch.distributed as dist


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert int(os.environ["LOCAL_RANK"]) == rank  # single node
    assert os.environ["MASTER_ADDR"] and os.environ["MASTER_PORT"]
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    try:
        value = torch.tensor([rank + 1], dtype=torch.int64)
        dist.all_reduce(value)
        assert value.item() == world * (world + 1) // 2, value.item()
        print(
            f"rank={rank} world={world} sum={value.item()} "
            f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')} "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
            f"MCG_TEST_VAR={os.environ.get('MCG_TEST_VAR')}",
            flush=True,
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
