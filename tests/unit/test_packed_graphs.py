"""Packed (THD) microbatches under TE graphs without hybrid CP (``packed.graphs``): the fixed
layout's fill, its refusals, the capture's sample inputs and the three patches' wrappers, on CPU
with Megatron's own ``PackedSeqParams`` and stand-ins for its model and layer."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.packed import graphs
from megatron_cg_plugin.packed.graphs import THD_KWARG, PackedFormError
from megatron_cg_plugin.packed.layout import PackedLayout, ThdCapacityError, padded_offsets
from megatron_cg_plugin.planner.graph_memory import thd_buffer_bytes
from megatron_cg_plugin.session import RunSession
from megatron_cg_plugin.settings import RunSettings

LAYOUT = PackedLayout(max_seqs=6, max_seqlen=16)


def params_of(offsets, *, longest=None, padded=None, **more) -> PackedSeqParams:
    """As Megatron-LM's pretrain_gpt.py builds them: one tensor for q and kv."""
    cu = torch.tensor(offsets, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        **more,
    )


# -- the fill ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(0, 4))
def test_the_device_fill_is_the_host_rule(lengths, spare):
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    entries = len(offsets) + spare
    fixed = graphs.fixed_offsets(torch.tensor(offsets, dtype=torch.int64), entries)
    assert fixed.dtype == torch.int32 and fixed.device == torch.device("cpu") and fixed.shape == (entries,)
    assert tuple(fixed.tolist()) == padded_offsets(offsets, entries)
    assert fixed.tolist()[len(offsets) :] == [offsets[-1]] * spare  # zero-length sequences


def test_padding_entries_repeat_the_last_offset():
    assert padded_offsets((0, 3, 10), 6) == (0, 3, 10, 10, 10, 10)
    assert LAYOUT.sample_offsets(2) == (0, 16, 32, 32, 32, 32, 32)  # each sample one sequence of --seq-length
    assert LAYOUT.entries == 7


def test_a_batch_beyond_the_capacity_is_refused_naming_the_flag():
    with pytest.raises(
        ThdCapacityError, match=r"holds 3 sequences .* at most 2; raise --cg-thd-max-seqs to at least 3"
    ):
        graphs.fixed_offsets(torch.tensor([0, 1, 2, 3], dtype=torch.int32), 3)
    assert graphs.fixed_offsets(torch.tensor([0, 1, 2], dtype=torch.int32), 3).tolist() == [0, 1, 2]  # exact fit
    with pytest.raises(ThdCapacityError, match="--cg-thd-max-seqs"):
        PackedLayout(max_seqs=1, max_seqlen=8).sample_offsets(2)  # two samples hold two documents at least


@pytest.mark.parametrize(
    "offsets", [torch.tensor([0.0, 4.0]), torch.zeros(0, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)]
)
def test_offsets_that_are_no_offsets_are_refused(offsets):
    with pytest.raises(PackedFormError, match="non-empty 1-D integer tensor"):
        graphs.fixed_offsets(offsets, 4)


# -- the layout at the model's entry ----------------------------------------------------------------


def test_fixed_params_hold_the_capacity_and_the_bound():
    raw = params_of([0, 5, 9, 16], longest=7, tokens_per_sample=16)
    fixed = graphs.fixed_params(raw, LAYOUT)
    assert fixed is not raw and raw.cu_seqlens_q.tolist() == [0, 5, 9, 16]  # the caller's params stay as they were
    assert fixed.cu_seqlens_q.tolist() == [0, 5, 9, 16, 16, 16, 16]
    assert fixed.cu_seqlens_kv is fixed.cu_seqlens_q and fixed.cu_seqlens_q_padded is None
    assert (fixed.max_seqlen_q, fixed.max_seqlen_kv, fixed.tokens_per_sample) == (16, 16, 16)
    again = graphs.fixed_params(raw, LAYOUT)
    assert (
        again.cu_seqlens_q is not fixed.cu_seqlens_q
    )  # a new tensor per microbatch (a pending backward reads the old)
    same = params_of([0, 5, 16], longest=11)
    same = dataclasses.replace(same, cu_seqlens_q_padded=same.cu_seqlens_q, cu_seqlens_kv_padded=same.cu_seqlens_q)
    assert graphs.fixed_params(same, LAYOUT).cu_seqlens_q_padded is None  # padded is the offsets: one form


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(cu_seqlens_q_padded=torch.tensor([0, 6, 16], dtype=torch.int32)), "padding between sequences"),
        (dict(cu_seqlens_kv=torch.tensor([0, 5, 16], dtype=torch.int32)), "self-attention"),
        (dict(pad_between_seqs=True), "pad_between_seqs"),
    ],
)
def test_forms_the_layout_does_not_carry_are_refused(change, match):
    with pytest.raises(PackedFormError, match=match):
        graphs.fixed_params(dataclasses.replace(params_of([0, 5, 16], longest=11), **change), LAYOUT)


def test_a_document_longer_than_the_bound_is_refused_naming_the_flag():
    with pytest.raises(
        ThdCapacityError,
        match="longest sequence holds 17 tokens but graphs were captured for at most "
        "16; raise --cg-thd-max-seqlen to at least 17, or drop it",
    ):
        graphs.fixed_params(dataclasses.replace(params_of([0, 5, 16], longest=11), max_seqlen_kv=17), LAYOUT)
    short = PackedLayout(max_seqs=6, max_seqlen=11, seq_length=16)
    assert graphs.fixed_params(params_of([0, 5, 16], longest=11), short).max_seqlen_q == 11  # exact fit
    with pytest.raises(ThdCapacityError, match="at least 12"):
        graphs.fixed_params(params_of([0, 4, 16], longest=12), short)


def test_without_megatrons_bound_the_longest_document_is_read_from_the_offsets():
    """A document longer than the captured max_seqlen would be computed wrongly: no bound is no pass."""
    short = PackedLayout(max_seqs=6, max_seqlen=8, seq_length=16)
    with pytest.raises(ThdCapacityError, match=r"longest sequence holds 9 tokens .* --cg-thd-max-seqlen to at least 9"):
        graphs.fixed_params(params_of([0, 7, 16]), short)
    fixed = graphs.fixed_params(params_of([0, 8, 16]), short)
    assert (fixed.max_seqlen_q, fixed.max_seqlen_kv) == (8, 8)
    assert graphs.longest_sequence(torch.tensor([0, 3, 10, 12])) == 7
    assert graphs.longest_sequence(torch.tensor([0.0, 4.0])) == 0  # fixed_offsets names what is wrong


def test_the_layout_takes_the_bound_from_the_flag():
    assert graphs.layout_of(PluginConfig(thd_max_seqs=32), 4096) == PackedLayout(32, 4096, seq_length=4096)
    layout = graphs.layout_of(PluginConfig(thd_max_seqs=32, thd_max_seqlen=600), 4096)
    assert (layout.max_seqs, layout.max_seqlen, layout.sample_tokens) == (32, 600, 4096)
    assert graphs.layout_of(PluginConfig(thd_max_seqlen=600), 4096) is None  # the rules refuse it alone
    with pytest.raises(ValueError, match="--cg-thd-max-seqlen 5000 exceeds --seq-length 4096"):
        graphs.layout_of(PluginConfig(thd_max_seqs=32, thd_max_seqlen=5000), 4096)


def test_the_sample_layout_covers_every_token_in_documents_of_the_bound():
    layout = PackedLayout(max_seqs=8, max_seqlen=6, seq_length=16)
    assert layout.sample_offsets(2) == (0, 6, 12, 16, 22, 28, 32, 32, 32)  # two samples of 6 + 6 + 4 tokens
    offsets = graphs.capture_params(torch.tensor(layout.sample_offsets(2), dtype=torch.int32), layout)
    assert offsets.max_seqlen_q == 6
    with pytest.raises(ThdCapacityError, match="raise --cg-thd-max-seqs to at least 9"):
        layout.sample_offsets(3)


# -- capture and replay -----------------------------------------------------------------------------


def test_a_replay_takes_only_the_fixed_layout():
    fixed = graphs.fixed_params(params_of([0, 5, 16], longest=11), LAYOUT)
    assert graphs.graph_input(fixed, LAYOUT, "layer 1") is fixed.cu_seqlens_q
    with pytest.raises(
        PackedFormError,
        match=r"layer 2: .*cu_seqlens_q shape \(3,\) \(captured: \(7,\)\); "
        r"max_seqlen_q 11 \(captured: 16\)",
    ):
        graphs.graph_input(params_of([0, 5, 16], longest=11), LAYOUT, "layer 2")


def test_the_capture_params_are_what_the_layout_makes():
    offsets = torch.tensor(LAYOUT.sample_offsets(1), dtype=torch.int32)
    params = graphs.capture_params(offsets, LAYOUT)
    assert graphs.graph_input(params, LAYOUT, "capture") is offsets
    assert (params.qkv_format, params.pad_between_seqs, params.local_cp_size) == ("thd", None, None)


def _sample(rows=8, mbs=1, attention=True, rope=None):
    hidden = torch.ones(rows, mbs, 4, dtype=torch.bfloat16, requires_grad=True)
    kwargs = {"attention_mask": torch.ones(mbs, 1, rows, rows, dtype=torch.bool)} if attention else {}
    if attention and rope is not None:
        kwargs["rotary_pos_emb"] = torch.zeros(rows * mbs, 1, 1, 2)  # Megatron's table of the unpacked length
    return (hidden,), kwargs


def test_sample_inputs_are_a_packed_microbatch():
    rope = torch.arange(16.0).view(16, 1, 1, 1)
    layer1, layer2, mlp_only = _sample(rope=rope), _sample(rope=rope), _sample(attention=False)
    args, kwargs = graphs.sample_inputs(
        [layer1[0], layer2[0], layer1[0], mlp_only[0]],
        [layer1[1], layer2[1], layer1[1], mlp_only[1]],
        LAYOUT,
        micro_batch_size=1,
        rope=rope,
    )
    assert args[0][0] is layer1[0][0]  # micro-batch size 1: Megatron's hidden states are already the stream's shape
    assert set(kwargs[0]) == {"rotary_pos_emb", THD_KWARG}  # no attention mask for a THD batch
    assert kwargs[0]["rotary_pos_emb"] is rope
    assert kwargs[0][THD_KWARG].dtype == torch.int32 and kwargs[0][THD_KWARG].tolist() == list(LAYOUT.sample_offsets(1))
    assert kwargs[1][THD_KWARG] is not kwargs[0][THD_KWARG]  # each layer's own static buffer
    assert args[2] is args[0] and kwargs[2] is kwargs[0]  # shared by Megatron: shared still
    assert kwargs[3] == {}  # attention not graphed there: nothing of the layout


def test_sample_hidden_states_of_several_samples_are_the_flattened_stream():
    (args,), _ = graphs.sample_inputs(
        [_sample(rows=8, mbs=2, attention=False)[0]], [{}], LAYOUT, micro_batch_size=2, rope=None
    )
    (hidden,) = args
    assert hidden.shape == (16, 1, 4) and hidden.dtype == torch.bfloat16 and hidden.requires_grad


def test_the_helper_samples_only_for_a_packed_run():
    helper = types.SimpleNamespace(
        session=RunSession(PluginConfig()), seq_length=16, micro_batch_size=1, chunks_with_decoder=[None]
    )
    sample = [_sample()[0]], [_sample()[1]]
    assert graphs.helper_sample_inputs(helper, *sample) == sample
    helper.session = RunSession(PluginConfig(thd_max_seqs=6))
    _, kwargs = graphs.helper_sample_inputs(helper, *sample)
    assert kwargs[0][THD_KWARG].shape == (7,)


# -- the patches' wrappers --------------------------------------------------------------------------


@pytest.fixture
def packed_session():
    session = RunSession(PluginConfig(thd_max_seqs=6))
    session.settings = RunSettings(seq_length=16)  # as the rules' check leaves them: the job's --seq-length
    return session


class FakeGPT:
    """GPTModel.forward's signature, recording what it was given."""

    def __init__(self, training=True):
        self.training = training
        self.seen = None

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        decoder_input=None,
        labels=None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs=None,
    ):
        self.seen = packed_seq_params
        return "out"


def test_the_model_entry_lays_training_microbatches_out(packed_session):
    forward = graphs.build_thd_layout(FakeGPT.forward, packed_session)
    model, raw = FakeGPT(), params_of([0, 5, 16], longest=11)
    assert forward(model, 1, 2, None, packed_seq_params=raw) == "out"
    assert model.seen.cu_seqlens_q.shape == (7,) and model.seen.max_seqlen_q == 16
    forward(model, 1, 2, None, None, None, None, raw)  # passed by position too
    assert model.seen.cu_seqlens_q.shape == (7,)
    with pytest.raises(ThdCapacityError, match="--cg-thd-max-seqs"):
        forward(model, 1, 2, None, packed_seq_params=params_of([*range(0, 16, 2), 16], longest=2))
    for untouched in (dataclasses.replace(raw, local_cp_size=2), None):  # hybrid CP's own packs; unpacked batches
        forward(model, 1, 2, None, packed_seq_params=untouched)
        assert model.seen is untouched
    evaluating = FakeGPT(training=False)
    forward(evaluating, 1, 2, None, packed_seq_params=raw)
    assert evaluating.seen is raw  # eval steps run eagerly: Megatron's own layout


def test_the_model_entry_takes_the_sequence_length_from_the_runs_settings(packed_session):
    packed_session.take_settings(RunSettings(seq_length=32))  # the rules passed them: not the job's 16
    forward = graphs.build_thd_layout(FakeGPT.forward, packed_session)
    model = FakeGPT()
    forward(model, 1, 2, None, packed_seq_params=params_of([0, 5, 16], longest=11))
    assert model.seen.max_seqlen_q == 32


def test_a_packed_layout_without_the_runs_settings_names_what_to_do():
    forward = graphs.build_thd_layout(FakeGPT.forward, RunSession(PluginConfig(thd_max_seqs=6)))
    with pytest.raises(RuntimeError, match=r"--cg-thd-max-seqs .* call megatron_cg_plugin.install\(\) before"):
        forward(FakeGPT(), 1, 2, None, packed_seq_params=params_of([0, 5, 16], longest=11))


def test_the_model_entry_passes_through_without_the_flag(monkeypatch):
    forward = graphs.build_thd_layout(FakeGPT.forward, RunSession(PluginConfig()))
    model, raw = FakeGPT(), params_of([0, 5, 16], longest=11)
    forward(model, 1, 2, None, packed_seq_params=raw)
    assert model.seen is raw


class FakeLayer:
    def __init__(self, modules=()):
        self.config = types.SimpleNamespace(cuda_graph_modules=list(modules))
        self.layer_number = 3
        self.calls = []

    def replay(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "replayed"


@pytest.mark.parametrize("modules", [(), ("attn",)])
def test_a_replay_hands_the_offsets_to_the_graph(packed_session, modules):
    replay = graphs.build_replay(FakeLayer.replay, packed_session)
    layer = FakeLayer(modules)
    fixed = graphs.fixed_params(params_of([0, 5, 16], longest=11), graphs.layout_of(packed_session.config, 16))
    assert (
        replay(layer, hidden_states="h", attention_mask=None, packed_seq_params=fixed, rotary_pos_emb="table")
        == "replayed"
    )
    ((_, kwargs),) = layer.calls
    assert kwargs == {"hidden_states": "h", "rotary_pos_emb": "table", THD_KWARG: fixed.cu_seqlens_q}
    with pytest.raises(PackedFormError, match=r"layer 3: .*attention mask"):
        replay(layer, hidden_states="h", attention_mask=torch.ones(1), packed_seq_params=fixed)
    with pytest.raises(
        PackedFormError, match="layer 3: a packed microbatch reached the graph outside the fixed layout"
    ):
        replay(layer, hidden_states="h", packed_seq_params=params_of([0, 5, 16], longest=11))


def test_replays_the_layout_does_not_serve_are_megatrons(packed_session):
    replay = graphs.build_replay(FakeLayer.replay, packed_session)
    raw = params_of([0, 5, 16], longest=11)
    mlp = FakeLayer(("mlp",))  # attention runs eagerly with the params in Megatron's replay
    replay(mlp, hidden_states="h", packed_seq_params=raw)
    assert mlp.calls[0][1]["packed_seq_params"] is raw
    plain = FakeLayer()
    replay(plain, hidden_states="h", attention_mask=None)
    hybrid = dataclasses.replace(raw, local_cp_size=1)
    replay(plain, hidden_states="h", packed_seq_params=hybrid)
    assert [kwargs.get("packed_seq_params") for _, kwargs in plain.calls] == [None, hybrid]
    unconfigured = graphs.build_replay(FakeLayer.replay, RunSession(PluginConfig()))
    unconfigured(plain, hidden_states="h", packed_seq_params=raw)
    assert plain.calls[-1][1]["packed_seq_params"] is raw  # Megatron's own assert explains (the rule refused first)


def test_the_capture_turns_the_graph_input_into_params(packed_session):
    captured = []
    capture = graphs.build_capture(lambda self, *args, **kwargs: captured.append(kwargs), packed_session)
    offsets = torch.tensor(LAYOUT.sample_offsets(1), dtype=torch.int32)
    capture(object(), "h", rotary_pos_emb="table", **{THD_KWARG: offsets})
    capture(object(), "h", attention_mask=None)  # an unpacked capture (graph banks pass their own params)
    packed, plain = captured
    assert set(packed) == {"rotary_pos_emb", "packed_seq_params"} and plain == {"attention_mask": None}
    assert packed["packed_seq_params"].cu_seqlens_q is offsets and packed["packed_seq_params"].max_seqlen_q == 16


# -- the planner ------------------------------------------------------------------------------------


def test_the_planner_counts_the_static_offsets():
    packed = RunSettings(cuda_graph_impl="transformer_engine", inter_document_masking=True, thd_max_seqs=31)
    assert thd_buffer_bytes(packed, 4) == 4 * 32 * 4  # per graph: --cg-thd-max-seqs + 1 int32 entries
    assert thd_buffer_bytes(dataclasses.replace(packed, modules=("mlp",)), 4) == 0  # attention eager: no offsets
    assert thd_buffer_bytes(dataclasses.replace(packed, thd_max_seqs=None), 4) is None
    assert thd_buffer_bytes(dataclasses.replace(packed, cuda_graph_impl="none"), 4) is None


# -- the launcher's packed batches --------------------------------------------------------------------


def test_the_launchers_params_are_megatrons_script_s():
    from megatron_cg_plugin.packed.batches import packed_batch_params, with_packed_keys

    batch = with_packed_keys(
        {
            "tokens": torch.zeros(1, 16),
            "cu_seqlens": torch.tensor([[0, 5, 12, 16]], dtype=torch.int32),
            "max_seqlen": torch.tensor([7]),
        }
    )
    assert batch["cu_seqlens_padded"] is None  # Megatron's broadcast reads the key under CP
    params = packed_batch_params(batch, tokens_per_sample=16)
    assert params.cu_seqlens_q.tolist() == [0, 5, 12, 16] and params.cu_seqlens_kv is params.cu_seqlens_q
    assert (params.max_seqlen_q, params.cu_seqlens_q_padded, params.tokens_per_sample) == (7, None, 16)
    assert graphs.fixed_params(params, LAYOUT).cu_seqlens_q.shape == (7,)  # what the layout then makes of it
    assert packed_batch_params(with_packed_keys({"tokens": torch.zeros(1, 16)}), tokens_per_sample=16) is None
