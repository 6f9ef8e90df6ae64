"""Megatron's fine-grained offload groups as names, while slot-shared capture does the offloading.

Megatron 0.19.2's layers mark each offload group with ``FineGrainedActivationOffloadingInterface``
(``with off_interface(flag, tensor, "core_attn") as tensor: ...`` then ``group_offload(out)``);
entering it installs Megatron's own saved-tensor hooks, which would take the saves away from the
slot arenas' hook (the innermost hooks win). Inside ``OffloadGroupTracker.scoped()`` the interface
only names the group: ``__enter__`` pushes the name (when the module is one the user offloads) and
returns the tensor, ``__exit__`` pops it, and ``group_offload`` returns its tensor unchanged (the
plugin's hook copies the group's saves itself). ``current`` is the group running now, which the
warmup records beside every save (``memory.saved_tensors.ArenaSizer``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from megatron_cg_plugin import patches


class OffloadGroupTracker:
    def __init__(self) -> None:
        self._names: list[str] = []

    def current(self) -> str | None:
        return self._names[-1] if self._names else None

    @contextlib.contextmanager
    def scoped(self) -> Iterator["OffloadGroupTracker"]:
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

        def group_offload(manager: Any, tensor: Any, forced_released_tensors: Any = None,
                          delay_offload: bool = False) -> Any:
            return tensor

        with patches.scoped(interface, "__enter__", enter, "offload-group-names"), \
                patches.scoped(interface, "__exit__", exit_, "offload-group-names"), \
                patches.scoped(interface, "group_offload", group_offload, "offload-group-names"):
            yield self
