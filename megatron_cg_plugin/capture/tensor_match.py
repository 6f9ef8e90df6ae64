"""Whether tensors carry the metadata of a call the full check passed, in one call (the quick accept's).

``tensor_match(examples)`` returns ``matches(*tensors) -> bool``, True only where every tensor has
its example's exact type, shape, dtype, device and ``requires_grad``. Strides are not compared: a
copied-in input may have any layout, and the contract compares an in-place input's itself. No
tensor is kept: a match holds metadata only, so it never keeps a step's activations alive.

Two implementations, the first where it passes a probe of those guarantees:
- torch's own tensor guards (``torch._C._dynamo.guards.TensorGuards``, what ``torch.compile``
  checks a compiled frame's tensors with): one C++ call for all tensors. They also compare the
  tensors' dispatch keys under the thread's dispatch state, which is only stricter: a call under
  another state goes to the full check, which decides.
- attribute tuples in Python, where that private class is missing, takes other arguments, or
  fails the probe (a later torch may change it).

Why: inside a training step each read of the replay check costs several times what it does in a
loop (s95: 37 us a Llama-like layer replay, where a loop takes 8); on the CPU stand-in the Python
tuples took 13 us of a 47 us check, torch's guards 5 (s98)."""

from __future__ import annotations

import functools
import operator
from typing import Callable, Sequence

import torch

TensorMatch = Callable[..., bool]

_META = operator.attrgetter("shape", "dtype", "device", "requires_grad")


def tensor_match(examples: Sequence[torch.Tensor]) -> TensorMatch:
    """A test of ``len(examples)`` tensors, in order, against the examples' metadata."""
    guards = _torch_guards(examples) if _torch_guards_hold() else None
    if guards is not None:
        return guards.check
    return _python_match(examples)


def _python_match(examples: Sequence[torch.Tensor]) -> TensorMatch:
    types, metas = tuple(map(type, examples)), tuple(map(_META, examples))

    def matches(*tensors: torch.Tensor) -> bool:  # types first: a non-tensor has no shape to read
        return tuple(map(type, tensors)) == types and tuple(map(_META, tensors)) == metas

    return matches


def _torch_guards(examples: Sequence[torch.Tensor]):
    """torch's guards over ``examples``: sizes compared, strides not; None if they cannot be built."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None
    try:
        guards = TensorGuards(*examples, dynamic_dims_sizes=[list(t.shape) for t in examples],
                              dynamic_dims_strides=[[None] * t.dim() for t in examples])
        return guards if guards.check(*examples) is True else None
    except (TypeError, RuntimeError, SystemError, ValueError):  # another signature in another torch
        return None


@functools.cache
def _torch_guards_hold() -> bool:
    """Once a process: torch's guards refuse each difference the contract needs refused (and a
    non-tensor without raising), and take an equal tensor."""
    example = torch.zeros(2, 3, requires_grad=True)
    guards = _torch_guards((example,))
    if guards is None:
        return False
    differing = (torch.zeros(2, 4, requires_grad=True), torch.zeros(3, 2, requires_grad=True),
                 torch.zeros(2, 3, dtype=torch.float64, requires_grad=True), torch.zeros(2, 3),
                 torch.zeros(2, 3, device="meta", requires_grad=True),
                 torch.nn.Parameter(torch.zeros(2, 3)), None)
    try:
        return (guards.check(torch.zeros(2, 3, requires_grad=True)) is True
                and guards.check(torch.zeros(3, 2, requires_grad=True).t()) is True  # strides not compared
                and not any(guards.check(other) for other in differing))
    except (TypeError, RuntimeError, SystemError, ValueError):
        return False
