"""The banked layer class on CPU: routing by CP size and group, THD layout and RoPE table checks,
the hand-over to Megatron's replay path per scope, eager fallback, fail-closed refusals and the
per-bank report. Capture itself runs on GPUs (tests/functional/test_graph_banks.py)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_cg_plugin.banks.capture import (
    BankedLayers,
    BankGraph,
    BankReplayError,
    LayerBanks,
    ThdCapacity,
    banked_layer_class,
    capture_banks,
)
from megatron_cg_plugin.banks.router import BankRouter, BankSelectionError, GraphBank
from megatron_cg_plugin.packed.layout import ThdCapacityError
from megatron_cg_plugin.scopes import attention_in_graph

CAPACITY = ThdCapacity(tokens_per_rank=8, max_seqs=2)


class FakeLayer(torch.nn.Module):
    """Stands for Megatron's TransformerLayer: its own call returns ("eager", context); its replay
    path (``_te_cuda_graph_replay``) calls ``cuda_graphs[0]`` with the hidden states, as Megatron's does."""

    layer_number = 3

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(delay_offload_until_cuda_graph=False, cuda_graph_impl="transformer_engine")
        self.cuda_graphs: list = []
        self.replay_kwargs: list[dict] = []

    def __call__(self, *args, **kwargs):
        return "eager", kwargs.get("context")

    def _forward_attention(self, hidden_states, attention_mask=None, rotary_pos_emb=None, packed_seq_params=None):
        raise AssertionError("the fakes never run attention")

    def _te_cuda_graph_replay(self, hidden_states, **kwargs):
        self.replay_kwargs.append(kwargs)
        outputs = self.cuda_graphs[0](hidden_states, is_first_microbatch=False)
        assert isinstance(outputs, tuple)  # Megatron takes list() of it
        return outputs[0], None


def packed(cp_size=1, group=None, cu_length=4, max_seqlen=8):
    cu = torch.zeros(cu_length, dtype=torch.int32)
    return types.SimpleNamespace(
        local_cp_size=cp_size,
        cp_group=group,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max_seqlen,
    )


def bank_layer(*, attention=True, rope_tables=None, group=None, base=FakeLayer):
    calls = []

    def graph(size):
        return BankGraph(
            lambda *inputs: calls.append((size, *inputs)) or f"graph cp{size}",
            takes_layout=attention,
            rope_table=None if rope_tables is None else rope_tables[size],
        )

    layer = banked_layer_class(base)()
    router = BankRouter({1: GraphBank(1, None, graph(1)), 2: GraphBank(2, group, graph(2))})
    vars(layer)["_graph_banks"] = LayerBanks(router, CAPACITY, attention)
    return layer, calls


@pytest.fixture
def banked():
    group = object()
    layer, calls = bank_layer(group=group)
    return layer, group, calls


def test_the_bank_of_the_microbatch_cp_size_replays_through_megatrons_replay_path(banked):
    layer, group, calls = banked
    hidden = torch.ones(8, 1, 4)
    assert layer(hidden_states=hidden, packed_seq_params=packed()) == ("graph cp1", None)
    params = packed(2, group, max_seqlen=16)
    assert layer(hidden, packed_seq_params=params, rotary_pos_emb=None) == ("graph cp2", None)
    assert [c[0] for c in calls] == [1, 2] and calls[1][1] is hidden and calls[1][2] is params.cu_seqlens_q
    # Attention is graphed: the layout is a graph input, so Megatron's replay gets no keyword arguments.
    assert layer.replay_kwargs == [{}, {}]
    assert layer.cuda_graphs == []  # the bank's graph is lent for the call only
    assert vars(layer)["_graph_banks"].router.report() == [
        {"cp_size": 1, "replays": 1, "rejected": 0, "offload_groups_flushed": 0},
        {"cp_size": 2, "replays": 1, "rejected": 0, "offload_groups_flushed": 0},
    ]


def test_scopes_without_attention_replay_the_shared_graph_after_eager_attention():
    group = object()
    layer, calls = bank_layer(attention=False, group=group)
    hidden = torch.ones(8, 1, 4)
    params = packed(2, group, cu_length=7)  # the layout is not a graph input here: not checked
    assert layer(hidden_states=hidden, packed_seq_params=params)[0] == "graph cp2"
    assert calls == [(2, hidden)]
    assert layer.replay_kwargs == [{"packed_seq_params": params}]  # Megatron runs attention with them


def test_scope_of_megatrons_modules():
    assert attention_in_graph([]) and attention_in_graph(None)
    assert attention_in_graph([types.SimpleNamespace(name="attn"), types.SimpleNamespace(name="moe")])
    assert attention_in_graph(["attn"]) and not attention_in_graph(["mlp"]) and not attention_in_graph(["moe"])


def test_rope_tables_are_bound_per_bank():
    tables = {1: torch.zeros(8, 1, 1, 4), 2: torch.zeros(16, 1, 1, 4)}
    layer, calls = bank_layer(rope_tables=tables)
    layer(hidden_states=torch.ones(1), packed_seq_params=packed(), rotary_pos_emb=tables[1])  # the same object
    assert tables[1].abs().sum() == 0
    fresh = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 1, 1, 4)
    layer(hidden_states=torch.ones(1), packed_seq_params=packed(), rotary_pos_emb=fresh)
    assert torch.equal(tables[1], fresh) and tables[2].abs().sum() == 0  # copied into the bank's table only
    with pytest.raises(ThdCapacityError, match=r"rotary table \(16, 1, 1, 4\).*captured with \(8, 1, 1, 4\)"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(), rotary_pos_emb=tables[2])
    with pytest.raises(BankReplayError, match="captured with a RoPE table but the call passes none"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    plain, _ = bank_layer()
    with pytest.raises(BankReplayError, match="captured without a RoPE table but the call passes one"):
        plain(hidden_states=torch.ones(1), packed_seq_params=packed(), rotary_pos_emb=fresh)
    assert len(calls) == 2 and layer.cuda_graphs == []


def _delayed_group(name, ran):
    return (lambda group_name, released: ran.append(group_name), name, [])


def test_delayed_offload_groups_are_flushed_by_the_replay_and_the_queue_left_empty(offload_manager):
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as interface,
    )

    class MegatronReplay(FakeLayer):
        def _te_cuda_graph_replay(self, hidden_states, **kwargs):  # Megatron 0.19: graph, then the flush
            output = super()._te_cuda_graph_replay(hidden_states, **kwargs)
            interface.flush_delayed_groups()
            return output

    ran = []
    group = object()
    layer, _ = bank_layer(group=group, base=MegatronReplay)
    layer.config.delay_offload_until_cuda_graph = True
    offload_manager._delayed_offload_groups = [_delayed_group("layer 2 attn", ran), _delayed_group("layer 2 mlp", ran)]
    layer(hidden_states=torch.ones(1), packed_seq_params=packed(2, group, max_seqlen=16))
    assert ran == ["layer 2 attn", "layer 2 mlp"] and offload_manager._delayed_offload_groups == []
    offload_manager._delayed_offload_groups = [_delayed_group("layer 3 attn", ran)]
    layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    assert offload_manager._delayed_offload_groups == []
    rows = vars(layer)["_graph_banks"].router.report()
    assert [row["offload_groups_flushed"] for row in rows] == [1, 2]


def test_a_replay_that_leaves_delayed_groups_queued_is_refused(offload_manager):
    class NoFlush(FakeLayer):
        def _te_cuda_graph_replay(self, hidden_states, **kwargs):
            output = super()._te_cuda_graph_replay(hidden_states, **kwargs)
            offload_manager._delayed_offload_groups.append(_delayed_group("this layer's eager mlp", []))
            return output  # a release that no longer flushes after the graph

    layer, _ = bank_layer(base=NoFlush)
    layer.config.delay_offload_until_cuda_graph = True
    offload_manager._delayed_offload_groups = [_delayed_group("layer 2 attn", [])]
    with pytest.raises(
        BankReplayError, match="1 of the 1 offload groups delayed until this graph replay are still queued"
    ):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    offload_manager._delayed_offload_groups = []  # only groups delayed after the flush: fine
    layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    assert len(offload_manager._delayed_offload_groups) == 1


def test_calls_the_banks_cannot_serve_run_eagerly(banked):
    layer, _, calls = banked
    assert layer(hidden_states=torch.ones(1)) == ("eager", None)  # no packed sequences
    layer.eval()
    assert layer(hidden_states=torch.ones(1), packed_seq_params=packed()) == ("eager", None)
    layer.train()
    with torch.no_grad():
        assert layer(hidden_states=torch.ones(1), packed_seq_params=packed()) == ("eager", None)
    unbanked = banked_layer_class(FakeLayer)()
    assert unbanked(hidden_states=torch.ones(1), packed_seq_params=packed()) == ("eager", None)
    assert calls == []


def test_refusals(banked):
    layer, group, calls = banked
    with pytest.raises(BankSelectionError, match="CP size 4"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(4, group))
    with pytest.raises(BankSelectionError, match="only that very group"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(2, object()))
    with pytest.raises(ThdCapacityError, match=r"captured for \(4,\): 2 sequences .* raise --cg-thd-max-seqs"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(cu_length=5))
    with pytest.raises(ThdCapacityError, match="max_seqlen 9 exceeds the captured bound 8"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(max_seqlen=9))
    with pytest.raises(BankReplayError, match="attention_mask"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(), attention_mask=torch.ones(1))
    with pytest.raises(BankReplayError, match="extra positional"):
        layer(torch.ones(1), torch.ones(1), packed_seq_params=packed())
    cross = packed()
    cross.cu_seqlens_kv = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(BankReplayError, match="self-attention"):
        layer(hidden_states=torch.ones(1), packed_seq_params=cross)
    assert calls == [] and layer.replay_kwargs == []


def test_a_failing_replay_gives_the_layer_its_graphs_back():
    layer, _ = bank_layer()
    mine = ["megatron's own"]
    layer.cuda_graphs = mine
    vars(layer)["_graph_banks"].router.banks[1].payload = BankGraph(
        lambda *inputs: (_ for _ in ()).throw(RuntimeError("replay failed")), takes_layout=True, rope_table=None
    )
    with pytest.raises(RuntimeError, match="replay failed"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    assert layer.cuda_graphs is mine


def test_report_sums_layers_and_reset_unbanks(banked):
    layer, group, _ = banked
    layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    other, _ = bank_layer(group=group)
    other(hidden_states=torch.ones(1), packed_seq_params=packed())
    with pytest.raises(BankSelectionError):
        other(hidden_states=torch.ones(1), packed_seq_params=packed(2, object()))
    routers = {1: vars(layer)["_graph_banks"].router, 2: vars(other)["_graph_banks"].router}
    layers = BankedLayers(routers, {}, [layer, other])
    report = layers.report()
    assert report["banks"] == [
        {"cp_size": 1, "replays": 2, "rejected": 0, "offload_groups_flushed": 0},
        {"cp_size": 2, "replays": 0, "rejected": 1, "offload_groups_flushed": 0},
    ]
    assert layers.graph_count == 0
    layers.reset()
    assert "_graph_banks" not in vars(layer) and "_graph_banks" not in vars(other)
    assert layer(hidden_states=torch.ones(1), packed_seq_params=packed()) == ("eager", None)


def test_layers_built_without_te_graphs_are_refused_before_any_capture():
    layer = banked_layer_class(FakeLayer)()
    layer.config.cuda_graph_impl = "none"
    with pytest.raises(ValueError, match=r"layers \[3\] were built without cuda_graph_impl='transformer_engine'"):
        capture_banks([layer], {1: None}, CAPACITY)
    assert "_graph_banks" not in vars(layer)


def test_layers_whose_attention_call_changed_are_refused_before_any_capture():
    from megatron_cg_plugin.compat import SignatureMismatchError

    class Changed(FakeLayer):
        def _forward_attention(self, hidden_states, mask=None):
            raise AssertionError("never called")

    with pytest.raises(SignatureMismatchError, match="attention_mask, rotary_pos_emb, packed_seq_params"):
        capture_banks([banked_layer_class(Changed)()], {1: None}, CAPACITY)


# -- Dropless MoE: graphs that end inside the MoE block (moe_router moe_preprocess) --------------------


def partial_moe_layer(modules=("attn", "moe_router", "moe_preprocess")):
    dispatcher = types.SimpleNamespace(hidden_shape=None, hidden_shape_before_permute=None)
    return types.SimpleNamespace(
        is_moe_layer=True,
        config=types.SimpleNamespace(cuda_graph_modules=list(modules)),
        mlp=types.SimpleNamespace(token_dispatcher=dispatcher),
    )


class FakeMoeLayer(FakeLayer):
    """Its replay's eager rest reads the dispatcher's Python state, as Megatron's MoE block does after a
    moe_preprocess graph (token_dispatcher.py l.887, l.894)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = types.SimpleNamespace(
            token_dispatcher=types.SimpleNamespace(hidden_shape=None, hidden_shape_before_permute=None)
        )
        self.read_shapes: list = []

    def _te_cuda_graph_replay(self, hidden_states, **kwargs):
        output = super()._te_cuda_graph_replay(hidden_states, **kwargs)
        dispatcher = self.mlp.token_dispatcher
        self.read_shapes.append((dispatcher.hidden_shape, dispatcher.hidden_shape_before_permute))
        return output


def test_each_bank_hands_the_eager_rest_the_dispatcher_state_of_its_own_capture():
    layer = banked_layer_class(FakeMoeLayer)()
    group = object()
    # Distinct per bank so the test tells them apart; in a run they are equal (every bank sees tokens_per_rank tokens),
    # and what the restore guards against is an eager forward of another shape in between.
    state = {
        size: {"hidden_shape": ("hidden", size), "hidden_shape_before_permute": ("permute", size)} for size in (1, 2)
    }
    router = BankRouter(
        {
            size: GraphBank(
                size,
                group if size > 1 else None,
                BankGraph(
                    lambda *inputs, s=size: f"graph cp{s}",
                    takes_layout=True,
                    rope_table=None,
                    dispatcher_state=state[size],
                ),
            )
            for size in (1, 2)
        }
    )
    vars(layer)["_graph_banks"] = LayerBanks(router, CAPACITY, True)
    layer.mlp.token_dispatcher.hidden_shape = ("an eager forward", 0)  # e.g. an evaluation step in between
    layer(hidden_states=torch.ones(1), packed_seq_params=packed(2, group, max_seqlen=16))
    layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    assert layer.read_shapes == [(("hidden", 2), ("permute", 2)), (("hidden", 1), ("permute", 1))]


# megatron-core 0.19.2's alltoall dispatcher: its per-forward state, hidden_shape among it (token_dispatcher.py l.473).
ALLTOALL_CUDAGRAPH_ATTRS = [
    "tokens_per_expert",
    "input_splits",
    "output_splits",
    "output_splits_tp",
    "num_out_tokens",
    "num_global_tokens_per_local_expert",
    "reversed_local_input_permutation_mapping",
    "routing_map",
    "hidden_shape",
    "probs",
]


def test_a_banks_capture_records_the_preprocess_shapes_before_its_scratch_is_cleared():
    from megatron_cg_plugin.banks.capture import bank_capture_call
    from megatron_cg_plugin.capture.scratch import moe_dispatcher_scratch

    layer = partial_moe_layer()
    dispatcher = layer.mlp.token_dispatcher
    dispatcher.cudagraph_attrs = ALLTOALL_CUDAGRAPH_ATTRS

    def capture(tokens):  # Megatron's capture callable: the preprocess leaves its state on the dispatcher
        dispatcher.hidden_shape, dispatcher.hidden_shape_before_permute = (tokens, 4), (tokens * 2, 4)
        dispatcher.routing_map = torch.ones(tokens, 2)
        return "outputs"

    layer._te_cuda_graph_capture = capture
    state = {}
    call = bank_capture_call(layer, moe_dispatcher_scratch(layer), state)
    assert call(3) == "outputs" and state == {"hidden_shape": (3, 4), "hidden_shape_before_permute": (6, 4)}
    assert dispatcher.hidden_shape is None and dispatcher.routing_map is None  # the scratch went with the forward
    call(5)  # warmup, then capture: the capture's call is the last
    assert state == {"hidden_shape": (5, 4), "hidden_shape_before_permute": (10, 4)}
    # A router-only graph leaves the preprocess to the eager rest, and a dense layer has none: nothing recorded.
    router_only = partial_moe_layer(("attn", "moe_router"))
    router_only._te_cuda_graph_capture = capture
    assert bank_capture_call(router_only, (), {}) is capture
    dense = types.SimpleNamespace(
        is_moe_layer=False, config=types.SimpleNamespace(cuda_graph_modules=["attn"]), _te_cuda_graph_capture=capture
    )
    assert bank_capture_call(dense, (), {}) is capture


def test_a_bank_replay_empties_megatrons_moe_tensor_store_when_the_eager_rest_raises():
    class FailingRest(FakeMoeLayer):
        def _te_cuda_graph_replay(self, hidden_states, **kwargs):
            self.mlp.cudagraph_tensor_store.filled = True  # as Megatron's replay sets it before the rest
            raise RuntimeError("the eager rest failed")

    store = types.SimpleNamespace(filled=False)
    store.clear = lambda: setattr(store, "filled", False)
    layer, _ = bank_layer(base=FailingRest)
    layer.mlp.cudagraph_tensor_store = store
    with pytest.raises(RuntimeError, match="the eager rest failed"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    assert store.filled is False


def test_megatrons_capture_flag_is_set_only_around_banks_that_end_inside_the_moe_block():
    from megatron.core.transformer import cuda_graphs

    from megatron_cg_plugin.banks.capture import megatron_capturing

    whole = partial_moe_layer(("attn", "moe"))
    with megatron_capturing([whole]):
        assert not cuda_graphs.is_graph_capturing()  # the MoE block inside the graph: Megatron's flag stays off
    with pytest.raises(RuntimeError, match="capture failed"), megatron_capturing([whole, partial_moe_layer()]):
        assert cuda_graphs.is_graph_capturing()  # the MoE forward returns after the preprocess under it
        raise RuntimeError("capture failed")
    assert not cuda_graphs.is_graph_capturing()  # put back, also after a failure


def test_banks_ending_inside_the_moe_block_are_captured_in_training_mode_only():
    from megatron_cg_plugin.banks.capture import _validate_bank_capture

    layer = FakeMoeLayer()
    layer.is_moe_layer = True
    layer.config.cuda_graph_modules = ["attn", "moe_router", "moe_preprocess"]
    layer.eval()
    with pytest.raises(ValueError, match=r"layers \[3\] are in eval mode.*model.train\(\) before capture_banks"):
        _validate_bank_capture([layer], {1: None}, [1], None)
    layer.train()
    _validate_bank_capture([layer], {1: None}, [1], None)
