"""Branches of one slot (mutually exclusive graph variants) must be interchangeable to consumers.

They share output and gradient storage, so whatever reads a slot's outputs after a replay must find
the same layout whichever branch ran: same shape, stride, dtype, device, requires_grad and bytes
for every output and gradient, the same alias topology (which outputs share storage, which view
module state), and the same arenas. Checked at capture; a mismatch is refused, naming the slot,
the two branches, the field and both values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

import torch

from megatron_cg_plugin.capture.contracts import TensorSpec, alias_topology

__all__ = ["BranchMismatchError", "BranchSignature", "check_branches"]


class BranchMismatchError(ValueError):
    def __init__(self, slot: int, first: Hashable, other: Hashable, field: str, a: object, b: object) -> None:
        self.slot, self.field = slot, field
        super().__init__(
            f"slot {slot}: branches {first!r} and {other!r} cannot share storage: {field} is {a!r} in "
            f"{first!r} but {b!r} in {other!r}. Give the variants identical output/gradient layouts "
            "(pad to a common shape), or plan them into different slots."
        )


@dataclasses.dataclass(frozen=True)
class _TensorLayout:
    spec: TensorSpec
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _TensorLayout:
        return cls(TensorSpec.of(tensor), tensor.untyped_storage().nbytes())


@dataclasses.dataclass(frozen=True)
class BranchSignature:
    outputs: tuple[_TensorLayout, ...]
    grads: tuple[_TensorLayout, ...]
    alias: tuple
    arenas: tuple[int, ...]

    @classmethod
    def of(
        cls,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        *,
        state: Mapping[str, torch.Tensor] | None = None,
        arenas: Sequence[int] = (),
    ) -> BranchSignature:
        return cls(
            tuple(_TensorLayout.of(t) for t in outputs),
            tuple(_TensorLayout.of(t) for t in grads),
            alias_topology(outputs, state),
            tuple(arenas),
        )


def check_branches(slot: int, branches: Mapping[Hashable, BranchSignature]) -> None:
    """Raises ``BranchMismatchError`` at the first difference from the first branch."""
    items = list(branches.items())
    if not items:
        return
    first, reference = items[0]
    for name, signature in items[1:]:
        for kind in ("outputs", "grads"):
            mine, theirs = getattr(reference, kind), getattr(signature, kind)
            if len(mine) != len(theirs):
                raise BranchMismatchError(slot, first, name, f"number of {kind}", len(mine), len(theirs))
            for index, (a, b) in enumerate(zip(mine, theirs)):
                for field in ("shape", "stride", "dtype", "device", "requires_grad"):
                    if getattr(a.spec, field) != getattr(b.spec, field):
                        raise BranchMismatchError(
                            slot,
                            first,
                            name,
                            f"{kind}[{index}].{field}",
                            getattr(a.spec, field),
                            getattr(b.spec, field),
                        )
                if a.nbytes != b.nbytes:
                    raise BranchMismatchError(slot, first, name, f"{kind}[{index}] bytes", a.nbytes, b.nbytes)
        if reference.alias != signature.alias:
            raise BranchMismatchError(slot, first, name, "alias topology", reference.alias, signature.alias)
        if reference.arenas != signature.arenas:
            raise BranchMismatchError(slot, first, name, "arenas", reference.arenas, signature.arenas)
