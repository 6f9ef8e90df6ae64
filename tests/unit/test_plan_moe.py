"""The fixed-capacity MoE plan against Megatron's own capacity arithmetic."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.moe.capacity import (
    MoeCapacityPlan,
    megatron_capacity,
    parse_load,
    tokens_per_rank,
    uniform_load,
    zipf_load,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 20), st.integers(1, 512), st.floats(0.05, 8.0, allow_nan=False))
def test_capacity_is_megatrons(num_tokens, num_experts, factor):
    from megatron.core.transformer.moe.moe_utils import get_capacity

    assert megatron_capacity(num_tokens, num_experts, factor) == get_capacity(num_tokens, num_experts, factor)


def tiny_moe(**overrides) -> MoeCapacityPlan:
    # The tiny-moe preset with drop-and-pad: seq 256 x micro-batch 2, 4 experts, top 2, factor 1.5.
    values = dict(
        tokens_per_rank=tokens_per_rank(
            seq_length=256, micro_batch_size=2, context_parallel=1, tensor_parallel=1, sequence_parallel=False
        ),
        topk=2,
        num_experts=4,
        capacity_factor=1.5,
    )
    return MoeCapacityPlan(**{**values, **overrides})


def test_the_tiny_moe_preset():
    plan = tiny_moe()
    assert plan.tokens_per_rank == 512 and plan.assignments == 1024
    assert plan.capacity == 384 and plan.tokens_per_local_expert == 384 and plan.local_experts == 4
    assert plan.gemm_shapes(256, 512, gated=True) == {"fc1": (384, 256, 1024), "fc2": (384, 512, 256)}
    assert plan.dropped_fraction(uniform_load(4)) == 0.0


def test_expert_and_tensor_parallel_sizes():
    plan = tiny_moe(num_experts=8, expert_parallel=4, tensor_parallel=2)
    assert plan.local_experts == 2
    assert plan.tokens_per_local_expert == plan.capacity * 8
    assert plan.gemm_shapes(256, 512, gated=False)["fc1"] == (plan.capacity * 8, 256, 256)
    with pytest.raises(ValueError, match="multiple of the expert TP size"):
        plan.gemm_shapes(256, 511, gated=False)


def test_tokens_per_rank_split_by_cp_and_tp():
    assert (
        tokens_per_rank(
            seq_length=4096, micro_batch_size=1, context_parallel=2, tensor_parallel=4, sequence_parallel=True
        )
        == 512
    )
    assert (
        tokens_per_rank(
            seq_length=4096, micro_batch_size=2, context_parallel=2, tensor_parallel=1, sequence_parallel=False
        )
        == 4096
    )
    with pytest.raises(ValueError, match="--sequence-parallel"):  # Megatron's MoE layer refuses it
        tokens_per_rank(
            seq_length=4096, micro_batch_size=2, context_parallel=2, tensor_parallel=4, sequence_parallel=False
        )
    with pytest.raises(ValueError, match="multiple of CP"):
        tokens_per_rank(
            seq_length=100, micro_batch_size=1, context_parallel=3, tensor_parallel=1, sequence_parallel=False
        )


def test_a_token_picks_k_different_experts():
    plan = tiny_moe()  # N=512, K=2, capacity 384
    # Two experts share everything: each gets every token once (512), keeps 384.
    assert plan.routed([1, 1, 0, 0]) == [512.0, 512.0, 0.0, 0.0]
    assert plan.dropped_fraction([1, 1, 0, 0]) == pytest.approx(2 * (512 - 384) / 1024)
    # Expert 0 preferred 4:1:1:1 would get 585 of 1024, more than its 512 tokens: the rest spills.
    routed = plan.routed([4, 1, 1, 1])
    assert routed[0] == 512.0 and routed[1] == pytest.approx(512 / 3) == routed[2] == routed[3]
    assert plan.dropped_fraction([4, 1, 1, 1]) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="at least 2 experts"):
        plan.routed([1, 0, 0, 0])


def test_a_capacity_over_the_tokens_pads_to_the_tokens():
    # Factor 3 x top-2 > 4 experts: capacity 768 for 512 tokens; Megatron's router pads each expert
    # to the tokens alone (and its alltoall dispatcher cannot lay the capacity out: a rule refuses it).
    plan = tiny_moe(capacity_factor=3.0)
    assert plan.capacity == 768 and plan.exceeds_tokens
    assert plan.slots == 512 and plan.tokens_per_local_expert == 512
    assert plan.dropped_fraction([1, 1, 0, 0]) == 0.0
    assert not tiny_moe(capacity_factor=2.0).exceeds_tokens  # factor x top-k == experts: exactly the tokens


def test_a_uniform_router_under_capacity_factor_one_drops_only_the_shortfall():
    plan = tiny_moe(capacity_factor=0.5)
    assert plan.capacity == 128
    assert plan.dropped_fraction(uniform_load(4)) == pytest.approx(0.5)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=8, max_size=8).filter(
        lambda shares: sum(1 for share in shares if share > 0) >= 2
    ),
    st.floats(0.1, 4.0),
    st.floats(0.1, 4.0),
)
def test_dropped_fraction_is_a_fraction_and_falls_as_capacity_grows(load, factor_a, factor_b):
    low, high = sorted((factor_a, factor_b))
    small, large = tiny_moe(num_experts=8, capacity_factor=low), tiny_moe(num_experts=8, capacity_factor=high)
    dropped_small, dropped_large = small.dropped_fraction(load), large.dropped_fraction(load)
    assert 0.0 <= dropped_large <= dropped_small + 1e-12 < 1.0
    # Kept assignments never exceed the capacity of the experts that received any.
    receiving = sum(1 for share in load if share > 0)
    assert (1 - dropped_small) * small.assignments <= receiving * small.capacity + 1e-6
    routed = small.routed(load)
    assert sum(routed) == pytest.approx(small.assignments)  # every assignment lands somewhere
    assert max(routed) <= small.tokens_per_rank + 1e-6  # no expert twice for one token


def test_zipf_load_skews_towards_the_first_expert():
    load = zipf_load(4, 1.0)
    assert load == [1.0, 0.5, 1 / 3, 0.25]
    assert zipf_load(4, 0.0) == uniform_load(4)
    assert tiny_moe(capacity_factor=1.0).dropped_fraction(load) > 0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("uniform", [1.0] * 4),
        ("zipf:2", [1.0, 0.25, 1 / 9, 1 / 16]),
        ("1,2,3,4", [1.0, 2.0, 3.0, 4.0]),
    ],
)
def test_parse_load(text, expected):
    assert parse_load(text, 4) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text, message",
    [
        ("zipf:x", "zipf:S"),
        ("zipf:-1", ">= 0"),
        ("1,2", "2 shares for 4 experts"),
        ("lots", "not understood"),
    ],
)
def test_parse_load_refuses_naming_the_form(text, message):
    with pytest.raises(ValueError, match=message):
        parse_load(text, 4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(topk=5), "exceeds --num-experts"),
        (dict(capacity_factor=0.0), "must be > 0"),
        (dict(expert_parallel=3), "multiple of --expert-model-parallel-size"),
        (dict(tokens_per_rank=0), ">= 1"),
    ],
)
def test_bad_plans_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_moe(**overrides)


def test_dropped_fraction_needs_one_share_per_expert():
    with pytest.raises(ValueError, match="one share per expert"):
        tiny_moe().dropped_fraction([1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        tiny_moe().dropped_fraction([1, -1, 1, 0])
    assert math.isclose(tiny_moe().dropped_fraction([2, 2, 2, 2]), 0.0)
