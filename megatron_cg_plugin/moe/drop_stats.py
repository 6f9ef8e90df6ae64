"""The fraction of token-to-expert assignments Megatron's router drops at a fixed capacity, measured
in the run (``--cg-moe-drop-stats``), to set beside the capacity plan (``moe.capacity``).

Forward hooks on the run's ``TopKRouter`` modules count, on the device and without a host sync,
the assignments each router call keeps (the slots of its final routing map, after capacity
dropping, that carry a probability: with padding to capacity the map also marks padded slots) and
the assignments it was asked for (tokens x top-k). Inside a captured graph the hook's two additions are
captured too, so replays keep counting. The hooks live for ``train()`` and are removed after it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["RouterDropTap"]


class RouterDropTap:
    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._counts: Any = None  # int64 [kept, asked], on the routers' device

    def attach(self, model_chunks: Iterable[Any]) -> int:
        """Hooks every Megatron ``TopKRouter`` in ``model_chunks``; returns how many."""
        from megatron.core.transformer.moe.router import TopKRouter

        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self._handles.append(module.register_forward_hook(self._count))
        return len(self._handles)

    def _count(self, module: Any, _inputs: Any, output: Any) -> None:
        import torch

        probs, routing_map = output
        if self._counts is None:
            self._counts = torch.zeros(2, dtype=torch.int64, device=routing_map.device)
        # Kept: routed slots with a probability. Drop-and-pad marks every capacity slot in the map,
        # the padding too (tokens the router did not pick for that expert, with probability 0).
        self._counts[0] += (routing_map & (probs != 0)).sum()
        self._counts[1] += routing_map.shape[0] * module.topk

    def dropped_fraction(self) -> float | None:
        """Over every router call since ``attach`` (None before any)."""
        if self._counts is None:
            return None
        kept, asked = (int(v) for v in self._counts.tolist())
        return None if not asked else 1.0 - kept / asked

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
