"""Slot planning for several graph variants sharing one memory pool (pure Python, no CUDA).

A schedule's order (Megatron's ``convert_schedule_table_to_order`` format: ``+c`` runs the forward
of model chunk ``c``, ``-c`` its backward, each chunk's microbatches first-in first-out) makes a
*frame* per forward: the tensors it saves must survive until its backward. Frames whose lifetimes
overlap must not share memory; frames that never overlap can. The planner colours frames with
slots (interval-graph colouring, greedy by start, optimal: the ring is exactly the most frames ever
live at once) and, among free slots, picks the one whose size fits best, so a slot's arena is sized
by the largest of its branches (the variants that ever use it) rather than by their sum.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict, deque
from collections.abc import Hashable, Mapping, Sequence

__all__ = [
    "ARENA_ALIGNMENT",
    "OrderError",
    "SlotPlan",
    "arena_aligned",
    "exclusive_plan",
    "per_slot_max",
    "plan_slots",
]

_DEFAULT_VARIANT = "default"
ARENA_ALIGNMENT = 256  # bytes; every storage copied into an arena starts aligned for vectorized kernels


def arena_aligned(nbytes: int) -> int:
    return (nbytes + ARENA_ALIGNMENT - 1) // ARENA_ALIGNMENT * ARENA_ALIGNMENT


class OrderError(ValueError):
    """The order cannot be planned; the message names the position and what to change."""


@dataclasses.dataclass(frozen=True)
class _Frame:
    index: int  # forward number, in order
    chunk: int  # 1-based model chunk
    microbatch: int  # per-chunk forward count, from 0
    variant: Hashable
    forward_at: int  # position of the forward in the order
    backward_at: int  # position of its backward
    slot: int

    def overlaps(self, other: _Frame) -> bool:
        return self.forward_at <= other.backward_at and other.forward_at <= self.backward_at


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    frames: tuple[_Frame, ...]
    ring_size: int
    slot_sizes: tuple[int, ...]  # bytes per slot: the largest frame that uses it (0 without sizes)

    def branches(self, slot: int) -> frozenset[Hashable]:
        """Variants that use ``slot`` (mutually exclusive in time: they share its arena)."""
        return frozenset(f.variant for f in self.frames if f.slot == slot)


def _entries(order: Sequence[float]) -> list[int]:
    entries = []
    for position, entry in enumerate(order):
        if entry != int(entry):
            raise OrderError(
                f"order entry {entry} at position {position} is a delayed weight-gradient (fractional) "
                "entry: saved-tensor arenas cannot protect state kept until a deferred wgrad; turn off "
                "--delay-wgrad-compute for graphed layers."
            )
        if entry == 0:
            raise OrderError(
                f"order entry 0 at position {position}: entries are +chunk (forward) or "
                "-chunk (backward), chunks counted from 1."
            )
        entries.append(int(entry))
    return entries


def _spans(entries: Sequence[int], variants: Sequence[Hashable]) -> list[list]:
    """Each forward's [chunk, microbatch, variant, forward_at, backward_at], matched to its backward."""
    pending: dict[int, deque[int]] = defaultdict(deque)  # chunk -> forward indices awaiting backward
    spans: list[list] = []
    per_chunk: dict[int, int] = defaultdict(int)
    for position, entry in enumerate(entries):
        chunk = abs(entry)
        if entry > 0:
            pending[chunk].append(len(spans))
            spans.append([chunk, per_chunk[chunk], variants[len(spans)], position, None])
            per_chunk[chunk] += 1
        elif not pending[chunk]:
            raise OrderError(
                f"backward of chunk {chunk} at position {position} has no pending forward of "
                "that chunk; the order must run each forward before its backward."
            )
        else:
            spans[pending[chunk].popleft()][4] = position
    unmatched = [f"chunk {s[0]} microbatch {s[1]}" for s in spans if s[4] is None]
    if unmatched:
        raise OrderError(
            f"forwards without a backward: {', '.join(unmatched)}; a training order runs every forward's backward."
        )
    return spans


def _assign_slots(spans: Sequence[list], sizes: Mapping[tuple[int, Hashable], int]) -> tuple[list[int], list[int]]:
    """Interval colouring in forward order: each frame's slot, and each slot's size (its largest frame)."""
    slot_sizes: list[int] = []
    free: list[int] = []  # slots not in use, kept sorted by index
    releases: list[tuple[int, int]] = []  # (backward_at, slot), min-heap
    assigned: list[int] = [0] * len(spans)
    for index in sorted(range(len(spans)), key=lambda i: spans[i][3]):
        chunk, _, variant, forward_at, _ = spans[index]
        while releases and releases[0][0] < forward_at:
            free.append(heapq.heappop(releases)[1])
        free.sort()
        need = sizes.get((chunk, variant), 0)
        if free:
            fitting = [s for s in free if slot_sizes[s] >= need]
            # Best fit keeps a big slot for big frames; otherwise grow the largest free slot least.
            slot = (
                min(fitting, key=lambda s: (slot_sizes[s], s))
                if fitting
                else max(free, key=lambda s: (slot_sizes[s], -s))
            )
            free.remove(slot)
        else:
            slot = len(slot_sizes)
            slot_sizes.append(0)
        slot_sizes[slot] = max(slot_sizes[slot], need)
        assigned[index] = slot
        heapq.heappush(releases, (spans[index][4], slot))
    return assigned, slot_sizes


def plan_slots(
    order: Sequence[float],
    variants: Sequence[Hashable] | None = None,
    sizes: Mapping[tuple[int, Hashable], int] | None = None,
) -> SlotPlan:
    """Plans the slot ring for ``order``.

    ``variants`` gives the variant of each forward, in order (default: one variant); ``sizes`` the
    bytes a frame of (chunk, variant) needs. Raises ``OrderError`` for fractional entries, a
    backward without a live forward of its chunk, or forwards never followed by their backward.
    """
    entries = _entries(order)
    forwards = sum(1 for e in entries if e > 0)
    if variants is None:
        variants = [_DEFAULT_VARIANT] * forwards
    if len(variants) != forwards:
        raise OrderError(f"{len(variants)} variants given for {forwards} forwards; give one per forward.")
    spans = _spans(entries, variants)
    assigned, slot_sizes = _assign_slots(spans, sizes or {})
    frames = tuple(
        _Frame(index=i, chunk=s[0], microbatch=s[1], variant=s[2], forward_at=s[3], backward_at=s[4], slot=assigned[i])
        for i, s in enumerate(spans)
    )
    return SlotPlan(frames=frames, ring_size=len(slot_sizes), slot_sizes=tuple(slot_sizes))


def exclusive_plan(variants: Sequence[Hashable]) -> SlotPlan:
    """The plan of variants that never overlap (each frame's backward before the next forward, as
    the dynamic-CP banks of one layer): one slot that every variant uses."""
    return plan_slots([1, -1] * len(variants), list(variants))


def per_slot_max(
    ring_size: int, slots_of: Mapping[Hashable, Sequence[int]], bytes_of: Mapping[Hashable, int]
) -> list[int]:
    """Per slot, the largest ``bytes_of`` among the variants placed there (``slots_of``: each
    variant's slots): an arena shared by a slot's variants, sized by the largest of them only."""
    sizes = [0] * ring_size
    for variant, slots in slots_of.items():
        for slot in slots:
            sizes[slot] = max(sizes[slot], bytes_of[variant])
    return sizes
