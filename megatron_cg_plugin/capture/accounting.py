"""Allocator and replay diagnostics: private-pool bytes from the caching allocator's snapshot, and
the replay counters the graphs' wrappers count into.

The pure functions take snapshot segments as plain dicts (the format of
``torch.cuda.memory_snapshot()``), so they are tested on CPU with hand-made snapshots.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

__all__ = [
    "MemoryState",
    "ReplayCounter",
    "ReplayTotals",
    "TeardownStats",
    "allocator_segments",
    "blocks_of_new_pools",
    "device_free_bytes",
    "host_available_bytes",
    "live_blocks",
    "meminfo_available_bytes",
    "memory_state",
    "new_pool_bytes",
    "pool_bytes_by_id",
    "ranks_on_this_host",
    "steady_median",
    "teardown_stats",
]

_DEFAULT_POOL = (0, 0)  # the caching allocator's id for ordinary (non-graph) segments


def pool_bytes_by_id(segments: Iterable[Mapping[str, Any]]) -> dict[tuple[int, int], int]:
    """Reserved bytes per private memory pool id; ordinary allocator segments are left out."""
    totals: dict[tuple[int, int], int] = defaultdict(int)
    for segment in segments:
        pool = tuple(segment.get("segment_pool_id", _DEFAULT_POOL))
        if pool != _DEFAULT_POOL:
            totals[pool] += int(segment["total_size"])
    return dict(totals)


def new_pool_bytes(before: Mapping[tuple[int, int], int], after: Mapping[tuple[int, int], int]) -> int:
    """Bytes of the pools that exist in ``after`` but not in ``before`` (those a capture created)."""
    return sum(size for pool, size in after.items() if pool not in before)


def live_blocks(segments: Iterable[Mapping[str, Any]], pool: tuple[int, int]) -> dict[int, int]:
    """Allocated blocks (address -> bytes) of the private pool ``pool``."""
    return {
        int(block["address"]): int(block["size"])
        for segment in segments
        if tuple(segment.get("segment_pool_id", _DEFAULT_POOL)) == tuple(pool)
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }


def allocator_segments() -> list[dict[str, Any]]:
    """The caching allocator's segments on this process's devices; empty without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return torch.cuda.memory_snapshot()


class ReplayTotals:
    """The read side of replay counting: ``counts`` and ``rejected`` per graphed layer, and totals."""

    if TYPE_CHECKING:  # read-only here: ReplayCounter keeps lists it counts into, BankReplayCounts reads live

        @property
        def counts(self) -> Sequence[int]: ...

        @property
        def rejected(self) -> Sequence[int]: ...

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def total_rejected(self) -> int:
        return sum(self.rejected)


class ReplayCounter(ReplayTotals):
    """Counts forward replays, and replays refused by their contract, per graphed layer (slot); the
    graphs' wrappers (``capture.contracts.CheckedGraph``) count into it."""

    counts: list[int]
    rejected: list[int]

    def __init__(self, slots: int) -> None:
        self.counts = [0] * slots
        self.rejected = [0] * slots


@dataclasses.dataclass(frozen=True)
class MemoryState:
    """Device and pinned-host memory at one moment (for capture baselines and teardown)."""

    allocated: int
    pools: dict[tuple[int, int], int]
    pinned_host: int | None


def memory_state() -> MemoryState:
    import torch

    pinned = None
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        try:
            pinned = int(host_stats().get("allocated_bytes.current", 0))
        except RuntimeError:  # older builds without host allocator stats
            pinned = None
    return MemoryState(
        allocated=torch.cuda.memory_allocated() if torch.cuda.is_available() else 0,
        pools=pool_bytes_by_id(allocator_segments()),
        pinned_host=pinned,
    )


def device_free_bytes() -> int | None:
    """Bytes free on this process's GPU once the caching allocator has given back the blocks it holds
    unused (as Megatron's capture start does: a graph's private pool cannot reuse them); None without
    CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def meminfo_available_bytes(meminfo: str) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``'s text, in bytes (None where it has none)."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    return None


def host_available_bytes(meminfo_path: str = "/proc/meminfo") -> int | None:
    """Host memory a new pinned allocation can take: the kernel's ``MemAvailable`` (where there is no
    ``/proc/meminfo``, the free pages ``os.sysconf`` counts), plus the pinned blocks torch's host
    allocator holds cached and free (it reuses them before pinning more). None where neither is known."""
    try:
        with open(meminfo_path) as meminfo:
            available = meminfo_available_bytes(meminfo.read())
    except OSError:
        available = None
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # no such sysconf name on this platform
            return None
    return available + _pinned_cached_free()


def _pinned_cached_free() -> int:
    """Bytes of pinned blocks torch's host allocator holds but has handed out to nobody (0 without CUDA)."""
    import torch

    try:
        stats = torch.cuda.host_memory_stats_as_nested_dict()
    except (RuntimeError, AttributeError):  # builds without host allocator stats
        return 0
    held = stats.get("allocated_bytes", {}).get("current", 0)
    active = stats.get("active_bytes", {}).get("current", held)
    return max(0, int(held) - int(active))


def ranks_on_this_host(environ: Mapping[str, str] | None = None) -> int:
    """The ranks that share this host's memory: ``LOCAL_WORLD_SIZE`` as torchrun (and ``megatron-cg run``)
    set it; 1 where it is not set or not a positive number."""
    value = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) >= 1 else 1


def steady_median(seconds: Sequence[float], skip_first: int = 1) -> float | None:
    """Median of per-step times after dropping the first ``skip_first`` (cold caches, capture)."""
    kept = list(seconds[skip_first:])
    return statistics.median(kept) if kept else None


@dataclasses.dataclass(frozen=True)
class TeardownStats:
    allocated_delta_bytes: int  # allocated bytes after teardown minus before capture
    pool_bytes_left: int  # bytes still reserved by pools the capture created
    pinned_host_delta_bytes: int | None
    pool_holders: tuple[str, ...] = ()  # what keeps blocks of those pools allocated, in words


def blocks_of_new_pools(before: MemoryState, segments: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """Allocated blocks (address -> bytes) of every private pool that did not exist ``before``."""
    segments = list(segments)
    new_pools = set(pool_bytes_by_id(segments)) - set(before.pools)
    return {address: size for pool in new_pools for address, size in live_blocks(segments, pool).items()}


def teardown_stats(before: MemoryState, after: MemoryState) -> TeardownStats:
    """What a teardown left behind, against the memory state before capture."""
    return TeardownStats(
        allocated_delta_bytes=after.allocated - before.allocated,
        pool_bytes_left=new_pool_bytes(before.pools, after.pools),
        pinned_host_delta_bytes=None
        if after.pinned_host is None or before.pinned_host is None
        else after.pinned_host - before.pinned_host,
    )
