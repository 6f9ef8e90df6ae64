"""The memory a strided tensor addresses: its span, from the first to the last element it reaches.

Transposed, strided and expanded (self-overlapping) views address a span of their storage that is
not ``numel`` contiguous elements. Copying or aliasing a view by its span keeps its exact layout.
"""

from __future__ import annotations

import torch

__all__ = ["span_elements", "span_of"]


def span_elements(tensor: torch.Tensor) -> int:
    """Elements from the tensor's first to its last addressed element; 0 for an empty tensor.
    (Strides are non-negative in torch, so the first addressed element is at the storage offset.)"""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def span_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat, contiguous tensor over the span ``tensor`` addresses, sharing its storage."""
    flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return flat.set_(tensor.untyped_storage(), tensor.storage_offset(), (span_elements(tensor),), (1,))
