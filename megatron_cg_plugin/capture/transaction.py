"""Capture as one transaction: either every graph is installed, or the process is left as if
capture had never started.

TE 2.20.2's ``make_graphed_callables`` restores nothing when it fails part-way (GC stays disabled,
its capture flag stays set, module classes keep its patched ``__call__``, RNG and FP8 state are not
put back). The transaction snapshots each such piece of state as a ``Restorable`` before capture,
collects every graph object created while it is open, and on any error resets those graphs (newest
first) and restores every snapshot (in reverse order) before the error propagates.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from megatron_cg_plugin import foreign_state

__all__ = [
    "CaptureTransaction",
    "Restorable",
    "attribute",
    "gc_freeze",
    "gc_state",
    "megatron_capture_state",
    "rng_state",
    "tensor_grads",
]


@dataclasses.dataclass(frozen=True)
class Restorable:
    """One piece of process state: ``save()`` returns a snapshot, ``restore(snapshot)`` puts it back."""

    name: str
    save: Callable[[], Any]
    restore: Callable[[Any], None]


def attribute(owner: Any, name: str, *, label: str | None = None) -> Restorable:
    """``owner.name`` as ``owner`` itself holds it, saved and put back by ``foreign_state``
    (absent stays absent: inherited attributes such as a class's ``__call__`` from ``nn.Module``
    are deleted again, not frozen as a copy)."""

    def restore(value: Any) -> None:
        foreign_state.put(owner, name, value)

    return Restorable(
        label or f"{getattr(owner, '__name__', type(owner).__name__)}.{name}",
        lambda: foreign_state.stored(owner, name),
        restore,
    )


def gc_state() -> Restorable:
    def restore(enabled: bool) -> None:
        (gc.enable if enabled else gc.disable)()

    return Restorable("gc.isenabled", gc.isenabled, restore)


def gc_freeze() -> Restorable:
    """Megatron freezes GC for capture (``gc.freeze()``); undo a freeze that capture added."""

    def restore(count: int) -> None:
        if count == 0 and gc.get_freeze_count() > 0:
            gc.unfreeze()

    return Restorable("gc.freeze", gc.get_freeze_count, restore)


def tensor_grads(params: Iterable[Any]) -> Restorable:
    """``.grad`` and Megatron's ``.main_grad`` of each parameter, by reference."""
    params = list(params)

    def save() -> list[tuple[Any, Any]]:
        return [(foreign_state.stored(p, "grad"), foreign_state.stored(p, "main_grad")) for p in params]

    def restore(saved: list[tuple[Any, Any]]) -> None:
        for p, (grad, main_grad) in zip(params, saved):
            foreign_state.put(p, "grad", grad)
            foreign_state.put(p, "main_grad", main_grad)  # added during capture: absent stays absent

    return Restorable(f"grad/main_grad of {len(params)} parameters", save, restore)


class CaptureTransaction:
    """Context manager around one capture.

    Graph objects created inside are reported with ``track(graph)``; each needs a ``reset()``.
    ``rolled_back`` tells, after exit, whether the capture failed and was undone.
    """

    def __init__(self, restorables: Sequence[Restorable]) -> None:
        self._restorables = tuple(restorables)
        self._snapshots: list[tuple[Restorable, Any]] = []
        self.graphs: list[Any] = []
        self.rolled_back = False
        self.rollback_errors: list[str] = []

    def track(self, graph: Any) -> None:
        self.graphs.append(graph)

    def __enter__(self) -> CaptureTransaction:
        self._snapshots = [(item, item.save()) for item in self._restorables]
        return self

    def add(self, restorables: Iterable[Restorable]) -> None:
        """Snapshots more state now (state that can only be named once capture has started)."""
        self._snapshots += [(item, item.save()) for item in restorables]

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc_type is not None:
            self.rollback()
        return False  # never swallow the error: the caller decides (raise or continue eagerly)

    def rollback(self) -> None:
        """Resets tracked graphs newest first, then restores every snapshot in reverse order.
        Keeps going past individual failures so one broken piece cannot leave the rest undone."""
        self.rolled_back = True
        for graph in reversed(self.graphs):
            try:
                graph.reset()
            except Exception as error:  # noqa: BLE001 - report, and keep restoring the rest
                self.rollback_errors.append(f"reset of {graph!r}: {error}")
        self.graphs.clear()
        for item, snapshot in reversed(self._snapshots):
            try:
                item.restore(snapshot)
            except Exception as error:  # noqa: BLE001
                self.rollback_errors.append(f"restore of {item.name}: {error}")


def megatron_capture_state() -> list[Restorable]:
    """What Megatron's own capture sets and, when it fails, leaves set: its capture flag, and Python's
    garbage collector (disabled, objects frozen)."""
    from megatron.core.transformer import cuda_graphs

    return [attribute(cuda_graphs, "_IS_GRAPH_CAPTURING", label="Megatron capture flag"), gc_state(), gc_freeze()]


def rng_state() -> Restorable:
    """Torch's CPU and CUDA generators and Megatron's RNG tracker (graph-safe generators are
    snapshotted by state, older trackers by their state tensors)."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def save() -> Any:
        cuda = (
            torch.cuda.default_generators[torch.cuda.current_device()].get_state()
            if torch.cuda.is_available()
            else None
        )
        tracker = get_cuda_rng_tracker().get_states()
        return (
            torch.get_rng_state(),
            cuda,
            {
                name: (value, value.get_state() if isinstance(value, torch.Generator) else None)
                for name, value in tracker.items()
            },
        )

    def restore(saved: Any) -> None:
        cpu, cuda, tracker = saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.default_generators[torch.cuda.current_device()].set_state(cuda)
        for value, state in tracker.values():
            if state is not None:
                value.set_state(state)
        get_cuda_rng_tracker().set_states({name: value for name, (value, _) in tracker.items()})

    return Restorable("RNG state (torch CPU/CUDA, Megatron tracker)", save, restore)
