"""The one way the plugin sets and restores an attribute, a flag or a function of Megatron, TE or
torch: install-time patches, attributes lent until ``uninstall()``, state set for a ``with`` block,
capture transactions and the bench all go through it. It imports nothing of the plugin, so any
layer may use it; what may be changed, and why, is listed in the ledger (``patching.ledger``).

One rule for every change: what is saved is what ``owner`` itself stores under the name (its own
``__dict__`` entry, as stored: a ``staticmethod`` stays one), or, for a data descriptor of its type
(a property with a setter, a slot), the value it gives. An attribute ``owner`` did not store itself
(absent, or only inherited from its class or a base) is saved as ``ABSENT`` and restored by
deleting it, so the inherited one is in force again and nothing is left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["ABSENT", "Changes", "Saved", "held", "put", "save", "setting", "stored"]


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()  # what ``stored`` gives for an attribute the owner does not hold itself


def _through_type(owner: Any, name: str) -> bool:
    """Whether ``owner.name = value`` goes to a data descriptor of its type (a property with a
    setter, a slot) rather than into ``owner.__dict__``."""
    for klass in type(owner).__mro__:  # the first class that has it decides, as attribute lookup does
        if name in vars(klass):
            return hasattr(type(vars(klass)[name]), "__set__")
    return False


def stored(owner: Any, name: str) -> Any:
    """What ``owner`` itself holds under ``name``, or ``ABSENT``."""
    if _through_type(owner, name) or not hasattr(owner, "__dict__"):
        return getattr(owner, name, ABSENT)
    return vars(owner).get(name, ABSENT)


def put(owner: Any, name: str, value: Any) -> None:
    """Makes ``owner`` hold ``value`` under ``name`` (what ``stored`` gave); ``ABSENT`` deletes what
    ``owner`` holds itself. An attribute that already holds the very object is not set again."""
    now = stored(owner, name)
    if value is ABSENT:
        if now is not ABSENT:
            delattr(owner, name)
    elif now is not value:
        setattr(owner, name, value)


@dataclasses.dataclass(frozen=True)
class Saved:
    """``owner.name`` as it was when saved; ``restore()`` puts exactly that back. ``change`` names
    the ledger's entry that lists the change."""

    owner: Any
    name: str
    value: Any
    change: str = ""

    def restore(self) -> None:
        put(self.owner, self.name, self.value)


def save(owner: Any, name: str, *, change: str = "") -> Saved:
    return Saved(owner, name, stored(owner, name), change)


class Changes:
    """Attributes changed through it, each saved before its first change and restored newest first
    by ``restore()`` (or on leaving a ``with`` block). Setting one attribute again keeps what was
    saved first: restoring gives back the state from before the first change."""

    def __init__(self) -> None:
        self._saved: list[Saved] = []

    def __bool__(self) -> bool:
        return bool(self._saved)

    def __len__(self) -> int:
        return len(self._saved)

    def holds(self, owner: Any, name: str) -> bool:
        return any(item.owner is owner and item.name == name for item in self._saved)

    def hold(self, owner: Any, name: str, *, change: str) -> None:
        """Saves ``owner.name`` without changing it (unless already saved): whatever code sets it
        later, ``restore()`` puts back what it is now. ``change`` names the ledger's entry."""
        if not self.holds(owner, name):
            self._saved.append(save(owner, name, change=change))

    def set(self, owner: Any, name: str, value: Any, *, change: str) -> None:
        """Sets ``owner.name`` to ``value``, saving it first (unless already saved)."""
        self.hold(owner, name, change=change)
        put(owner, name, value)

    def restore(self) -> None:
        """Restores every saved attribute, newest first, and forgets them. Keeps going past a
        failing one, so one broken attribute cannot leave the rest changed; the first error is
        raised at the end."""
        first_error: BaseException | None = None
        while self._saved:
            item = self._saved.pop()
            try:
                item.restore()
            except Exception as error:  # noqa: BLE001 - restore the rest, then raise
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Changes:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.restore()


class setting:  # named and called as a function, like contextlib's context managers
    """``owner.name`` is ``value`` inside the ``with`` block and as before after it, whatever
    happens. ``change`` names the ledger's entry that lists it. A class, not a generator: it runs
    around every bank replay, where a generator's frame and a ``Changes`` cost several times more."""

    __slots__ = ("_owner", "_name", "_value", "_saved")

    def __init__(self, owner: Any, name: str, value: Any, *, change: str) -> None:
        self._owner, self._name, self._value = owner, name, value
        self._saved = Saved(owner, name, ABSENT, change)

    def __enter__(self) -> None:
        saved = save(self._owner, self._name, change=self._saved.change)
        put(self._owner, self._name, self._value)  # raising, it changed nothing: no exit to run
        self._saved = saved

    def __exit__(self, *_exc: Any) -> None:
        self._saved.restore()


@contextlib.contextmanager
def held(owner: Any, name: str, *, change: str) -> Iterator[None]:
    """``owner.name`` is back after the ``with`` block, whatever code in it set it to (a flag a
    foreign function sets, say). ``change`` names the ledger's entry that lists it."""
    with Changes() as changes:
        changes.hold(owner, name, change=change)
        yield
