"""FP8 in slot-shared capture, the parts that need no GPU (slot_sharing/fp8_state.py): which recipes it
refuses and why; TE's FP8 state around a capture (the weight-update flag made before warmup and put
back after a failure, delayed scaling's meta saved and restored, the modules forwards reach); and
what a replay does around its graphs (the flag filled, the visited modules joined to the amax
reduction, the backward update after the autocast's first FP8 graph). TE is faked. The capture
itself: tests/functional/test_slot_memory.py (the probe's fp8 part)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_cg_plugin.slot_sharing import fp8_state


class FakeRecipe:
    """TE's Recipe as far as slot capture asks it: which scaling, and FP8 attention."""

    def __init__(self, kind: str, fp8_dpa: bool = False, fp8_mha: bool = False) -> None:
        self.kind, self.fp8_dpa, self.fp8_mha = kind, fp8_dpa, fp8_mha

    def delayed(self) -> bool:
        return self.kind == "delayed"

    def float8_current_scaling(self) -> bool:
        return self.kind == "current"


MODULES = (object(),)
REPLAY_RECIPE = FakeRecipe("delayed")  # the caller's autocast at replay


@pytest.mark.parametrize(
    "recipe, modules, words",
    [
        (None, MODULES, "needs the recipe"),
        (FakeRecipe("delayed"), (), "needs the TE modules"),
        (FakeRecipe("mxfp8"), MODULES, "FakeRecipe is not verified"),
        (FakeRecipe("current", fp8_dpa=True), MODULES, "with delayed scaling only"),
        (FakeRecipe("current", fp8_mha=True), MODULES, "with delayed scaling only"),
    ],
)
def test_recipes_slot_capture_cannot_serve_are_refused_with_the_reason(recipe, modules, words):
    refusal = fp8_state.slot_fp8_refusal(recipe, modules)
    assert refusal is not None and words in refusal


@pytest.mark.parametrize(
    "recipe, modules",
    [
        (FakeRecipe("current"), ()),
        (FakeRecipe("current"), MODULES),
        (FakeRecipe("delayed"), MODULES),
        (FakeRecipe("delayed", fp8_dpa=True), MODULES),
    ],
)
def test_current_and_delayed_scaling_are_taken_and_fp8_attention_with_delayed(recipe, modules):
    assert fp8_state.slot_fp8_refusal(recipe, modules) is None


def test_layers_with_te_ops_fused_operations_are_refused_naming_the_flag(fake_te):
    import transformer_engine.pytorch.ops.op as ops

    fused = torch.nn.Sequential(FakeTEModule(), torch.nn.Sequential(ops.BasicOperation()))
    for recipe in (FakeRecipe("current"), FakeRecipe("delayed")):
        refusal = fp8_state.slot_fp8_refusal(recipe, (fused,))
        assert refusal is not None and "--use-transformer-engine-op-fuser" in refusal
        assert fp8_state.slot_fp8_refusal(recipe, (torch.nn.Sequential(FakeTEModule()),)) is None


class FakeTEModule(torch.nn.Module):
    """A TE base module with its FP8 meta and a cached weight workspace."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8_meta = {"recipe": None, "fp8_group": None}
        self._fp8_workspaces = {
            "weight": types.SimpleNamespace(
                _data=torch.ones(4), _transpose=torch.ones(4), _scale_inv=torch.ones(1), _fp8_dtype="e4m3"
            )
        }

    def forward(self, x):
        return x


class FakeAttention(FakeTEModule):
    pass


class FakeQuantizer:
    def __init__(self):
        self.scale, self.amax = torch.ones(1), torch.zeros(1)


@pytest.fixture
def fake_te(monkeypatch):
    """The TE modules fp8_state.py imports, with TE's global quantization state and a log of calls."""
    log = []
    state = types.SimpleNamespace(skip_fp8_weight_update_tensor=None, fp8_enabled=True, is_first_fp8_module=True)

    class Manager:
        quantization_state = state

        @classmethod
        def set_skip_fp8_weight_update_tensor(cls, skip):
            if cls.quantization_state.skip_fp8_weight_update_tensor is None:
                cls.quantization_state.skip_fp8_weight_update_tensor = torch.empty(1)
            cls.quantization_state.skip_fp8_weight_update_tensor.fill_(skip)

        @classmethod
        def get_skip_fp8_weight_update_tensor(cls):
            return cls.quantization_state.skip_fp8_weight_update_tensor

        @classmethod
        def is_fp8_enabled(cls):
            return cls.quantization_state.fp8_enabled

        @classmethod
        def is_first_fp8_module(cls):
            first, cls.quantization_state.is_first_fp8_module = cls.quantization_state.is_first_fp8_module, False
            return first

        get_fp8_recipe = classmethod(lambda cls: REPLAY_RECIPE)
        get_fp8_group = classmethod(lambda cls: "replay group")
        add_fp8_tensors_to_global_buffer = classmethod(lambda cls, meta: log.append(("join", id(meta))))
        reduce_and_update_fp8_tensors = classmethod(lambda cls, forward=True: log.append(("update", forward)))

    def save_fp8_tensors(modules, recipe):
        log.append(("save", recipe.kind))
        return ["saved meta"] if recipe.delayed() else None

    def restore_fp8_tensors(modules, saved):
        log.append(("restore", tuple(saved)))

    tree = {
        "transformer_engine": {},
        "transformer_engine.pytorch": {},
        "transformer_engine.pytorch.quantization": {"FP8GlobalStateManager": Manager},
        "transformer_engine.pytorch.graph": {
            "save_fp8_tensors": save_fp8_tensors,
            "restore_fp8_tensors": restore_fp8_tensors,
        },
        "transformer_engine.pytorch.module": {},
        "transformer_engine.pytorch.module.base": {"TransformerEngineBaseModule": FakeTEModule},
        "transformer_engine.pytorch.ops": {},
        "transformer_engine.pytorch.ops.op": {"BasicOperation": type("BasicOperation", (torch.nn.Module,), {})},
        "transformer_engine.pytorch.attention": {},
        "transformer_engine.pytorch.attention.dot_product_attention": {"DotProductAttention": FakeAttention},
        "transformer_engine.pytorch.quantized_tensor": {"Quantizer": FakeQuantizer},
    }
    for name, attributes in tree.items():
        module = types.ModuleType(name)
        vars(module).update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return types.SimpleNamespace(manager=Manager, state=state, log=log)


def layer():
    return torch.nn.Sequential(FakeTEModule(), FakeAttention(), torch.nn.Identity())


def test_the_weight_update_flag_exists_from_before_warmup_and_says_update(fake_te):
    capture = fp8_state.Fp8Capture(FakeRecipe("current"), (layer(),))
    capture.enter()
    assert capture.flag is fake_te.state.skip_fp8_weight_update_tensor and capture.flag.item() == 0
    capture.exit(failed=False)
    assert fake_te.state.skip_fp8_weight_update_tensor is capture.flag  # the graphs read it by address


@pytest.mark.parametrize("before", [None, "flag made by make_graphed_callables"])
def test_a_failed_capture_puts_back_the_flag_that_was_there_with_its_value(fake_te, before):
    fake_te.state.skip_fp8_weight_update_tensor = None if before is None else torch.ones(1)  # says skip
    kept = fake_te.state.skip_fp8_weight_update_tensor
    capture = fp8_state.Fp8Capture(FakeRecipe("current"), (layer(),))
    capture.enter()
    assert capture.flag.item() == 0  # warmup updates the workspaces
    capture.exit(failed=True)
    assert fake_te.state.skip_fp8_weight_update_tensor is kept
    assert kept is None or kept.item() == 1  # filled in place by enter, its value put back


@pytest.mark.parametrize("failed", [False, True])
def test_delayed_scalings_meta_is_saved_before_warmup_and_restored_after_capture_whatever_happens(fake_te, failed):
    capture = fp8_state.Fp8Capture(FakeRecipe("delayed"), (layer(),))
    capture.enter()
    assert fake_te.log == [("save", "delayed")]
    capture.exit(failed)
    assert fake_te.log[-1] == ("restore", ("saved meta",))


def test_current_scaling_has_no_meta_to_restore(fake_te):
    capture = fp8_state.Fp8Capture(FakeRecipe("current"), (layer(),))
    capture.enter()
    capture.exit(False)
    assert [entry for entry in fake_te.log if entry[0] == "restore"] == []


def test_the_modules_a_forward_reaches_are_recorded_and_the_hooks_removed(fake_te):
    model = layer()
    capture = fp8_state.Fp8Capture(FakeRecipe("delayed"), (model,))
    capture.enter()
    out = model[0](torch.ones(1))  # the attention module is never called
    capture.exit(False)
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.ones(1))  # the hook changes no output
    model[1](torch.ones(1))  # after capture: not recorded
    assert list(capture.visited.values()) == [model[0]]
    assert all(not m._forward_hooks for m in model.modules())


def test_a_layer_kept_in_bf16_replays_without_fp8(fake_te):
    capture = fp8_state.Fp8Capture(FakeRecipe("delayed"), (layer(),))
    capture.enter()
    capture.exit(False)
    assert capture.replay(enabled=False) is None


@pytest.mark.parametrize("update", [True, False])
def test_a_replay_fills_the_flag_with_skip_unless_it_updates_the_weights(fake_te, update):
    capture = fp8_state.Fp8Capture(FakeRecipe("current"), (layer(),))
    capture.enter()
    capture.exit(False)
    capture.replay(True).before_forward(update)
    assert capture.flag.item() == (not update)


def captured(kind, model, fake_te, called):
    """An Fp8Capture of ``model`` whose forwards reached ``called``, and the replay it makes."""
    capture = fp8_state.Fp8Capture(FakeRecipe(kind), (model,))
    capture.enter()
    for module in called:
        module(torch.ones(1))
    capture.exit(False)
    fake_te.log.clear()
    return capture.replay(True)


def test_delayed_replays_join_the_visited_modules_with_the_replay_time_recipe_and_group(fake_te):
    model = layer()
    replay = captured("delayed", model, fake_te, model[:2])
    first = replay.before_forward(True)
    second = replay.before_forward(True)  # the next layer in the same autocast
    # Non-FP8 attention (the recipe has no fp8_dpa) stays out of the reduction, as in TE's new_fwd.
    assert fake_te.log == [("join", id(model[0].fp8_meta))] * 2
    assert model[0].fp8_meta["recipe"] is REPLAY_RECIPE and model[0].fp8_meta["fp8_group"] == "replay group"
    assert (first, second) == (True, False)
    replay.after_backward(second)
    assert fake_te.log[-1][0] == "join"
    replay.after_backward(first)
    assert fake_te.log[-1] == ("update", False)  # the backward amaxes, once per autocast


def test_current_scaling_replays_join_nothing_and_update_nothing(fake_te):
    model = layer()
    replay = captured("current", model, fake_te, model[:1])
    replay.after_backward(replay.before_forward(True))
    assert fake_te.log == []


def test_outside_an_fp8_autocast_a_replay_joins_nothing(fake_te):
    model = layer()
    replay = captured("delayed", model, fake_te, model[:1])
    fake_te.state.fp8_enabled = False
    assert replay.before_forward(True) is False and fake_te.log == []


def test_the_workspaces_tensors_are_what_frames_share(fake_te):
    model = layer()
    found = fp8_state.fp8_workspace_storages((model,))
    workspace = model[0]._fp8_workspaces["weight"]
    assert {id(t) for t in found} >= {id(workspace._data), id(workspace._transpose), id(workspace._scale_inv)}


def test_per_call_quantizer_copies_have_their_scale_protected_and_module_quantizers_are_left_alone(fake_te):
    model = layer()
    owned = FakeQuantizer()
    model[1].quantizers = {"scaling_fwd": [owned], "scaling_bwd": []}
    attributes = fp8_state.per_call_quantizers((model,))
    assert attributes(FakeQuantizer()) == ("scale",)  # a copy made in the call (FusedAttnFunc's S)
    assert attributes(owned) == ()  # the module's own: shared state
    assert attributes(torch.ones(1)) == () and attributes(object()) == ()
    # DotProductAttention rebuilds its quantizers inside a forward: the new ones are the module's too, and the
    # old ones, once let go, are nobody's (a set of ids taken before would call the new ones per-call copies,
    # and a copy that reuses a freed id the module's).
    rebuilt = FakeQuantizer()
    model[1].quantizers = {"scaling_fwd": [rebuilt], "scaling_bwd": []}
    assert attributes(rebuilt) == () and attributes(owned) == ("scale",)
