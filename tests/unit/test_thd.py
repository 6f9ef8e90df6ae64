"""Fixed-capacity THD layouts: shapes that never change, padding TE's CP split needs, clear refusals."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.packed.layout import ThdCapacityError, fixed_capacity_layout, padded_length


@st.composite
def packs(draw):
    cp = draw(st.sampled_from([1, 2, 4, 8]))
    tokens_per_rank = 2 * draw(st.integers(1, 256))
    max_seqs = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, 2 * tokens_per_rank), min_size=0, max_size=max_seqs + 1))
    return lengths, cp, tokens_per_rank, max_seqs


@settings(max_examples=400, deadline=None)
@given(packs())
def test_layout_properties_or_a_named_refusal(case):
    lengths, cp, tokens_per_rank, max_seqs = case
    fits = len(lengths) <= max_seqs and sum(padded_length(n, cp) for n in lengths) <= cp * tokens_per_rank
    if not fits:
        with pytest.raises(ThdCapacityError, match=r"--cg-thd-max-seqs|--max-seqlen-per-dp-cp-rank"):
            fixed_capacity_layout(lengths, cp, tokens_per_rank, max_seqs)
        return
    layout = fixed_capacity_layout(lengths, cp, tokens_per_rank, max_seqs)
    cu, cu_padded = layout.cu_seqlens, layout.cu_seqlens_padded
    assert len(cu) == len(cu_padded) == max_seqs + 2  # the same buffer shape for every pack
    assert cu[0] == cu_padded[0] == 0 and cu_padded[-1] == layout.tokens == cp * tokens_per_rank
    actual = [b - a for a, b in itertools.pairwise(cu)]
    padded = [b - a for a, b in itertools.pairwise(cu_padded)]
    assert actual[: len(lengths)] == list(lengths)
    assert all(p % (2 * cp) == 0 and p >= a >= 0 for a, p in zip(actual, padded))
    assert actual[len(lengths) :] == [0] * (max_seqs + 1 - len(lengths))  # the dummy and the unused entries
    assert layout.sequences == len(lengths) and layout.max_seqlen == layout.tokens


def test_refusals_name_the_flag_to_raise():
    with pytest.raises(ThdCapacityError, match="raise --cg-thd-max-seqs to at least 3"):
        fixed_capacity_layout([4, 4, 4], 1, 64, 2)
    with pytest.raises(ThdCapacityError, match=r"needs 132 tokens .* holds 128 .* raise --max-seqlen-per-dp-cp-rank"):
        fixed_capacity_layout([130], 2, 64, 2)  # 130 padded to a multiple of 4 is 132 > 2 x 64
    with pytest.raises(ValueError, match="power of two"):
        fixed_capacity_layout([4], 3, 64, 2)
    with pytest.raises(ValueError, match="must be even"):
        fixed_capacity_layout([4], 1, 63, 2)


def test_example_layout():
    layout = fixed_capacity_layout([5, 3], 2, 8, 3)  # 16 tokens over 2 ranks, sequences padded to 4
    assert layout.cu_seqlens == (0, 5, 8, 8, 8)
    assert layout.cu_seqlens_padded == (0, 8, 12, 16, 16)
