"""``--cg-slot-capture`` (slot_sharing/megatron_backend.py, slot_sharing/offload_groups.MegatronOffload) on CPU: what
the capture call refuses, how a replay call maps onto the graph's inputs, Megatron's offload
interface and the layers' in-graph flag during capture, and which backend the helper picks. The
capture itself needs a GPU: the farm's slot cases (tests/functional/test_cases/gpt/*slot*)."""

from __future__ import annotations

import types

import pytest
import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as megatron_offload

from megatron_cg_plugin.capture.te_backend import TEBackend
from megatron_cg_plugin.capture_lifecycle import bind_helper_class
from megatron_cg_plugin.config import ConfigError, PluginConfig
from megatron_cg_plugin.session import RunSession
from megatron_cg_plugin.slot_sharing import megatron_backend
from megatron_cg_plugin.slot_sharing.megatron_backend import (
    SlotBackend,
    SlotCaptureError,
    SlotLayerGraph,
    SlotReplayError,
    _layer_variant,
    check_slot_capture_call,
)
from megatron_cg_plugin.slot_sharing.offload_groups import MegatronOffload, OffloadCopies
from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy


def layer(modules=(), moe=False):
    config = types.SimpleNamespace(cuda_graph_modules=[types.SimpleNamespace(name=m) for m in modules])
    return types.SimpleNamespace(config=config, is_moe_layer=moe, layer_number=1)


class FakeRecipe:
    def __init__(self, kind, fp8_dpa=False, fp8_mha=False):
        self.kind, self.fp8_dpa, self.fp8_mha = kind, fp8_dpa, fp8_mha

    def delayed(self):
        return self.kind == "delayed"

    def float8_current_scaling(self):
        return self.kind == "current"


@pytest.mark.parametrize("enabled, layers", [((True,), 1), (True, 1), ((False, True), 2)])
@pytest.mark.parametrize(
    "recipe, words",
    [
        (FakeRecipe("mxfp8"), "FakeRecipe is not verified"),
        (FakeRecipe("current", fp8_dpa=True), "delayed scaling only"),
        (FakeRecipe("delayed", fp8_dpa=True, fp8_mha=True), "fp8_multi_head_attention"),
        (None, "needs the recipe"),
    ],
)
def test_fp8_recipes_slot_capture_cannot_serve_are_refused_naming_the_fix(enabled, layers, recipe, words):
    callables = [layer() for _ in range(layers)]
    with pytest.raises(SlotCaptureError, match=words) as refused:
        check_slot_capture_call(callables, [()] * layers, {"fp8_enabled": enabled, "fp8_recipe": recipe})
    assert "drop --cg-slot-capture" in str(refused.value)


@pytest.mark.parametrize("recipe", [FakeRecipe("delayed"), FakeRecipe("current"), FakeRecipe("delayed", fp8_dpa=True)])
def test_delayed_and_current_scaling_and_fp8_attention_under_delayed_scaling_are_taken(recipe):
    check_slot_capture_call([layer(), layer()], [(), ()], {"fp8_enabled": (False, True), "fp8_recipe": recipe})


def test_layers_megatron_keeps_in_bf16_need_no_fp8_check():
    check_slot_capture_call([layer()], [()], {"fp8_enabled": (False,), "fp8_recipe": FakeRecipe("mxfp8")})


def test_one_graph_per_microbatch_in_flight_is_refused_naming_pipeline_parallelism():
    with pytest.raises(SlotCaptureError, match="--pipeline-model-parallel-size 1"):
        check_slot_capture_call([layer()], [(), ()], {})


def test_partial_moe_scope_is_refused_and_whole_blocks_pass():
    with pytest.raises(SlotCaptureError, match="attn moe"):
        check_slot_capture_call([layer(("attn", "moe_router"), moe=True)], [()], {})
    check_slot_capture_call(
        [layer(("attn", "moe"), moe=True), layer(("attn", "moe_router"))], [(), ()], {"fp8_enabled": False}
    )


class FakeSlotted:
    def __init__(self):
        self.calls = []
        self.updates = []
        self.was_reset = False
        self.stats = types.SimpleNamespace(
            arena_bytes=8, staging_bytes=2, host_arena_bytes=(4, 0), offloaded_bytes={"layer": 4}, boundary_bytes=3
        )

    def callable(self, variant, slot):
        assert (variant, slot) == ("layer", 0)

        def replay(*tensors, update_fp8_weights=True):
            self.calls.append(tensors)
            self.updates.append(update_fp8_weights)
            return tensors[0] * 2

        return replay

    def reset(self):
        self.was_reset = True


def test_replay_maps_keyword_tensors_in_capture_order_and_ignores_what_is_no_input():
    slotted = FakeSlotted()
    graph = SlotLayerGraph(slotted, "layer 1", 1, ("attention_mask", "rotary_pos_emb"))
    hidden, mask, rope = torch.ones(2), torch.zeros(2, dtype=torch.bool), torch.full((2,), 3.0)
    out = graph(hidden, rotary_pos_emb=rope, attention_mask=mask, is_first_microbatch=True, cuda_graph_stream=object())
    assert isinstance(out, tuple) and torch.equal(out[0], hidden * 2)  # Megatron takes list(...) of it
    assert slotted.calls[0][1] is mask and slotted.calls[0][2] is rope
    assert graph.stats == megatron_backend.LayerSlotStats(
        arena_bytes=10, host_arena_bytes=4, offloaded_bytes=4, boundary_bytes=3
    )
    graph.reset()
    assert slotted.was_reset


@pytest.mark.parametrize(
    "caching, firsts, updates",
    [
        (True, (True, False, False, None), [True, False, False, True]),  # Megatron: refresh on microbatch 0 only
        (False, (True, False), [True, True]),  # no weight caching: every replay quantizes anew
    ],
)
def test_fp8_weights_are_refreshed_on_the_first_microbatch_only_when_cached(caching, firsts, updates):
    slotted = FakeSlotted()
    graph = SlotLayerGraph(slotted, "layer 1", 1, (), fp8_weight_caching=caching)
    for first in firsts:
        graph(torch.ones(1), is_first_microbatch=first)
    assert slotted.updates == updates


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda g, t: g(t, t), "2 positional"),
        (lambda g, t: g(t), "['attention_mask'] missing"),
        (lambda g, t: g(t, attention_mask=t, context=t), "['context'] unknown"),
    ],
)
def test_a_replay_call_unlike_the_capture_is_refused(call, problem):
    graph = SlotLayerGraph(FakeSlotted(), "layer 1", 1, ("attention_mask",))
    with pytest.raises(SlotReplayError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        call(graph, torch.ones(1))


def test_layer_variant_passes_keyword_tensors_by_name_and_drops_none():
    seen = {}

    def fake_layer(hidden, **kwargs):
        seen.update(kwargs, hidden=hidden)
        return (hidden,)

    fake_layer.config = types.SimpleNamespace(cuda_graph_modules=[])
    hidden, mask = torch.ones(1), torch.zeros(1)
    variant, names = _layer_variant(fake_layer, (hidden,), {"attention_mask": mask, "rotary_pos_emb": None})
    assert names == ("attention_mask",) and len(variant.sample_args) == 2
    variant.fn(*variant.sample_args)
    assert seen["hidden"] is hidden and seen["attention_mask"] is mask and "rotary_pos_emb" not in seen


def test_in_graph_offload_names_groups_and_turns_the_layers_flag_off_only_while_capturing():
    interface = megatron_offload.FineGrainedActivationOffloadingInterface
    enter_before = interface.__dict__["__enter__"]
    layers = [torch.nn.Module(), torch.nn.Module()]
    layers[0].offload_module_in_cuda_graph = True
    layers[1].offload_module_in_cuda_graph = False
    offload = MegatronOffload(OffloadPolicy.from_flags(["core_attn"]), layers)
    tensor = torch.ones(2)
    with offload.capturing():
        assert layers[0].offload_module_in_cuda_graph is False
        with interface(True, tensor, "core_attn") as inside:
            assert inside is tensor and offload.slot_offload(layers[0]).group() == "core_attn"
            assert interface(True, tensor, "core_attn").group_offload(tensor) is tensor
        with interface(False, tensor, "attn_norm"):  # a module the run does not offload: no group
            assert offload.tracker.current() is None
    assert layers[0].offload_module_in_cuda_graph is True and layers[1].offload_module_in_cuda_graph is False
    assert interface.__dict__["__enter__"] is enter_before


def test_in_graph_offload_follows_megatrons_config_fields():
    config = types.SimpleNamespace(
        fine_grained_activation_offloading=True,
        offload_modules=["core_attn", "mlp_norm"],
        min_offloaded_tensor_size=16,
        activation_offload_fraction=0.5,
    )
    offload = MegatronOffload.from_config(config, [])
    assert offload.policy == OffloadPolicy(frozenset({"core_attn", "mlp_norm"}), 16, 0.5)
    assert MegatronOffload.from_config(types.SimpleNamespace(fine_grained_activation_offloading=False), []) is None
    # Without in-graph offload, Megatron's hooks are still kept out of the capture; nothing goes to the host.
    kept_out = MegatronOffload.from_config(config, [], offload=False)
    assert kept_out.policy is None and kept_out.slot_offload(None) is None


class Base:
    def __init__(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("slot_capture, expected", [(False, TEBackend), (True, SlotBackend)])
def test_the_helper_captures_through_the_backend_the_config_asks_for(slot_capture, expected):
    session = RunSession(PluginConfig(slot_capture=slot_capture))
    helper = bind_helper_class(Base, session)()
    assert type(helper.capture_backend()) is expected
    given = object()
    assert bind_helper_class(Base, session, backend=given)().capture_backend() is given


def test_slot_capture_and_graph_banks_together_are_refused():
    with pytest.raises(ConfigError, match="drop --cg-slot-capture"):
        PluginConfig(slot_capture=True, graph_banks=True)


def test_the_delayed_offload_flush_is_observed_at_the_next_graph_call_and_counted(offload_manager):
    from megatron_cg_plugin.slot_sharing.megatron_backend import DelayedFlushWatch

    watch = DelayedFlushWatch(types.SimpleNamespace(delay_offload_until_cuda_graph=True))
    first, second = (SlotLayerGraph(FakeSlotted(), f"layer {n}", 1, (), watch) for n in (1, 2))
    offload_manager._delayed_offload_groups = [("group", "layer 0 experts", [])]
    first(torch.ones(1))  # Megatron flushes the queue right after this replay...
    offload_manager._delayed_offload_groups = []
    second(torch.ones(1))  # ...which the next call sees, and counts for the first graph
    assert (first.offload_groups_flushed, second.offload_groups_flushed) == (1, 0)
    assert first.stats.offload_groups_flushed == 1
    offload_manager._delayed_offload_groups = kept = [("group", "layer 1 experts", [])]
    first(torch.ones(1))
    offload_manager._delayed_offload_groups = list(kept)  # not flushed after the replay
    with pytest.raises(
        SlotReplayError, match="1 of the 1 offload groups delayed until the replay of layer 1 are still"
    ):
        second(torch.ones(1))


def test_unknown_copy_modes_and_copy_settings_without_slot_capture_are_refused():
    with pytest.raises(ValueError, match="use one of in-graph, between-replays"):
        OffloadCopies("sideways")
    with pytest.raises(ValueError, match="offload window -1: use 0 or more"):
        OffloadCopies(window=-1)
    from megatron_cg_plugin.slot_sharing.capture import SlotOffload

    with pytest.raises(ValueError, match="offload window -1: use 0 or more"):  # capture_slotted's own API
        SlotOffload(OffloadPolicy.from_flags(["core_attn"]), group=lambda: None, window=-1)
    with pytest.raises(ConfigError, match=r"--cg-offload-copies between-replays only chooses .* add --cg-slot-capture"):
        PluginConfig(offload_copies="between-replays")
    with pytest.raises(ConfigError, match=r"--cg-offload-window 3 only chooses .* add --cg-slot-capture"):
        PluginConfig(offload_window=3)
    with pytest.raises(ConfigError, match="--cg-offload-window -1 must be >= 0"):
        PluginConfig(offload_window=-1, slot_capture=True)
    PluginConfig(offload_copies="between-replays", slot_capture=True)
    assert OffloadCopies.of(PluginConfig(offload_window=4, slot_capture=True)) == OffloadCopies("in-graph", 4)


@pytest.fixture
def capture_calls(monkeypatch):
    """The options of each capture_slotted call SlotBackend makes (the capture itself faked)."""
    calls = []
    monkeypatch.setattr(
        megatron_backend,
        "capture_slotted",
        lambda variants, plan, parameters, **options: calls.append(options) or FakeSlotted(),
    )
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool",))
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "stream")
    return calls


def megatron_layers(count):
    layers = []
    for number in range(1, count + 1):
        module = torch.nn.Linear(2, 2)
        module.config = types.SimpleNamespace(cuda_graph_modules=[])
        module.layer_number = number
        layers.append(module)
    return tuple(layers)


def test_every_layer_captures_with_one_set_of_parameter_gradient_buffers(capture_calls):
    """The layers' backward replays run one at a time (one graph per layer), so they share the
    buffers their backward graphs write the parameter gradients to (slot_sharing.param_grads)."""
    calls = capture_calls
    graphs = SlotBackend(offload=False).make_graphed_callables(megatron_layers(3), [(torch.ones(2),)] * 3)
    assert len(graphs) == 3 and len(calls) == 3
    shared = calls[0]["param_grads"]
    assert shared is not None and all(call["param_grads"] is shared for call in calls)
    assert all(call["check_stale"] is False for call in calls)  # the helper's check covers the layers
    assert all(call["fp8"] is None for call in calls)


def test_each_layer_captures_with_its_own_fp8_enable_recipe_group_and_modules(capture_calls):
    """Megatron keeps its first and last layers in bf16 (one fp8_enabled per layer); every layer's
    capture gets the run's recipe and amax group, and the layer as the modules whose FP8 state it
    saves and whose workspaces it shares."""
    calls, layers = capture_calls, megatron_layers(3)
    recipe, group = FakeRecipe("delayed"), object()
    SlotBackend(offload=False).make_graphed_callables(
        layers,
        [(torch.ones(2),)] * 3,
        fp8_enabled=(False, True, False),
        fp8_recipe=recipe,
        fp8_group=group,
        fp8_weight_caching=True,
    )
    assert [call["fp8"].enabled for call in calls] == [False, True, False]
    assert all(call["fp8"].recipe is recipe and call["fp8"].group is group for call in calls)
    assert [call["fp8"].modules for call in calls] == [(layer,) for layer in layers]


def test_the_offload_window_reaches_every_layers_capture(capture_calls):
    layers = megatron_layers(2)
    for layer in layers:
        layer.config = types.SimpleNamespace(
            cuda_graph_modules=[], fine_grained_activation_offloading=True, offload_modules=["core_attn"]
        )
    copies = OffloadCopies.of(PluginConfig(slot_capture=True, offload_window=3))
    SlotBackend(copies=copies).make_graphed_callables(layers, [(torch.ones(2),)] * 2)
    assert [call["offload"].window for call in capture_calls] == [3, 3]
    assert all(call["offload"].staging is None for call in capture_calls)  # in-graph copies: no ring


def test_copies_between_replays_get_a_ring_of_window_plus_one_buffers(capture_calls, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    layers = megatron_layers(2)
    for layer in layers:
        layer.config = types.SimpleNamespace(
            cuda_graph_modules=[], fine_grained_activation_offloading=True, offload_modules=["core_attn"]
        )
    SlotBackend(copies=OffloadCopies("between-replays", 3)).make_graphed_callables(layers, [(torch.ones(2),)] * 2)
    rings = {id(call["offload"].staging): call["offload"].staging for call in capture_calls}
    assert len(rings) == 1 and next(iter(rings.values())).depth == 4  # one ring shared by the layers
    assert SlotBackend(copies="between-replays").copies == OffloadCopies("between-replays", 1)  # a mode name


def test_each_layers_offload_plans_it_at_its_place_in_the_stack():
    from megatron_cg_plugin.slot_sharing.offload_plan import Save

    layers = [torch.nn.Module() for _ in range(3)]
    offload = MegatronOffload(OffloadPolicy.from_flags(["core_attn"]), layers)
    saves = [Save("q", 2 << 20, 1 << 20, "core_attn")]
    # Megatron keeps the last layer's groups on the GPU (their reload would be needed at once): so does the plan.
    assert [offload.slot_offload(layer).plan("layer", saves).offloaded for layer in layers] == [{"q"}, {"q"}, set()]
