"""Megatron's fine-grained offload groups as names, while slot-shared capture does the offloading.

Megatron 0.19.2's layers mark each offload group with ``FineGrainedActivationOffloadingInterface``
(``with off_interface(flag, tensor, "core_attn") as tensor: ...`` then ``group_offload(out)``);
entering it installs Megatron's own saved-tensor hooks, which would take the saves away from the
slot arenas' hook (the innermost hooks win). Inside ``OffloadGroupTracker.scoped()`` the interface
only names the group: ``__enter__`` pushes the name (when the module is one the user offloads) and
returns the tensor, ``__exit__`` pops it, and ``group_offload`` returns its tensor unchanged (the
plugin's hook copies the group's saves itself). ``current`` is the group running now, which the
warmup records beside every save (``slot_sharing.saved_tensors.ArenaSizer``).

``MegatronOffload`` is what slot-shared capture of Megatron's layers (``--cg-slot-capture``, graph
banks) takes from Megatron's offload flags: the policy, the tracker, the stack the layers form
(``slot_sharing.offload_plan.OffloadStack``: which groups Megatron would offload at each layer), and the capture
scope, in which the layers' ``offload_module_in_cuda_graph`` is off too, so their capture callable
does not join Megatron's offload streams (the plugin's copies bring their own).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from megatron_cg_plugin import foreign_state
from megatron_cg_plugin.config import OFFLOAD_COPIES
from megatron_cg_plugin.slot_sharing.capture import SlotOffload
from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy, OffloadStack
from megatron_cg_plugin.slot_sharing.offload_staging import StagingRing

__all__ = ["MegatronOffload", "OffloadCopies", "OffloadGroupTracker", "delayed_offload_groups", "still_queued"]


@dataclasses.dataclass(frozen=True)
class OffloadCopies:
    """How slot-shared capture copies the offloaded saves (``--cg-offload-copies``,
    ``--cg-offload-window``): ``in-graph``, inside each layer's graphs, ``window`` offload groups
    ahead of the one being staged or unpacked; or ``between-replays``, through a ring of
    ``window + 1`` staging buffers shared by the layers, so a layer's copies may run ``window``
    layers behind (or ahead of) the compute."""

    mode: str = "in-graph"
    window: int = 1

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_COPIES:
            raise ValueError(
                f"offload copies {self.mode!r}: use one of {', '.join(OFFLOAD_COPIES)} (--cg-offload-copies)."
            )
        if self.window < 0:
            raise ValueError(f"offload window {self.window}: use 0 or more groups (--cg-offload-window).")

    @classmethod
    def given(cls, copies: OffloadCopies | str) -> OffloadCopies:
        """``copies`` as given to a capture call: the settings, or a mode name with the default window."""
        return cls(copies) if isinstance(copies, str) else copies

    @classmethod
    def of(cls, config: Any) -> OffloadCopies:
        """From the plugin's config (``config.PluginConfig``)."""
        return cls(config.offload_copies, config.offload_window)

    def staging_ring(self) -> StagingRing | None:
        """The ring every layer of one capture shares (between replays), None for in-graph copies."""
        import torch

        return (
            StagingRing(torch.cuda.current_device(), depth=self.window + 1) if self.mode == "between-replays" else None
        )


class OffloadGroupTracker:
    def __init__(self) -> None:
        self._names: list[str] = []

    def current(self) -> str | None:
        return self._names[-1] if self._names else None

    @contextlib.contextmanager
    def scoped(self) -> Iterator[OffloadGroupTracker]:
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as offload

        interface = offload.FineGrainedActivationOffloadingInterface
        names = self._names

        def enter(manager: Any) -> Any:
            if manager.offload:
                names.append(manager.name)
            return manager.tensor

        def exit_(manager: Any, *_exc: Any) -> None:
            if manager.offload:
                names.pop()

        def group_offload(
            manager: Any, tensor: Any, forced_released_tensors: Any = None, delay_offload: bool = False
        ) -> Any:
            return tensor

        with foreign_state.Changes() as changes:
            changes.set(interface, "__enter__", enter, change="offload-group-names")
            changes.set(interface, "__exit__", exit_, change="offload-group-names")
            changes.set(interface, "group_offload", group_offload, change="offload-group-names")
            yield self


class MegatronOffload:
    """Megatron's offload flags for slot-shared capture of a set of layers: the capture scope
    (``capturing``: Megatron's offload hooks kept out, its groups named) and, when the saves are
    to be offloaded inside the graphs, the policy. Megatron's hooks must stay out of slot-shared
    capture either way: saves they took would bypass the arenas."""

    def __init__(self, policy: OffloadPolicy | None, layers: Sequence[Any]) -> None:
        self.policy = policy  # None: every save stays in the GPU arenas
        self.layers = list(layers)
        self.tracker = OffloadGroupTracker()
        self.stack = None if policy is None else OffloadStack(policy, len(self.layers))  # Megatron's choice across them

    @classmethod
    def from_config(cls, config: Any, layers: Sequence[Any], *, offload: bool = True) -> MegatronOffload | None:
        """From Megatron's TransformerConfig (its offload fields); None without
        ``--fine-grained-activation-offloading``. Its policy is None (every save stays in the GPU
        arenas, Megatron's hooks still kept out) with ``offload=False`` or no ``--offload-modules``."""
        if not getattr(config, "fine_grained_activation_offloading", False):
            return None
        return cls(OffloadPolicy.from_config(config) if offload else None, layers)

    def slot_offload(self, layer: Any, staging: StagingRing | None = None, window: int = 1) -> SlotOffload | None:
        """The offload of ``layer``'s capture (one of ``layers``, captured in their order): copies
        between replays through ``staging`` (shared by every layer's capture), or inside the graphs
        without it, ``window`` groups ahead."""
        if self.policy is None:
            return None
        index = next((i for i, known in enumerate(self.layers) if known is layer), None)
        assert index is not None, "slot_offload is asked for the layers MegatronOffload was made with"
        return SlotOffload(
            self.policy, group=self.tracker.current, staging=staging, window=window, stack=self.stack, layer_index=index
        )

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Warmup and capture: Megatron's interface names groups; its in-graph offload streams stay out."""
        with self.tracker.scoped(), foreign_state.Changes() as changes:
            for layer in self.layers:
                if getattr(layer, "offload_module_in_cuda_graph", False):
                    changes.set(layer, "offload_module_in_cuda_graph", False, change="offload-in-graph-flag")
            yield


def delayed_offload_groups(config: Any) -> list[Any]:
    """The offload groups Megatron delayed until a graph replay (``--delay-offload-until-cuda-graph``;
    its replay path runs them right after the graph), as a copy of its queue; empty without the flag."""
    if not getattr(config, "delay_offload_until_cuda_graph", False):
        return []
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    return list(getattr(PipelineOffloadManager.get_instance(), "_delayed_offload_groups", ()))


def still_queued(waiting: Sequence[Any], now: Sequence[Any]) -> list[Any]:
    """The groups of ``waiting`` that are still in the queue ``now`` (by identity)."""
    return [group for group in waiting if any(group is queued for queued in now)]
