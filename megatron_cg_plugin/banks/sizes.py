"""Which CP sizes get a graph bank under hybrid context parallelism (pure Python)."""

from __future__ import annotations

from megatron_cg_plugin.config import is_power_of_two

__all__ = ["bank_sizes"]


def bank_sizes(dp_cp_size: int, min_cp: int = 1) -> tuple[int, ...]:
    """The CP sizes to capture a bank for: powers of two from ``min_cp`` up to DP x CP."""
    if not is_power_of_two(dp_cp_size):
        raise ValueError(
            f"hybrid context parallelism needs DP x CP to be a power of two, got {dp_cp_size}: "
            "change the number of ranks or --context-parallel-size."
        )
    if not is_power_of_two(min_cp) or min_cp > dp_cp_size:
        raise ValueError(f"--cg-bank-min-cp {min_cp} must be a power of two no larger than DP x CP ({dp_cp_size}).")
    sizes, size = [], min_cp
    while size <= dp_cp_size:
        sizes.append(size)
        size *= 2
    return tuple(sizes)
