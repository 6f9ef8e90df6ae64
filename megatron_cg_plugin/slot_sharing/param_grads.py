"""Parameter-gradient buffers shared by slot-shared captures whose backward replays never overlap.

A slot-shared backward graph writes each parameter's gradient into a buffer outside the pool, and
the replay clones it right after (autograd may keep a returned gradient as ``.grad``). Within one
capture every graph already shares one buffer per parameter. Across captures (one per layer under
``--cg-slot-capture``) the replays run one at a time on one stream, and each clone is queued before
the next replay, so layers whose parameters have the same layout can write the same buffers: one
layer's worth of buffers instead of one per layer (about 300 MB on a 12-layer, h=1024 model).
Parameters a graph never reaches (an MoE layer's experts under an ``attn`` graph) get no buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ParamGradBuffers"]


class ParamGradBuffers:
    """Buffers by parameter layout (shape, stride, dtype, device). ``take(params)`` gives each
    parameter its own buffer among those of one capture, reusing what earlier captures made."""

    def __init__(self) -> None:
        self._by_layout: dict[tuple, list[torch.Tensor]] = {}

    def take(
        self, params: Sequence[torch.Tensor], reached: Sequence[bool] | None = None
    ) -> tuple[list[torch.Tensor | None], int]:
        """The buffers for ``params`` (in order; None where ``reached`` says the graphs give the
        parameter no gradient) and the bytes this call allocated."""
        taken: dict[tuple, int] = {}
        buffers: list[torch.Tensor | None] = []
        new_bytes = 0
        for param, gets_grad in zip(params, [True] * len(params) if reached is None else reached, strict=True):
            if not gets_grad:
                buffers.append(None)
                continue
            layout = (tuple(param.shape), tuple(param.stride()), param.dtype, param.device)
            index = taken.get(layout, 0)
            taken[layout] = index + 1
            pool = self._by_layout.setdefault(layout, [])
            if index == len(pool):
                pool.append(torch.empty_like(param))
                new_bytes += pool[-1].untyped_storage().nbytes()
            buffers.append(pool[index])
        return buffers, new_bytes

    @property
    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for pool in self._by_layout.values() for b in pool)
