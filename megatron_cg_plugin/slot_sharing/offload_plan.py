"""Which saves of a graphed frame go to pinned host memory (pure Python, no CUDA): the policy from
Megatron's own offload flags, the storage-level alias rule, the reload groups and the host arena
sizes.

Megatron's fine-grained offloading (``--fine-grained-activation-offloading --offload-modules ...``)
names groups of saves by module (``attn_norm``, ``core_attn``, ``expert_fc1`` ...). At warmup the
slot capture records, for every storage a frame saves, the group each of its saves was made in,
its size and whether a save was marked not to be offloaded; the plan made from that record is what
capture follows:
- a save qualifies as Megatron's would (``ChunkOffloadHandler``): its group is listed, the tensor
  has at least ``--min-offloaded-tensor-size`` elements, and it is not marked ``_do_not_offload``;
- **alias rule**: a storage goes to the host only if every save of it qualifies; if any view of it
  stays on the GPU, every view does (one copy each way, views rebuilt from it keep their aliases);
- groups are reloaded in backward order (the reverse of the forward's), up to a window of groups
  ahead of the one the backward unpacks (``--cg-offload-window``); a storage saved in several groups
  is reloaded with the last of them, the first the backward reaches;
- **which groups stay, as Megatron chooses across a model chunk** (PP = 1: every graphed layer,
  forward order; ``OffloadStack``): the last layer keeps its groups, whose reload the backward would
  need at once (``ChunkOffloadHandler.should_bulk_offload``), and ``--activation-offload-fraction``
  keeps the last ``int(N x (1 - fraction))`` of the chunk's N eligible groups
  (``post_warmup_callback``), so the latest layers stay on the GPU. Layers are captured one at a
  time, so N is counted as the layers times the frame's own groups, which holds where the layers
  offload the same groups; a fraction below 1 is refused where they do not. Where Megatron's choice
  is not followed exactly: one graph per layer serves every microbatch, so the plan is Megatron's
  choice for the chunks after the first (the first counts N without the last layer's groups, and a
  run of one microbatch has only that chunk); Megatron keeps the last group of each name, which in
  a stack whose last layer lacks a group (a dense last layer after MoE layers offloading
  ``expert_fc1``) is an earlier layer's, offloaded here; N counts only the groups inside the graphs
  (Megatron's own handler chooses among the groups outside them). A frame planned alone (no
  position) is a chunk of its own, without the last-layer rule;
- host arenas are keyed like the GPU saved-tensor arenas, one per slot, sized by the largest
  offloaded bytes of the variants the slot plan puts there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

from megatron_cg_plugin.slot_sharing.plan import arena_aligned, per_slot_max

__all__ = [
    "MEGATRON_MIN_OFFLOADED_TENSOR_SIZE",
    "MEGATRON_OFFLOAD_MODULES",
    "OffloadPlan",
    "OffloadPolicy",
    "OffloadStack",
    "OffloadStackError",
    "Save",
    "StackPosition",
    "groups_kept",
    "host_arena_bytes",
    "plan_offload",
]

# Megatron 0.19.2's offload groups (TransformerConfig's allowed offload_modules).
MEGATRON_OFFLOAD_MODULES = frozenset(
    {"core_attn", "attn_proj", "expert_fc1", "fused_group_mlp", "moe_act", "attn_norm", "mlp_norm", "qkv_linear"}
)
MEGATRON_MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024  # elements: Megatron's default


@dataclasses.dataclass(frozen=True)
class Save:
    """One save of a frame, as warmup saw it."""

    storage: Hashable  # the storage the saved tensor views (its device and address at warmup)
    storage_bytes: int
    numel: int  # elements of the saved view
    group: str | None  # Megatron's offload group the save was made in (None: outside every group)
    do_not_offload: bool = False  # the tensor was marked _do_not_offload / _TE_do_not_offload


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    modules: frozenset[str]
    min_tensor_elements: int = MEGATRON_MIN_OFFLOADED_TENSOR_SIZE
    fraction: float = 1.0  # --activation-offload-fraction

    @classmethod
    def from_flags(
        cls,
        offload_modules: Sequence[str],
        *,
        min_tensor_elements: int = MEGATRON_MIN_OFFLOADED_TENSOR_SIZE,
        fraction: float = 1.0,
    ) -> OffloadPolicy:
        unknown = sorted(set(offload_modules) - MEGATRON_OFFLOAD_MODULES)
        if unknown:
            raise ValueError(
                f"--offload-modules {' '.join(unknown)}: Megatron offloads only "
                f"{', '.join(sorted(MEGATRON_OFFLOAD_MODULES))}."
            )
        if min_tensor_elements < 0 or not 0.0 <= fraction <= 1.0:
            raise ValueError("--min-offloaded-tensor-size must be >= 0 and --activation-offload-fraction in [0, 1].")
        return cls(frozenset(offload_modules), min_tensor_elements, fraction)

    @classmethod
    def from_config(cls, config) -> OffloadPolicy | None:
        """The policy of a model's ``TransformerConfig``, where Megatron's flags
        (``--fine-grained-activation-offloading --offload-modules ... --min-offloaded-tensor-size N
        --activation-offload-fraction F``) land, or None when it offloads nothing. Attributes only:
        megatron-core 0.19.2's names."""
        modules = tuple(getattr(config, "offload_modules", None) or ())
        if not getattr(config, "fine_grained_activation_offloading", False) or not modules:
            return None
        return cls.from_flags(
            modules,
            min_tensor_elements=getattr(config, "min_offloaded_tensor_size", MEGATRON_MIN_OFFLOADED_TENSOR_SIZE),
            fraction=getattr(config, "activation_offload_fraction", 1.0),
        )

    def qualifies(self, save: Save) -> bool:
        return save.group in self.modules and save.numel >= self.min_tensor_elements and not save.do_not_offload


class OffloadStackError(ValueError):
    """Layers of one stack offload different groups under an --activation-offload-fraction below 1."""


@dataclasses.dataclass(frozen=True)
class StackPosition:
    """A frame's layer in Megatron's model chunk: its index in forward order and the chunk's layers."""

    index: int
    num_layers: int

    def __post_init__(self) -> None:
        assert 0 <= self.index < self.num_layers, self


def groups_kept(groups: int, position: StackPosition | None, fraction: float) -> int:
    """How many of a frame's ``groups`` eligible offload groups, counted from its last, stay on the
    GPU (module docstring)."""
    if position is None:
        return int(groups * (1 - fraction))
    if position.index == position.num_layers - 1:
        return groups
    total = position.num_layers * groups
    first_kept = total - int(total * (1 - fraction))  # Megatron's expression for the groups it disables
    return max(0, min(groups, (position.index + 1) * groups - first_kept))


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    groups: tuple[tuple[str, tuple[Hashable, ...]], ...]  # (group, its storages), in forward order
    kept: tuple[Hashable, ...]  # storages that stay in the GPU arena
    storage_bytes: Mapping[Hashable, int]

    @property
    def offloaded(self) -> frozenset[Hashable]:
        return frozenset(storage for _, storages in self.groups for storage in storages)

    @property
    def host_bytes(self) -> int:
        """The frame's bytes in its host arena (each storage aligned as in the GPU arena)."""
        return sum(arena_aligned(self.storage_bytes[s]) for s in self.offloaded)

    @property
    def device_bytes(self) -> int:
        return sum(arena_aligned(self.storage_bytes[s]) for s in self.kept)

    def reload_order(self) -> tuple[str, ...]:
        """Groups in the order the backward needs them: the reverse of the forward's."""
        return tuple(group for group, _ in reversed(self.groups))

    def reload_window(self, group: str | None, window: int) -> tuple[str, ...]:
        """The groups that should be reloading once the backward unpacks ``group`` (None: at the
        start of the backward, before it needs any): that group, or the first, and the ``window``
        groups the backward needs after it."""
        order = self.reload_order()
        start = 0 if group is None else order.index(group)
        return order[start : start + window + 1]


def plan_offload(saves: Sequence[Save], policy: OffloadPolicy, position: StackPosition | None = None) -> OffloadPlan:
    """The frame's plan from its warmup record, its layer at ``position`` (module docstring)."""
    ordered, kept, storage_bytes = _eligible_groups(saves, policy)
    kept_groups = groups_kept(len(ordered), position, policy.fraction)
    if kept_groups:
        kept += [storage for _, storages in ordered[-kept_groups:] for storage in storages]
        ordered = ordered[:-kept_groups]
    return OffloadPlan(tuple((group, tuple(storages)) for group, storages in ordered), tuple(kept), storage_bytes)


def _eligible_groups(
    saves: Sequence[Save], policy: OffloadPolicy
) -> tuple[list[tuple[str, list[Hashable]]], list[Hashable], dict[Hashable, int]]:
    """The groups whose storages qualify, in forward order, with their storages; the storages that
    stay whatever the fraction (a view outside the policy); every storage's bytes."""
    by_storage: dict[Hashable, list[Save]] = {}
    for save in saves:
        by_storage.setdefault(save.storage, []).append(save)
    reload_group: dict[Hashable, str] = {}
    kept = []
    for storage, views in by_storage.items():
        group = views[-1].group  # None never qualifies: the policy's modules are named groups
        if group is not None and all(policy.qualifies(view) for view in views):
            reload_group[storage] = group
        else:
            kept.append(storage)
    groups: dict[str, list[Hashable]] = {}
    for storage, group in reload_group.items():
        groups.setdefault(group, []).append(storage)
    first_seen: dict[str | None, int] = {}
    for index, save in enumerate(saves):
        first_seen.setdefault(save.group, index)
    ordered = sorted(groups.items(), key=lambda item: first_seen[item[0]])  # the groups in forward order
    return ordered, kept, {storage: views[0].storage_bytes for storage, views in by_storage.items()}


class OffloadStack:
    """The plans of one stack's frames, planned layer by layer in forward order (``plan``), each
    counting the chunk's groups as the layers times its own; under a fraction below 1 every layer's
    frame of a variant must have the groups of that variant's first frame (module docstring)."""

    def __init__(self, policy: OffloadPolicy, num_layers: int) -> None:
        self.policy, self.num_layers = policy, num_layers
        self._reference: dict[Hashable, tuple[int, tuple[str, ...]]] = {}  # variant -> (layer, its groups)

    def plan(self, saves: Sequence[Save], index: int, variant: Hashable = None) -> OffloadPlan:
        eligible = tuple(group for group, _ in _eligible_groups(saves, self.policy)[0])
        layer, groups = self._reference.setdefault(variant, (index, eligible))
        if self.policy.fraction < 1 and eligible != groups:
            raise OffloadStackError(
                f"--activation-offload-fraction {self.policy.fraction}: layer {index + 1} offloads the groups "
                f"{list(eligible)} and layer {layer + 1} {list(groups)}; slot-shared capture keeps Megatron's "
                "fraction only where every layer offloads the same groups: use --activation-offload-fraction 1.0, "
                "or offload modules that every layer has."
            )
        return plan_offload(saves, self.policy, StackPosition(index, self.num_layers))


def host_arena_bytes(
    ring_size: int, slots_of: Mapping[Hashable, Sequence[int]], plans: Mapping[Hashable, OffloadPlan]
) -> list[int]:
    """Per slot, the host arena: the largest offloaded bytes of the variants the plan puts there."""
    return per_slot_max(ring_size, slots_of, {variant: plan.host_bytes for variant, plan in plans.items()})
