"""The banked layer class on CPU: routing by CP size and group, THD layout checks, eager fallback,
fail-closed refusals and the per-bank report. Capture itself runs on GPUs
(tests/functional/test_graph_banks.py)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_cg_plugin.banks import BankRouter, BankSelectionError, GraphBank
from megatron_cg_plugin.capture.banked import BankedLayers, BankReplayError, ThdCapacity, banked_layer_class
from megatron_cg_plugin.plan.thd import ThdCapacityError

CAPACITY = ThdCapacity(tokens_per_rank=8, max_seqs=2)


class FakeLayer(torch.nn.Module):
    """Stands for Megatron's TransformerLayer: its own call returns ("eager", context)."""

    layer_number = 3

    def __call__(self, *args, **kwargs):
        return "eager", kwargs.get("context")


def packed(cp_size=1, group=None, cu_length=4, max_seqlen=8):
    cu = torch.zeros(cu_length, dtype=torch.int32)
    return types.SimpleNamespace(local_cp_size=cp_size, cp_group=group, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=max_seqlen)


@pytest.fixture
def banked():
    group = object()
    calls = []

    def payload(size):
        return lambda hidden, cu, cu_padded: calls.append((size, hidden, cu, cu_padded)) or f"graph cp{size}"

    layer = banked_layer_class(FakeLayer)()
    vars(layer)["_bank_router"] = BankRouter({1: GraphBank(1, None, payload(1)), 2: GraphBank(2, group, payload(2))})
    vars(layer)["_bank_capacity"] = CAPACITY
    return layer, group, calls


def test_the_bank_of_the_microbatch_cp_size_replays(banked):
    layer, group, calls = banked
    hidden = torch.ones(8, 1, 4)
    assert layer(hidden_states=hidden, packed_seq_params=packed()) == ("graph cp1", None)
    params = packed(2, group, max_seqlen=16)
    assert layer(hidden, packed_seq_params=params) == ("graph cp2", None)
    assert [c[0] for c in calls] == [1, 2] and calls[1][1] is hidden and calls[1][2] is params.cu_seqlens_q
    assert vars(layer)["_bank_router"].report() == [{"cp_size": 1, "replays": 1, "rejected": 0},
                                                    {"cp_size": 2, "replays": 1, "rejected": 0}]


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
    with pytest.raises(ThdCapacityError, match="captured for \\(4,\\): 2 sequences .* raise --cg-thd-max-seqs"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(cu_length=5))
    with pytest.raises(ThdCapacityError, match="max_seqlen 9 exceeds the captured bound 8"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(max_seqlen=9))
    with pytest.raises(BankReplayError, match="rotary_pos_emb"):
        layer(hidden_states=torch.ones(1), packed_seq_params=packed(), rotary_pos_emb=torch.ones(1))
    cross = packed()
    cross.cu_seqlens_kv = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(BankReplayError, match="self-attention"):
        layer(hidden_states=torch.ones(1), packed_seq_params=cross)
    assert calls == []


def test_report_sums_layers_and_reset_unbanks(banked):
    layer, group, _ = banked
    layer(hidden_states=torch.ones(1), packed_seq_params=packed())
    other = banked_layer_class(FakeLayer)()
    vars(other)["_bank_router"] = BankRouter({1: GraphBank(1, None, lambda *a: "g"), 2: GraphBank(2, group, None)})
    vars(other)["_bank_capacity"] = CAPACITY
    other(hidden_states=torch.ones(1), packed_seq_params=packed())
    with pytest.raises(BankSelectionError):
        other(hidden_states=torch.ones(1), packed_seq_params=packed(2, object()))
    layers = BankedLayers({1: vars(layer)["_bank_router"], 2: vars(other)["_bank_router"]}, {}, [layer, other])
    report = layers.report()
    assert report["banks"] == [{"cp_size": 1, "replays": 2, "rejected": 0}, {"cp_size": 2, "replays": 0, "rejected": 1}]
    layers.reset()
    assert "_bank_router" not in vars(layer) and "_bank_router" not in vars(other)
    assert layer(hidden_states=torch.ones(1), packed_seq_params=packed()) == ("eager", None)
