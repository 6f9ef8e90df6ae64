"""Tests for megatron_cg_plugin.foreign_state: the one primitive that sets and restores an
attribute of Megatron, TE or torch (one rule for an absent attribute: restored by deletion)."""

from __future__ import annotations

import types

import pytest

from megatron_cg_plugin import foreign_state
from megatron_cg_plugin.foreign_state import ABSENT, Changes, held, put, setting, stored


class Base:
    inherited = "base"

    def method(self):
        return "base"


class Child(Base):
    pass


class Slotted:
    __slots__ = ("x",)


class WithProperty:
    def __init__(self):
        self._flag = True

    @property
    def flag(self):
        return self._flag

    @flag.setter
    def flag(self, value):
        self._flag = value


def test_stored_is_what_the_owner_holds_itself():
    module = types.ModuleType("fake")
    module.F = 1
    assert stored(module, "F") == 1 and stored(module, "G") is ABSENT
    assert stored(Child, "method") is ABSENT and stored(Base, "method") is vars(Base)["method"]
    holder = type("Holder", (), {"helper": staticmethod(len)})
    assert isinstance(stored(holder, "helper"), staticmethod)  # as stored, not as looked up
    assert stored(WithProperty(), "flag") is True  # a property: its value
    assert stored(Slotted(), "x") is ABSENT  # an empty slot


def test_an_absent_attribute_is_restored_by_deleting_it():
    module, child, instance = types.ModuleType("fake"), Child, Child()
    with (
        setting(module, "F", 1, change="test"),
        setting(child, "method", lambda self: "lent", change="test"),
        setting(instance, "inherited", "shadow", change="test"),
    ):
        assert module.F == 1 and Child().method() == "lent" and instance.inherited == "shadow"
    assert not hasattr(module, "F")
    assert "method" not in vars(Child) and Child().method() == "base"  # the base's again, no copy of it
    assert "inherited" not in vars(instance) and instance.inherited == "base"
    slotted = Slotted()
    with setting(slotted, "x", 1, change="test"):
        assert slotted.x == 1
    assert not hasattr(slotted, "x")


def test_a_held_value_is_restored_by_identity_whatever_happens():
    value, module = object(), types.ModuleType("fake")
    module.F = value
    with pytest.raises(KeyError), setting(module, "F", object(), change="test"):
        raise KeyError("restored on an error too")
    assert module.F is value
    with held(module, "F", change="test"):
        module.F = "set by a foreign function"
        del module.F
    assert module.F is value
    holder = type("Holder", (), {"helper": staticmethod(len)})
    with setting(holder, "helper", abs, change="test"):
        assert holder.helper is abs
    assert isinstance(vars(holder)["helper"], staticmethod) and holder.helper is len
    layer = WithProperty()
    with setting(layer, "flag", False, change="test"):
        assert layer.flag is False
    assert layer.flag is True and "flag" not in vars(layer)


def test_nested_settings_each_restore_their_own_before():
    module = types.ModuleType("fake")
    module.F = "outer before"
    with setting(module, "F", "outer", change="test"):
        with setting(module, "F", "inner", change="test"):
            assert module.F == "inner"
        assert module.F == "outer"
        with setting(module, "G", "inner only", change="test"):
            pass
        assert not hasattr(module, "G")
    assert module.F == "outer before"


def test_changes_keep_the_first_saved_value_and_restore_newest_first():
    module, order = types.ModuleType("fake"), []
    module.F = "original"
    with Changes() as changes:
        changes.set(module, "F", "first", change="test")
        changes.set(module, "F", "second", change="test")  # set twice: the value before the first is kept
        changes.set(module, "G", "new", change="test")
        assert len(changes) == 2 and changes.holds(module, "F") and not changes.holds(module, "H")

        class Recorder(types.ModuleType):
            def __setattr__(self, name, value):
                order.append(name)
                super().__setattr__(name, value)

            def __delattr__(self, name):
                order.append(f"del {name}")
                super().__delattr__(name)

        module.__class__ = Recorder
    assert order == ["del G", "F"]  # newest first
    assert module.F == "original" and not hasattr(module, "G")
    assert not changes  # forgotten once restored: restoring again does nothing
    changes.restore()
    assert module.F == "original"


def test_a_failing_restore_does_not_stop_the_others():
    class Stubborn:
        def __setattr__(self, name, value):
            if name == "locked" and "locked" in vars(self):
                raise RuntimeError("cannot restore")
            object.__setattr__(self, name, value)

    stubborn, module = Stubborn(), types.ModuleType("fake")
    module.F = "original"
    changes = Changes()
    changes.set(module, "F", "changed", change="test")
    object.__setattr__(stubborn, "locked", "original")
    changes.hold(stubborn, "locked", change="test")
    object.__setattr__(stubborn, "locked", "changed")
    with pytest.raises(RuntimeError, match="cannot restore"):
        changes.restore()
    assert module.F == "original" and not changes


def test_put_does_not_reassign_the_very_object():
    sets = []

    class Loud:
        def __setattr__(self, name, value):
            sets.append(name)
            object.__setattr__(self, name, value)

    loud = Loud()
    value = object()
    put(loud, "x", value)
    put(loud, "x", value)
    put(loud, "y", ABSENT)  # absent stays absent: nothing to delete
    assert sets == ["x"] and not hasattr(loud, "y")


def test_the_primitive_is_exported():
    assert set(foreign_state.__all__) == {"ABSENT", "Changes", "Saved", "held", "put", "save", "setting", "stored"}
