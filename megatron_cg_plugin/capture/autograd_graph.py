"""Walking an autograd graph backwards from its roots, each node once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["reachable_nodes"]


def reachable_nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every autograd node reachable backwards from ``roots`` (``grad_fn`` nodes), each once.

    The walk keeps every visited node's Python wrapper alive until it ends. torch makes the
    wrappers of C++ nodes on access, and a dropped wrapper's id can go to the next one made, which
    would prune that branch unvisited. On Hopper that skipped FusedAttnFunc's node in some
    frames, so its ctx's S-scale snapshot stayed in the graph pool."""
    stack = list(roots)
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)
