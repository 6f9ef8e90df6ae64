"""FP8 in slot-shared capture, the parts that need no GPU (capture/backend.py): which recipes it
refuses and why, and TE's weight-update flag put back whatever happens. The capture itself:
tests/functional/test_slot_memory.py (the probe's fp8 part)."""

from __future__ import annotations

import sys
import types

import pytest

from megatron_cg_plugin.capture import backend


class FakeRecipe:
    """TE's Recipe as far as slot capture asks it: which scaling, and FP8 attention."""

    def __init__(self, kind: str, fp8_dpa: bool = False, fp8_mha: bool = False) -> None:
        self.kind, self.fp8_dpa, self.fp8_mha = kind, fp8_dpa, fp8_mha

    def delayed(self) -> bool:
        return self.kind == "delayed"

    def float8_current_scaling(self) -> bool:
        return self.kind == "current"


@pytest.mark.parametrize("recipe, words", [
    (None, "needs the recipe"),
    (FakeRecipe("delayed"), "amax histories"),
    (FakeRecipe("mxfp8"), "FakeRecipe is not verified"),
    (FakeRecipe("current", fp8_dpa=True), "--fp8-dot-product-attention"),
    (FakeRecipe("current", fp8_mha=True), "--fp8-multi-head-attention"),
])
def test_recipes_other_than_plain_current_scaling_are_refused_with_the_reason(recipe, words):
    refusal = backend.slot_fp8_refusal(recipe)
    assert refusal is not None and words in refusal


def test_current_scaling_is_taken():
    assert backend.slot_fp8_refusal(FakeRecipe("current")) is None


@pytest.fixture
def fake_te(monkeypatch):
    """transformer_engine.pytorch.quantization with TE's global quantization state."""
    state = types.SimpleNamespace(skip_fp8_weight_update_tensor="flag made by make_graphed_callables")
    manager = types.SimpleNamespace(quantization_state=state)
    module = types.ModuleType("transformer_engine.pytorch.quantization")
    module.FP8GlobalStateManager = manager
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization", module)
    return manager


def test_the_weight_update_flag_is_off_inside_and_back_after(fake_te):
    with backend.fp8_weight_cache_off():
        assert fake_te.quantization_state.skip_fp8_weight_update_tensor is None
    assert fake_te.quantization_state.skip_fp8_weight_update_tensor == "flag made by make_graphed_callables"


def test_the_weight_update_flag_is_back_after_an_error_and_after_a_reset_inside(fake_te):
    with pytest.raises(RuntimeError), backend.fp8_weight_cache_off():
        raise RuntimeError("capture failed")
    assert fake_te.quantization_state.skip_fp8_weight_update_tensor == "flag made by make_graphed_callables"
    with backend.fp8_weight_cache_off():
        fake_te.quantization_state = types.SimpleNamespace(skip_fp8_weight_update_tensor=None)  # FP8GlobalStateManager.reset()
    assert fake_te.quantization_state.skip_fp8_weight_update_tensor == "flag made by make_graphed_callables"
