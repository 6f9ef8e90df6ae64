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

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20  # kSmallSize: the largest request the small pool serves
SMALL_SEGMENT = 2 << 20  # kSmallBuffer
LARGE_SEGMENT = 20 << 20  # kLargeBuffer
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here on, segments are the request rounded to 2 MiB
ROUND_LARGE = 2 << 20


def round_request(size: int) -> int:
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(request: int) -> int:
    """The segment a request that no free block fits makes the allocator reserve."""
    if request <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if request < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-request // ROUND_LARGE) * ROUND_LARGE


@dataclasses.dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool


class PoolModel:
    """One graph pool: ``malloc`` returns a handle, ``free`` takes it back; ``reserved`` is what the
    pool holds (its segments), ``allocated`` and ``peak_allocated`` the live bytes."""

    def __init__(self) -> None:
        self._segments: list[list[_Block]] = []  # blocks of each segment, by offset
        self._small_segments: set[int] = set()
        self._live: dict[int, _Block] = {}
        self._next_handle = 0
        self.reserved = 0
        self.allocated = 0
        self.peak_allocated = 0

    def malloc(self, size: int) -> int:
        request = round_request(size)
        small = request <= SMALL_REQUEST
        block = self._best_fit(request, small)
        if block is None:
            total = segment_size(request)
            index = len(self._segments)
            self._segments.append([_Block(index, 0, total, True)])
            if small:
                self._small_segments.add(index)
            self.reserved += total
            block = self._segments[index][0]
        remaining = block.size - request
        if remaining >= MIN_BLOCK if small else remaining > SMALL_REQUEST:
            blocks = self._segments[block.segment]
            position = blocks.index(block)
            blocks.insert(position + 1, _Block(block.segment, block.offset + request, remaining, True))
            block.size = request
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
        blocks = self._segments[block.segment]
        position = blocks.index(block)
        if position + 1 < len(blocks) and blocks[position + 1].free:
            block.size += blocks.pop(position + 1).size
        if position > 0 and blocks[position - 1].free:
            previous = blocks[position - 1]
            previous.size += blocks.pop(position).size

    def _best_fit(self, request: int, small: bool) -> _Block | None:
        candidates = [(block.size, block.segment, block.offset, block)
                      for index, blocks in enumerate(self._segments) if (index in self._small_segments) == small
                      for block in blocks if block.free and block.size >= request]
        if not candidates:
            return None
        sizes = sorted(candidates, key=lambda c: c[:3])
        return sizes[bisect.bisect_left([c[0] for c in sizes], request)][3]
