"""The graph banks' router: one bank of graphs per power-of-two context-parallel size
(``GraphBank``; which sizes: ``banks.sizes``) and ``BankRouter``, which picks a microbatch's
bank at replay (the banks are captured and replayed by ``banks.capture``).

Under Megatron's hybrid context parallelism each microbatch chooses its CP size
(``PackedSeqParams.local_cp_size``, a power of two) and the process group of that size
(``parallel_state.get_hybrid_data_context_parallel_groups(group_size=k)``). A graph captured with
one group has that group's communicator baked in, so replay must use the bank of the same size and
the very group object that bank was captured with; anything else fails closed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from megatron_cg_plugin.console import group_label

__all__ = ["BankRouter", "BankSelectionError", "GraphBank"]


class BankSelectionError(RuntimeError):
    """A microbatch whose CP size or group matches no captured bank."""


@dataclasses.dataclass
class GraphBank:
    cp_size: int
    group: Any  # the process group captured with (None for CP size 1: no CP communication)
    payload: Any = None  # the bank's graphed callables, once captured
    replays: int = 0
    rejected: int = 0
    offload_groups_flushed: int = (
        0  # delayed offload groups (--delay-offload-until-cuda-graph) flushed after its replays
    )


class BankRouter:
    def __init__(self, banks: Mapping[int, GraphBank]) -> None:
        self.banks = dict(sorted(banks.items()))
        self.unknown_size_rejections = 0

    @classmethod
    def build(cls, sizes: tuple[int, ...], resolve_group: Callable[[int], Any]) -> BankRouter:
        """One bank per size, each holding the real group of that size (``resolve_group``)."""
        return cls({size: GraphBank(size, resolve_group(size)) for size in sizes})

    def select(self, local_cp_size: int | None, cp_group: Any) -> GraphBank:
        """The bank for this microbatch; ``BankSelectionError`` (fail closed) when none fits."""
        size = 1 if local_cp_size is None else int(local_cp_size)
        bank = self.banks.get(size)
        if bank is None:
            self.unknown_size_rejections += 1
            raise BankSelectionError(
                f"microbatch asks for CP size {size}, but banks were captured for CP sizes "
                f"{list(self.banks)}; lower --cg-bank-min-cp, or keep --max-seqlen-per-dp-cp-rank such "
                "that every microbatch fits a captured size."
            )
        if cp_group is not bank.group:
            bank.rejected += 1
            raise BankSelectionError(
                f"microbatch with CP size {size} brings process group {group_label(cp_group)}, but the "
                f"bank for CP size {size} was captured with {group_label(bank.group)}: graphs bake in "
                "their communicators, so only that very group may replay them."
            )
        bank.replays += 1
        return bank

    def report(self) -> list[dict[str, int]]:
        return [
            {
                "cp_size": bank.cp_size,
                "replays": bank.replays,
                "rejected": bank.rejected,
                "offload_groups_flushed": bank.offload_groups_flushed,
            }
            for bank in self.banks.values()
        ]
