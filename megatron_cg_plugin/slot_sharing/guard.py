"""Debug guard for slot-shared graph memory (``MEGATRON_CG_SLOT_DEBUG=1``).

Host-side bookkeeping only: a forward replay takes its frame's slot, the matching backward gives it
back. If a forward finds its slot still held by another live frame, two frames would share saved
state and one would silently corrupt the other; the guard refuses, naming both.
"""

from __future__ import annotations

__all__ = ["SlotGuard", "SlotReuseError"]


class SlotReuseError(RuntimeError):
    def __init__(self, slot: int, holder: str, claimant: str) -> None:
        self.slot, self.holder, self.claimant = slot, holder, claimant
        super().__init__(
            f"slot {slot} is still owned by {holder} (its backward has not run) but {claimant} is about to "
            "reuse it: their saved tensors would overwrite each other. The replay order differs from the "
            "one the slot plan was made for; plan with this order (megatron_cg_plugin.slot_sharing.plan)."
        )


class SlotGuard:
    def __init__(self, ring_size: int) -> None:
        self._owners: list[str | None] = [None] * ring_size

    def acquire(self, slot: int, frame: str) -> None:
        holder = self._owners[slot]
        if holder is not None:
            raise SlotReuseError(slot, holder, frame)
        self._owners[slot] = frame

    def release(self, slot: int, frame: str) -> None:
        holder = self._owners[slot]
        if holder != frame:
            raise SlotReuseError(slot, holder or "nobody", f"the backward of {frame}")
        self._owners[slot] = None

    @property
    def live(self) -> dict[int, str]:
        return {slot: owner for slot, owner in enumerate(self._owners) if owner is not None}
