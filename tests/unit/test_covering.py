"""All-pairs covering designs (matrix.covering): every pair of values that can meet does, the design is
the same on every run, and preferred combinations cover their pairs before the others."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.matrix.covering import all_pairs, combinations, pairs_of, uncovered_pairs

factor_spaces = st.dictionaries(
    st.sampled_from("abcde"),
    st.lists(st.sampled_from("uvwxyz"), min_size=1, max_size=4, unique=True),
    min_size=2,
    max_size=5,
)


@settings(max_examples=60, deadline=None)
@given(factor_spaces, st.integers(0, 10_000))
def test_every_allowed_pair_meets_in_some_combination(factors, seed):
    banned = {c for i, c in enumerate(combinations(factors)) if (i * 7919 + seed) % 5 == 0}  # an arbitrary constraint
    allowed = lambda cell: tuple(cell.items()) not in banned  # noqa: E731
    if all(c in banned for c in combinations(factors)):
        with pytest.raises(ValueError, match="no combination"):
            all_pairs(factors, allowed=allowed)
        return
    design = all_pairs(factors, allowed=allowed)
    assert not uncovered_pairs(design, factors, allowed=allowed)
    assert all(allowed(cell) for cell in design)
    assert len(design) <= len(combinations(factors)) - len(banned)


@settings(max_examples=40, deadline=None)
@given(factor_spaces)
def test_the_design_is_no_larger_than_the_product_and_at_least_the_two_largest_factors(factors):
    design = all_pairs(factors)
    sizes = sorted((len(values) for values in factors.values()), reverse=True)
    assert sizes[0] * sizes[1] <= len(design) <= len(combinations(factors))


def test_the_same_factors_give_the_same_design():
    factors = {"model": ("a", "b", "c", "d"), "scope": ("x", "y", "z"), "mbs": ("1", "2")}
    assert all_pairs(factors) == all_pairs(dict(factors))


def test_a_pair_no_allowed_combination_holds_is_not_required():
    factors = {"model": ("dense", "moe"), "scope": ("layer", "moe")}
    design = all_pairs(factors, allowed=lambda c: c["scope"] != "moe" or c["model"] == "moe")
    assert {"model": "dense", "scope": "moe"} not in design
    assert len(design) == 3


def test_preferred_combinations_cover_what_they_can_before_the_others():
    factors = {"a": ("0", "1", "2"), "b": ("0", "1", "2")}
    refused = lambda c: c["a"] == "2"  # noqa: E731 - a rule refuses every cell with a=2
    design = all_pairs(factors, preferred=lambda c: not refused(c))
    running = [c for c in design if not refused(c)]
    # Every pair a running cell can hold is held by a running cell; refused cells add only a=2's pairs.
    assert not uncovered_pairs(running, factors, allowed=lambda c: not refused(c))
    assert all(c["a"] == "2" for c in design if refused(c)) and len(design) == 9


def test_pairs_of_a_combination_are_every_two_of_its_values():
    combination = (("a", "0"), ("b", "1"), ("c", "2"))
    assert pairs_of(combination) == set(itertools.combinations(combination, 2))


@pytest.mark.parametrize("factors, message", [({"a": ()}, "no values"), ({"a": ("x", "x")}, "twice")])
def test_bad_factors_are_refused(factors, message):
    with pytest.raises(ValueError, match=message):
        all_pairs(factors)


@settings(max_examples=40, deadline=None)
@given(factor_spaces)
def test_a_design_extended_by_a_factor_keeps_its_combinations_and_adds_only_what_the_new_pairs_need(factors):
    assume(len(factors) >= 3)  # a single factor has no pairs: its design is empty
    base = dict(list(factors.items())[:-1])
    added, values = list(factors.items())[-1]
    earlier = [{**cell, added: values[0]} for cell in all_pairs(base)]
    more = all_pairs(factors, covered=earlier)
    assert not uncovered_pairs(earlier + more, factors)
    assert all(cell[added] != values[0] for cell in more)  # the earlier cells hold every pair of the first value
    assert len(more) <= len(combinations(factors)) - len(earlier)
