"""Rank script: sleeps far past the launch timeout."""

import os
import sys
import time

if __name__ == "__main__":
    print(f"rank {os.environ['RANK']} sleeping", flush=True)
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 300)
