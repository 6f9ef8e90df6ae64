"""A model of PyTorch's CUDA caching allocator for one private (graph) pool on one stream (pure
Python), so the planner can turn a capture's allocations into the bytes the pool reserves.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` without expandable segments and with
the default configuration (no ``max_split_size_mb``, no power-of-two rounding):

- every request is rounded up to a multiple of 512 bytes;
- requests up to 1 MiB are served from the small pool, in 2 MiB segments; larger ones from the
  large pool, in 20 MiB segments below 10 MiB and in segments rounded up to 2 MiB above;
- a request takes the smallest free block of its pool that fits (best fit, lowest address on a tie)
  and splits it when what remains is at least 512 bytes (small pool) or more than 1 MiB (large);
- a freed block merges with free neighbours of its segment; segments of a graph pool are kept.
"""

from __future__ import annotations

import bisect
import dataclasses

__all__ = ["LARGE_SEGMENT", "PoolModel", "SMALL_REQUEST", "SMALL_SEGMENT", "round_request", "segment_size"]

_MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20  # kSmallSize: the largest request the small pool serves
SMALL_SEGMENT = 2 << 20  # kSmallBuffer
LARGE_SEGMENT = 20 << 20  # kLargeBuffer
_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here on, segments are the request rounded to 2 MiB
_ROUND_LARGE = 2 << 20


def round_request(size: int) -> int:
    return max(_MIN_BLOCK, -(-size // _MIN_BLOCK) * _MIN_BLOCK)


def segment_size(request: int) -> int:
    """The segment a request that no free block fits makes the allocator reserve."""
    if request <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if request < _MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-request // _ROUND_LARGE) * _ROUND_LARGE


@dataclasses.dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None  # the neighbours in the segment, for merging
    next: _Block | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return self.size, self.segment, self.offset  # best fit: smallest, then lowest address


class PoolModel:
    """One graph pool: ``malloc`` returns a handle, ``free`` takes it back; ``reserved`` is what the
    pool holds (its segments), ``allocated`` and ``peak_allocated`` the live bytes. Free blocks are
    kept sorted by size per pool (small, large), so a best-fit lookup is a bisection."""

    def __init__(self) -> None:
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._at: dict[tuple[int, int], _Block] = {}  # (segment, offset) -> free block
        self._live: dict[int, _Block] = {}
        self._segments = 0
        self._next_handle = 0
        self.reserved = 0
        self.allocated = 0
        self.peak_allocated = 0

    def malloc(self, size: int) -> int:
        request = round_request(size)
        small = request <= SMALL_REQUEST
        free = self._free[small]
        index = bisect.bisect_left(free, (request, -1, -1))
        if index < len(free):
            _, segment, offset = free.pop(index)
            block = self._at.pop((segment, offset))
        else:
            total = segment_size(request)
            block = _Block(self._segments, 0, total, small)
            self._segments += 1
            self.reserved += total
        remaining = block.size - request
        if remaining >= _MIN_BLOCK if small else remaining > SMALL_REQUEST:
            rest = _Block(block.segment, block.offset + request, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, request
            self._add_free(rest)
        block.free = False
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return handle

    def free(self, handle: int) -> None:
        block = self._live.pop(handle)
        self.allocated -= block.size
        block.free = True
        self._add_free(block)
        if block.next is not None and block.next.free:
            block = self._merge(block, block.next)
        if block.prev is not None and block.prev.free:
            self._merge(block.prev, block)

    def _merge(self, first: _Block, second: _Block) -> _Block:
        """Two free neighbours (both listed) become ``first``, grown over ``second``, listed."""
        self._remove_free(first)
        self._remove_free(second)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        self._add_free(first)
        return first

    def _add_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], block.key)
        self._at[block.segment, block.offset] = block

    def _remove_free(self, block: _Block) -> None:
        free = self._free[block.small]
        del free[bisect.bisect_left(free, block.key)]
        del self._at[block.segment, block.offset]
