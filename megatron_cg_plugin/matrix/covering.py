"""All-pairs covering designs (pure): few configurations in which every pair of factor values meets.

A support matrix over models, scopes, precisions, capture paths and micro-batch sizes has hundreds
of full combinations; a pairwise design keeps the cases to a few dozen while every value of every
factor is tried beside every value of every other. Configurations are chosen greedily (each the
candidate covering the most pairs not yet covered, ties broken by candidate order, so the design
is the same on every machine) from the combinations ``allowed`` admits. A pair that no admitted
combination holds is not required. ``preferred`` combinations (those that run rather than are
refused) cover their pairs first; the others only cover what no preferred one can.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

__all__ = ["all_pairs", "combinations", "pairs_of", "uncovered_pairs"]

_Combination = tuple[tuple[str, str], ...]  # ((factor, value), ...) in factor order
_Pair = tuple[tuple[str, str], tuple[str, str]]


def combinations(factors: Mapping[str, Sequence[str]]) -> list[_Combination]:
    """Every full combination, in factor and value order."""
    names = list(factors)
    for name in names:
        if not factors[name]:
            raise ValueError(f"factor {name!r} has no values.")
        if len(set(factors[name])) != len(factors[name]):
            raise ValueError(f"factor {name!r} lists a value twice: {list(factors[name])}.")
    return [tuple(zip(names, values)) for values in itertools.product(*(factors[n] for n in names))]


def pairs_of(combination: _Combination) -> set[_Pair]:
    return set(itertools.combinations(combination, 2))


def all_pairs(
    factors: Mapping[str, Sequence[str]],
    *,
    allowed: Callable[[dict[str, str]], bool] = lambda _: True,
    preferred: Callable[[dict[str, str]], bool] = lambda _: True,
    covered: Iterable[Mapping[str, str]] = (),
) -> list[dict[str, str]]:
    """A pairwise covering design over ``factors`` (name -> values): every pair of values of two
    factors that some allowed combination holds is held by one of the returned combinations or of
    ``covered`` (combinations chosen before, which are not returned: a design extended by a factor
    keeps its cells)."""
    candidates = [c for c in combinations(factors) if allowed(dict(c))]
    if not candidates:
        raise ValueError("no combination of the factors is allowed.")
    names = list(factors)
    chosen: list[_Combination] = [tuple((n, c[n]) for n in names) for c in covered]
    given = len(chosen)
    for stage in ([c for c in candidates if preferred(dict(c))], candidates):
        uncovered = set().union(*(pairs_of(c) for c in stage)) - set().union(set(), *(pairs_of(c) for c in chosen))
        chosen += _greedy_cover(stage, uncovered)
    return [dict(c) for c in chosen[given:]]


def _greedy_cover(candidates: Sequence[_Combination], uncovered: set[_Pair]) -> list[_Combination]:
    chosen = []
    while uncovered:
        best = max(candidates, key=lambda c: len(pairs_of(c) & uncovered))  # the first of the best on ties
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


def uncovered_pairs(
    design: Iterable[Mapping[str, str]],
    factors: Mapping[str, Sequence[str]],
    *,
    allowed: Callable[[dict[str, str]], bool] = lambda _: True,
) -> set[_Pair]:
    """The pairs some allowed combination holds that no combination of ``design`` holds (empty for a
    covering design): the check a regenerated matrix is held to."""
    needed = set().union(set(), *(pairs_of(c) for c in combinations(factors) if allowed(dict(c))))
    names = list(factors)
    held = set().union(set(), *(pairs_of(tuple((n, d[n]) for n in names)) for d in design))
    return needed - held
