"""The global-memory staging buffer of PyTorch's CUDA reduce kernel for a bias gradient (pure Python).

A bias gradient that PyTorch computes as a column sum of a ``[rows, cols]`` bf16 gradient (autograd's
``sum_to`` for a bias broadcast over the tokens, as in Megatron's fused bias-GELU backward; TE's
unfused ``dbias`` under FP8 current scaling) runs ATen's reduce kernel, which for enough rows splits
each output column over several thread blocks and stages their fp32 partial sums in a buffer from
the caching allocator: inside a capture, in the graph pool. ``setReduceConfig`` and
``ReduceConfig::global_memory_size`` in ``aten/src/ATen/native/cuda/Reduce.cuh`` size it; this module
does their arithmetic for a reduction over the slower dimension of a contiguous tensor. Checked
against the H200 allocator traces: 128 MiB at 2048 x 8192, 64 MiB at 2048 x 4096,
132 MiB at 4096 x 8192 and at 4096 x 6144, none at 512 rows. The buffer stops growing with the rows
once the blocks fill the GPU, so it is not proportional to the tokens: at 4096 tokens it is 132 MiB,
not twice the 128 MiB of 2048.
"""

from __future__ import annotations

__all__ = ["column_sum_workspace"]

_H200_MULTIPROCESSORS = 132  # the verified GPU; the buffer's size depends on the SM count
_MAX_THREADS_PER_MULTIPROCESSOR = 2048  # sm_90
_MAX_REDUCE_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS for every real type
_WARP = 32
_ACCUMULATOR_BYTES = 4  # a bf16 sum accumulates in fp32
MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD = 16, 256


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (n.bit_length() - 1))


def column_sum_workspace(rows: int, cols: int, *, multiprocessors: int = _H200_MULTIPROCESSORS) -> int:
    """Bytes of the staging buffer a sum over the ``rows`` of a contiguous ``[rows, cols]`` tensor
    allocates (0 where one block per column suffices)."""
    vec = 4  # outputs vectorized along the contiguous columns, as far as the column count allows
    while cols % vec:
        vec //= 2
    threads_cap = _MAX_REDUCE_THREADS // vec
    dim0, dim1 = cols // vec, rows
    dim0_pow2 = _last_pow2(dim0) if dim0 < threads_cap else threads_cap
    dim1_pow2 = _last_pow2(dim1) if dim1 < threads_cap else threads_cap
    width = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, threads_cap // width)
    width = min(dim0_pow2, threads_cap // height)
    if rows < min(height * MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD):
        return 0  # each warp takes columns of its own: no split of the rows across warps, nor blocks
    values_per_thread = _div_up(rows, height)
    grid = _div_up(dim0, width)
    target_grid = multiprocessors * (_MAX_THREADS_PER_MULTIPROCESSOR // (width * height))
    if values_per_thread < MAX_VALUES_PER_THREAD or grid > target_grid:
        return 0
    ctas = max(
        min(_div_up(target_grid, grid), _div_up(values_per_thread, MIN_VALUES_PER_THREAD)),
        _div_up(values_per_thread, MAX_VALUES_PER_THREAD),
    )
    return _ACCUMULATOR_BYTES * cols * ctas * width * vec if ctas > 1 else 0
