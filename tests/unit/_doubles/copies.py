"""``InlineCopies``: the CPU stand-in for both copy seams of slot-shared offload, the staging ring's
``slot_sharing.offload_staging._CopyEngine`` (copies between replays) and in-graph offload's
``slot_sharing.offload_arenas.Transfers``. Each copy happens at once, in order, and is logged as
``(kind, elements)``, so a test reads what was asked in the order it was asked."""

from __future__ import annotations

from typing import Any

import torch


class InlineCopies:
    """Plain copies at once, and a log of them (CPU tests)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    # -- _CopyEngine (slot_sharing.offload_staging): no streams, so no tokens to wait for
    def compute_point(self) -> Any:
        return None

    def copy(self, destination: torch.Tensor, source: torch.Tensor, after: Any, kind: str) -> Any:
        destination.copy_(source)
        self.log.append((kind, source.numel()))
        return None

    def compute_waits(self, token: Any) -> None:
        pass

    def drain(self) -> None:
        pass

    # -- Transfers (slot_sharing.offload_arenas)
    def reset(self) -> None:
        self.log.append(("reset", 0))

    def stage(self, source: torch.Tensor) -> torch.Tensor:
        self.log.append(("stage", source.numel()))
        return source.clone()

    def to_host(self, host: torch.Tensor, staged: torch.Tensor) -> None:
        self.log.append(("d2h", staged.numel()))
        host.copy_(staged)

    def join_forward(self, keep: int = 0) -> None:
        self.log.append(("join forward", keep))

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.log.append(("h2d", host.numel()))
        return host.clone().to(device)

    def wait(self, buffer: torch.Tensor) -> None:
        self.log.append(("wait", buffer.numel()))

    def join_backward(self) -> None:
        self.log.append(("join backward", 0))
