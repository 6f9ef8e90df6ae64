"""The autograd walk behind ctx protection (slot arenas) and the stale-graph check."""

from __future__ import annotations

import torch

from megatron_cg_plugin.capture.autograd_graph import reachable_nodes
from megatron_cg_plugin.slot_sharing import saved_tensors


class _Node:
    def __init__(self, name: str, children: tuple[_Node, ...] = ()) -> None:
        self.name, self.children = name, children


class _Wrapper:
    """Made anew on every access and dropped when unreferenced, as torch wraps its C++ nodes: a
    dropped wrapper's id goes to the next one made."""

    __slots__ = ("node",)

    def __init__(self, node: _Node) -> None:
        self.node = node

    @property
    def next_functions(self) -> tuple:
        return tuple((_Wrapper(child), 0) for child in self.node.children)


def _layered_graph(depth: int) -> _Node:
    node = _Node("bottom")
    for i in range(depth):  # a residual chain with a leaf beside each step, like a layer's graph
        node = _Node(f"op{i}", (node, _Node(f"leaf{i}")))
    return node


def test_every_node_is_visited_once_although_wrappers_are_made_on_access() -> None:
    # Fails when visited ids are kept without their wrappers: reused ids prune most of the graph.
    top = _layered_graph(30)
    names = [wrapper.node.name for wrapper in reachable_nodes([_Wrapper(top)])]
    assert sorted(names) == sorted(["bottom", *(f"op{i}" for i in range(30)), *(f"leaf{i}" for i in range(30))])


def test_ctx_protection_finds_a_custom_function_behind_wrappers_made_on_access(monkeypatch) -> None:
    # Fails with the old walk in saved_tensors: the custom node at the bottom of the graph is pruned unvisited.
    class Custom(_Wrapper):
        __slots__ = ()

    class Node(_Node):
        def wrap(self) -> _Wrapper:
            return (Custom if self.name == "bottom" else _Wrapper)(self)

    def next_functions(self) -> tuple:
        return tuple((child.wrap(), 0) for child in self.node.children)

    monkeypatch.setattr(_Wrapper, "next_functions", property(next_functions))
    monkeypatch.setattr(torch.autograd.function, "BackwardCFunction", Custom)
    node = Node("bottom")
    for i in range(30):
        node = Node(f"op{i}", (node, Node(f"leaf{i}")))
    assert [w.node.name for w in saved_tensors.custom_function_nodes([_Wrapper(node)])] == ["bottom"]


def test_shared_nodes_are_yielded_once_and_none_roots_are_skipped() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    a, b = y + 1, y - 1
    nodes = list(reachable_nodes([a.grad_fn, None, b.grad_fn]))
    assert [type(n).__name__ for n in nodes].count("MulBackward0") == 1
    assert sum(type(n).__name__ == "AccumulateGrad" for n in nodes) == 1


class _Marked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.scale = w.detach().sum()
        return x * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, grad


def test_custom_function_nodes_reach_every_custom_function_of_a_layered_graph() -> None:
    # Coverage and one visit each on a real graph (torch's allocator does not reuse wrapper ids here).
    weights = [torch.randn(8, requires_grad=True) for _ in range(6)]
    h = torch.randn(8, requires_grad=True)
    for w in weights:
        h = h + _Marked.apply(h.tanh(), w).relu()
    nodes = list(saved_tensors._custom_function_nodes([h]))
    assert len(nodes) == len(weights)
    assert all(hasattr(node, "scale") for node in nodes)
