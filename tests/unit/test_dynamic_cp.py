"""Hybrid CP on CPU: the CP group a microbatch's RoPE uses, the attention subclass that applies it
for one call only, and the layer-spec adaptation (attention and banked layer classes swapped in).
Numerics (CP-2 RoPE equal to CP 1) run on GPUs: tests/functional/test_graph_banks.py."""

from __future__ import annotations

import types
import warnings

import pytest

from megatron_cg_plugin.banks.dynamic_cp import adapt_layer_spec, dynamic_cp_attention_class, microbatch_cp_group


class Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def params(size=None, group=None):
    return types.SimpleNamespace(local_cp_size=size, cp_group=group)


def test_microbatch_group():
    static, pair = Group(1), Group(2)
    assert microbatch_cp_group(None, static) is static  # no packed sequences
    assert microbatch_cp_group(params(), static) is static  # static CP: no local size
    assert microbatch_cp_group(params(1), static) is static
    assert microbatch_cp_group(params(2, pair), static) is pair
    with pytest.raises(ValueError, match="--context-parallel-size 1"):
        microbatch_cp_group(params(1), Group(2))
    with pytest.raises(ValueError, match="local_cp_size 4 but its cp_group has 2 ranks"):
        microbatch_cp_group(params(4, pair), static)
    with pytest.raises(ValueError, match="has None ranks"):
        microbatch_cp_group(params(2, None), static)


class FakeAttention:
    """Megatron's attention reads ``self.pg_collection.cp`` when it applies RoPE."""

    def __init__(self, collection):
        self.pg_collection = collection
        self.seen = []

    def forward(self, hidden, packed_seq_params=None, rotary_pos_emb=None, fail=False):
        self.seen.append(self.pg_collection.cp)
        if fail:
            raise RuntimeError("attention failed")
        return hidden


def test_attention_uses_the_microbatch_group_for_one_call_only():
    static, pair = Group(1), Group(2)
    shared = types.SimpleNamespace(cp=static, tp="tp")
    attention = dynamic_cp_attention_class(FakeAttention)(shared)
    assert attention.forward("h", packed_seq_params=params(2, pair)) == "h"
    assert attention.seen == [pair]
    assert attention.pg_collection is shared and shared.cp is static  # the shared collection is untouched
    attention.forward("h", packed_seq_params=params(1))
    attention.forward("h")
    assert attention.seen == [pair, static, static]
    with pytest.raises(RuntimeError, match="attention failed"):
        attention.forward("h", packed_seq_params=params(2, pair), fail=True)
    assert attention.pg_collection is shared


def test_an_attention_whose_forward_lost_the_packed_parameters_is_refused():
    from megatron_cg_plugin.compat import SignatureMismatchError

    class Renamed:
        def forward(self, hidden, packed_params=None, rotary_pos_emb=None):
            return hidden

    with pytest.raises(
        SignatureMismatchError, match=r"Renamed.forward no longer takes parameter\(s\) packed_seq_params"
    ):
        dynamic_cp_attention_class(Renamed)


def local_layer_spec():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Apex missing: torch norms
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec()


def test_layer_spec_adaptation():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    original = local_layer_spec()
    spec = adapt_layer_spec(original, rope=True, banks=True)
    assert original.module is TransformerLayer and original.submodules.self_attention.module is SelfAttention
    assert issubclass(spec.module, TransformerLayer) and spec.module.graph_banks
    attention = spec.submodules.self_attention.module
    assert issubclass(attention, SelfAttention) and attention.__name__ == "DynamicCpSelfAttention"
    plain = adapt_layer_spec(local_layer_spec(), rope=False, banks=False)
    assert plain.module is TransformerLayer and plain.submodules.self_attention.module is SelfAttention
    block = types.SimpleNamespace(layer_specs=[local_layer_spec(), local_layer_spec()])
    adapted = adapt_layer_spec(block, rope=False, banks=True)
    assert all(getattr(s.module, "graph_banks", False) for s in adapted.layer_specs)


def test_a_layer_spec_listed_once_per_layer_is_adapted_once():
    """Megatron's MoE block specs list one layer spec object for every layer: wrapping it again per
    layer would make a subclass of a subclass (and its signature check would see *args)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    shared = local_layer_spec()
    adapted = adapt_layer_spec(types.SimpleNamespace(layer_specs=[shared, shared, shared]), rope=True, banks=True)
    for layer_spec in adapted.layer_specs:
        assert layer_spec.module.__bases__ == (TransformerLayer,)
        assert layer_spec.submodules.self_attention.module.__bases__ == (SelfAttention,)


def test_layer_specs_other_than_transformer_layers_are_refused():
    from megatron.core.transformer.spec_utils import ModuleSpec

    with pytest.raises(ValueError, match="supports TransformerLayer specs"):
        adapt_layer_spec(ModuleSpec(module=object), rope=True, banks=False)
