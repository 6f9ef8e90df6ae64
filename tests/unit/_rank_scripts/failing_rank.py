"""Rank script: rank 1 raises; the other ranks wait long enough to be torn down by the agent."""

import os
import time


def fail_on_rank_one() -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("boom from rank 1")
    time.sleep(30)  # killed by the agent once rank 1 has failed


if __name__ == "__main__":
    print(f"rank {os.environ['RANK']} starting", flush=True)
    fail_on_rank_one()
