"""Fixed-capacity THD layouts for graphed packed sequences (pure Python, no CUDA).

A graph replays fixed shapes, so a packed (THD) microbatch must always bring the same number of
tokens per rank and ``cu_seqlens`` buffers of the same length. Under (hybrid) context parallelism
of size ``cp``, TE splits every sequence into ``2 * cp`` chunks (rank r keeps chunks r and
2cp-1-r), so each sequence is padded to a multiple of ``2 * cp``; the pack then holds
``cp * tokens_per_rank`` tokens globally. The layout:

- ``cu_seqlens``: cumulative actual lengths, ``cu_seqlens_padded``: cumulative padded lengths
  (TE's ``pad_between_seqs`` form), each ``max_seqs + 2`` entries long;
- after the real sequences a dummy sequence of actual length 0 covers the rest of the buffer, so
  ``cu_seqlens_padded[-1]`` is exactly the pack's token count (kernels that walk the padded layout,
  fused RoPE and the CP tail handling, then cover every token);
- unused entries repeat the last value (zero-length sequences).

The same layout feeds the eager run, so graphed and eager runs compute on identical shapes.

Without hybrid CP (``--dataloader-inter-document-masking``, ``--sft``: ``packed.graphs``) Megatron's
batch already covers every token, so its offsets need no dummy: ``PackedLayout`` holds them in
``max_seqs + 1`` entries, padded by the same rule (``padded_offsets``), with ``max_seqlen`` bound to
``--cg-thd-max-seqlen`` (default ``--seq-length``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from megatron_cg_plugin.config import is_power_of_two

__all__ = [
    "PackedLayout",
    "ThdCapacityError",
    "check_sequence_count",
    "check_sequence_length",
    "fixed_capacity_layout",
    "padded_length",
    "padded_offsets",
    "partitioned_indices",
]


class ThdCapacityError(ValueError):
    """A pack that does not fit the capacity the graphs were captured with."""


def check_sequence_count(count: int, max_seqs: int) -> None:
    """Raises ``ThdCapacityError`` naming ``--cg-thd-max-seqs`` when a pack of ``count`` sequences
    does not fit buffers captured for ``max_seqs``."""
    if count > max_seqs:
        raise ThdCapacityError(
            f"the pack holds {count} sequences but graphs were captured for at most {max_seqs}; "
            f"raise --cg-thd-max-seqs to at least {count} (or pack fewer sequences per microbatch)."
        )


def check_sequence_length(longest: int, max_seqlen: int) -> None:
    """Raises ``ThdCapacityError`` naming ``--cg-thd-max-seqlen`` when a pack's longest sequence of
    ``longest`` tokens exceeds the ``max_seqlen`` the graphs were captured with (attention and RoPE
    would compute it with that bound, wrongly)."""
    if longest > max_seqlen:
        raise ThdCapacityError(
            f"the pack's longest sequence holds {longest} tokens but graphs were captured for at most {max_seqlen}; "
            f"raise --cg-thd-max-seqlen to at least {longest}, or drop it to use --seq-length (with --sft a sample's "
            "end padding belongs to its last conversation)."
        )


def padded_offsets(offsets: Sequence[int], entries: int) -> tuple[int, ...]:
    """``offsets`` (cumulative lengths, from 0) padded to ``entries`` values: each added entry repeats
    the last offset, a sequence of length 0, which attention and RoPE skip. Raises
    ``ThdCapacityError`` when they hold more sequences than ``entries - 1``."""
    if not offsets:
        raise ValueError("cumulative sequence lengths start with 0: got none.")
    check_sequence_count(len(offsets) - 1, entries - 1)
    return (*offsets, *[offsets[-1]] * (entries - len(offsets)))


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """The fixed THD layout of a packed microbatch without hybrid CP: its ``cu_seqlens`` in
    ``max_seqs + 1`` entries, its ``max_seqlen`` the bound ``max_seqlen`` (``--cg-thd-max-seqlen``,
    default ``--seq-length``: a document never crosses a sample, so none is longer)."""

    max_seqs: int  # --cg-thd-max-seqs
    max_seqlen: int  # --cg-thd-max-seqlen, else --seq-length
    seq_length: int | None = None  # --seq-length, the tokens of a sample (None: max_seqlen)

    def __post_init__(self) -> None:
        if self.max_seqs < 1:
            raise ValueError(f"--cg-thd-max-seqs {self.max_seqs} must be >= 1.")
        if self.max_seqlen < 1:
            raise ValueError(f"the sequence bound {self.max_seqlen} must be >= 1 (--cg-thd-max-seqlen, --seq-length).")
        if self.max_seqlen > self.sample_tokens:
            raise ValueError(
                f"--cg-thd-max-seqlen {self.max_seqlen} exceeds --seq-length {self.sample_tokens}: a "
                "document never crosses a sample; lower it or drop it."
            )

    @property
    def entries(self) -> int:
        return self.max_seqs + 1

    @property
    def sample_tokens(self) -> int:
        return self.max_seqlen if self.seq_length is None else self.seq_length

    def sample_offsets(self, micro_batch_size: int) -> tuple[int, ...]:
        """A valid layout of the captured shapes: each of the microbatch's samples cut into sequences
        of ``max_seqlen`` tokens (the last one shorter), covering every token of the flattened stream
        as Megatron's offsets do. Raises ``ThdCapacityError`` when ``max_seqs`` is below the
        ``micro_batch_size x ceil(sample_tokens / max_seqlen)`` sequences that takes."""
        starts = range(0, self.sample_tokens, self.max_seqlen)
        offsets = [sample * self.sample_tokens + start for sample in range(micro_batch_size) for start in starts]
        return padded_offsets((*offsets, micro_batch_size * self.sample_tokens), self.entries)


@dataclasses.dataclass(frozen=True)
class _ThdLayout:
    cp_size: int
    tokens: int  # global tokens in the pack: cp_size * tokens_per_rank
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]
    sequences: int  # real sequences (the dummy not counted)

    @property
    def max_seqlen(self) -> int:
        """The bound graphs are captured with: the whole pack (no sequence can be longer)."""
        return self.tokens


def padded_length(length: int, cp_size: int) -> int:
    multiple = 2 * cp_size
    return (length + multiple - 1) // multiple * multiple


def fixed_capacity_layout(lengths: Sequence[int], cp_size: int, tokens_per_rank: int, max_seqs: int) -> _ThdLayout:
    """The fixed-capacity layout of a pack of sequences with these actual ``lengths``.

    Raises ``ThdCapacityError`` naming what to raise when the pack has more sequences than
    ``max_seqs`` (``--cg-thd-max-seqs``) or more padded tokens than ``cp_size * tokens_per_rank``
    (``--max-seqlen-per-dp-cp-rank``)."""
    if not is_power_of_two(cp_size):
        raise ValueError(f"CP size {cp_size} must be a power of two.")
    if tokens_per_rank < 2 or tokens_per_rank % 2:
        raise ValueError(
            f"tokens per rank {tokens_per_rank} must be even and >= 2 (TE splits each rank's share in halves)."
        )
    if max_seqs < 1:
        raise ValueError(f"--cg-thd-max-seqs {max_seqs} must be >= 1.")
    if any(length < 1 for length in lengths):
        raise ValueError(f"sequence lengths must be >= 1, got {list(lengths)}.")
    check_sequence_count(len(lengths), max_seqs)
    tokens = cp_size * tokens_per_rank
    padded = [padded_length(length, cp_size) for length in lengths]
    if sum(padded) > tokens:
        raise ThdCapacityError(
            f"the pack needs {sum(padded)} tokens after padding each sequence to a multiple of {2 * cp_size} "
            f"(CP size {cp_size}) but holds {tokens} ({cp_size} x {tokens_per_rank} per rank); raise "
            "--max-seqlen-per-dp-cp-rank, or let the scheduler pick a larger CP size for it."
        )
    cu, cu_padded = [0], [0]
    for length, pad in zip(lengths, padded):
        cu.append(cu[-1] + length)
        cu_padded.append(cu_padded[-1] + pad)
    cu.append(cu[-1])  # the dummy: no actual tokens ...
    cu_padded.append(tokens)  # ... covering the rest of the buffer
    return _ThdLayout(
        cp_size, tokens, padded_offsets(cu, max_seqs + 2), padded_offsets(cu_padded, max_seqs + 2), len(lengths)
    )


def partitioned_indices(cu_seqlens_padded: Sequence[int], cp_size: int, rank: int) -> list[int]:
    """The pack's token indices that CP rank ``rank`` of ``cp_size`` keeps, in its local order: of
    every sequence (padded to a multiple of ``2 * cp_size``), chunk ``rank`` then chunk
    ``2 * cp_size - 1 - rank``. The same split as TE's ``thd_get_partitioned_indices`` (its
    ``thd_partition_indices_kernel``), computed on the host, where the layout already is."""
    if not is_power_of_two(cp_size) or not 0 <= rank < cp_size:
        raise ValueError(f"rank {rank} of CP size {cp_size}: the size must be a power of two and 0 <= rank < size.")
    indices: list[int] = []
    for start, end in itertools.pairwise(cu_seqlens_padded):
        if end < start:
            raise ValueError(f"cu_seqlens_padded must not decrease, got {list(cu_seqlens_padded)}.")
        if (end - start) % (2 * cp_size):
            raise ValueError(
                f"a sequence of {end - start} padded tokens cannot be split over CP size {cp_size}; "
                f"pad it to a multiple of {2 * cp_size} (fixed_capacity_layout does)."
            )
        chunk = (end - start) // (2 * cp_size)
        for index in (rank, 2 * cp_size - 1 - rank):
            indices.extend(range(start + index * chunk, start + (index + 1) * chunk))
    return indices
