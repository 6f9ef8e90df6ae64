"""Tests for megatron_cg_plugin.compat: version parsing, the supported ranges, signature probes."""

from __future__ import annotations

import functools
import importlib.metadata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_cg_plugin import compat
from megatron_cg_plugin.compat import (
    SignatureMismatchError,
    UnsupportedVersionError,
    Versions,
    check_parameters,
    check_versions,
    parse_version,
)

MCORE_RANGE = ">=0.19.2,<0.20.0"
TE_RANGE = "transformer-engine>=2.20.0,<2.21.0"

GOOD = Versions(torch="2.9.0", megatron_core="0.19.2", transformer_engine="2.20.0")


def versions(**overrides) -> Versions:
    fields = {"torch": GOOD.torch, "megatron_core": GOOD.megatron_core, "transformer_engine": GOOD.transformer_engine}
    fields.update(overrides)
    return Versions(**fields)


# ---------------------------------------------------------------- parse_version


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2.20.2+cu130", (2, 20, 2)),
        ("0.19.2rc1", (0, 19, 2)),
        ("2.9", (2, 9, 0)),
        ("3", (3, 0, 0)),
        ("2.14.1+cu130", (2, 14, 1)),
        ("2.20.0.dev0+abc123", (2, 20, 0)),
        ("  0.19.10 ", (0, 19, 10)),
        ("10.0.1a0", (10, 0, 1)),
    ],
)
def test_parse_version(text, expected):
    assert parse_version(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "garbage", "v2.9", "+cu130", "rc1", ".19.2"])
def test_parse_version_garbage_raises(text):
    with pytest.raises(ValueError, match="cannot read a version number"):
        parse_version(text)


def test_parse_version_orders_numerically_not_lexically():
    assert parse_version("0.19.10") > parse_version("0.19.2")
    assert parse_version("2.9") < parse_version("2.14.1+cu130")


# ---------------------------------------------------------------- check_versions


@pytest.mark.parametrize(
    "v",
    [
        GOOD,
        Versions("2.14.1+cu130", "0.19.2", "2.20.2+cu130"),
        Versions("2.9", "0.19.9", "2.20.99"),
        Versions("3.0.0", "0.19.2rc1", "2.20.0.dev0"),
    ],
)
def test_supported_versions_pass(v):
    for require_te in (False, True):
        check_versions(v, require_te=require_te)  # no exception


@pytest.mark.parametrize("mcore", ["0.19.1", "0.20.0", "0.18.0", "0.20.0rc0", "1.0.0", "0.9.2"])
def test_megatron_core_outside_range_names_range(mcore):
    with pytest.raises(UnsupportedVersionError) as info:
        check_versions(versions(megatron_core=mcore), require_te=False)
    message = str(info.value)
    assert MCORE_RANGE in message
    assert f"megatron-core {mcore}" in message


def test_megatron_core_missing_raises_naming_range():
    with pytest.raises(UnsupportedVersionError, match="megatron-core is not installed") as info:
        check_versions(versions(megatron_core=None), require_te=False)
    assert "megatron-core" + MCORE_RANGE in str(info.value)


@pytest.mark.parametrize("te", ["2.19.0", "2.21.0", "2.19.9+cu130", "1.20.0", "3.0"])
@pytest.mark.parametrize("require_te", [False, True])
def test_transformer_engine_outside_range_names_te_range(te, require_te):
    with pytest.raises(UnsupportedVersionError) as info:
        check_versions(versions(transformer_engine=te), require_te=require_te)
    message = str(info.value)
    assert TE_RANGE in message
    assert f"transformer-engine {te}" in message
    assert MCORE_RANGE not in message  # the TE range, not megatron-core's


def test_transformer_engine_missing_allowed_when_not_required():
    check_versions(versions(transformer_engine=None), require_te=False)


def test_transformer_engine_missing_refused_when_required():
    with pytest.raises(UnsupportedVersionError) as info:
        check_versions(versions(transformer_engine=None), require_te=True)
    message = str(info.value)
    assert "megatron-cg-plugin[te]" in message
    assert TE_RANGE in message


@pytest.mark.parametrize("torch_version", ["2.8", "2.8.0+cu128", "1.13.1", "2.8.99"])
def test_old_torch_raises(torch_version):
    with pytest.raises(UnsupportedVersionError, match=r"torch >= 2\.9\.0") as info:
        check_versions(versions(torch=torch_version), require_te=False)
    assert f"torch {torch_version}" in str(info.value)


def test_first_offending_package_is_named():
    bad_everything = Versions("2.8.0", "0.18.0", "2.19.0")
    with pytest.raises(UnsupportedVersionError, match=r"torch 2\.8\.0"):
        check_versions(bad_everything, require_te=True)
    with pytest.raises(UnsupportedVersionError, match=r"megatron-core 0\.18\.0"):
        check_versions(versions(megatron_core="0.18.0", transformer_engine="2.19.0"), require_te=True)


# Boundary-heavy parts so both sides of each range bound are drawn often.
_part = st.one_of(st.sampled_from([0, 1, 2, 3, 9, 18, 19, 20, 21, 22]), st.integers(0, 99))


@given(st.tuples(_part, _part, _part))
def test_megatron_core_range_property(version):
    text = ".".join(map(str, version))
    inside = (0, 19, 2) <= version < (0, 20, 0)
    if inside:
        check_versions(versions(megatron_core=text), require_te=False)
    else:
        with pytest.raises(UnsupportedVersionError, match=MCORE_RANGE):
            check_versions(versions(megatron_core=text), require_te=False)


@given(st.tuples(_part, _part, _part))
def test_transformer_engine_range_property(version):
    text = ".".join(map(str, version))
    if (2, 20, 0) <= version < (2, 21, 0):
        check_versions(versions(transformer_engine=text), require_te=True)
    else:
        with pytest.raises(UnsupportedVersionError, match=TE_RANGE):
            check_versions(versions(transformer_engine=text), require_te=True)


# ---------------------------------------------------------------- probes


def test_installed_versions_reads_metadata_here():
    import torch

    found = compat.installed_versions()
    assert found.torch == torch.__version__
    assert found.megatron_core == importlib.metadata.version("megatron-core")


def test_installed_versions_reports_missing_distribution_as_none(monkeypatch):
    real = importlib.metadata.version

    def fake_version(name):
        if name.replace("_", "-") == "transformer-engine":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    assert compat.installed_versions().transformer_engine is None


def _target(model, config, seq_length, micro_batch_size, optimizers=(), *, pg_collection=None):
    pass


def test_check_parameters_accepts_present_parameters():
    check_parameters(_target, ("model", "config", "optimizers", "pg_collection"), where="x.y")
    check_parameters(_target, (), where="x.y")


def test_check_parameters_names_the_missing_parameter():
    with pytest.raises(SignatureMismatchError) as info:
        check_parameters(_target, ("model", "num_zeros_in_grad"), where="megatron.fake.fn")
    message = str(info.value)
    assert "megatron.fake.fn" in message
    assert "num_zeros_in_grad" in message
    assert "no longer takes parameter(s) num_zeros_in_grad " in message  # only the missing one listed


def test_check_parameters_names_every_missing_parameter():
    with pytest.raises(SignatureMismatchError, match=r"parameter\(s\) alpha, beta \(has: model, config"):
        check_parameters(_target, ("alpha", "model", "beta"), where="w")


FORWARD_ATTENTION = "megatron.core.transformer.transformer_layer:TransformerLayer._forward_attention"
ATTENTION_PARAMS = ("attention_mask", "rotary_pos_emb", "packed_seq_params")


def _forward_attention(self, hidden_states, attention_mask, rotary_pos_emb=None, packed_seq_params=None):
    pass


def _users_patch(self, *args, **kwargs):  # a user's patch without functools.wraps: nothing to follow
    return _forward_attention(self, *args, **kwargs)


def _changed_release(self, hidden_states, mask):  # megatron-core's own function, changed
    pass


_changed_release.__module__ = "megatron.core.fake"
_changed_release.__qualname__ = "TransformerLayer._forward_attention"


def _mismatch(target, expected=ATTENTION_PARAMS, where=FORWARD_ATTENTION) -> str:
    with pytest.raises(SignatureMismatchError) as info:
        check_parameters(target, expected, where=where)
    return str(info.value)


def test_a_functools_wraps_wrapper_passes_when_the_function_it_wraps_takes_the_parameters():
    @functools.wraps(_forward_attention)
    def wrapper(*args, **kwargs):
        return _forward_attention(*args, **kwargs)

    check_parameters(wrapper, ATTENTION_PARAMS, where=FORWARD_ATTENTION)
    check_parameters(functools.wraps(wrapper)(lambda *a, **k: None), ATTENTION_PARAMS, where=FORWARD_ATTENTION)


def test_a_wrapper_loop_or_a_raising_proxy_ends_the_chain_without_an_error_of_its_own():
    def outer(*args, **kwargs):
        pass

    def inner(self, attention_mask, rotary_pos_emb, packed_seq_params):
        pass

    outer.__wrapped__, inner.__wrapped__ = inner, outer  # inspect.unwrap raises on this loop
    check_parameters(outer, ATTENTION_PARAMS, where=FORWARD_ATTENTION)

    class Proxy:
        @property
        def __wrapped__(self):
            raise RuntimeError("a lazy proxy that is not ready")

        def __call__(self, attention_mask, rotary_pos_emb, packed_seq_params):
            pass

    check_parameters(Proxy(), ATTENTION_PARAMS, where=FORWARD_ATTENTION)
    assert "Proxy instance, defined outside megatron-core" in _mismatch(Proxy(), ("hidden_states",))


def test_a_wrapper_from_elsewhere_is_named_and_not_blamed_on_the_build():
    message = _mismatch(_users_patch)
    assert f"Found {__name__}._users_patch, defined outside megatron-core" in message
    assert "looks wrapped by another library or your own patch" in message
    assert "apply that patch after megatron_cg_plugin.install(), or remove it" in message
    assert "build differs" not in message
    assert (
        "no longer takes parameter(s) attention_mask, rotary_pos_emb, packed_seq_params (has: self, args, kwargs)"
        in message
    )


def test_a_wraps_wrapper_around_a_function_from_elsewhere_names_both():
    def users_function(self, hidden_states):
        pass

    wrapper = functools.wraps(users_function)(lambda *args, **kwargs: None)
    wrapper.__module__, wrapper.__qualname__ = "other_library.patches", "wrap"
    message = _mismatch(wrapper)
    assert (
        f"Found other_library.patches.wrap, which wraps {__name__}.{users_function.__qualname__}, defined "
        "outside megatron-core: it looks wrapped"
    ) in message
    assert "(has: self, hidden_states)" in message  # what runs in the end


def test_a_changed_library_function_still_blames_the_build():
    message = _mismatch(_changed_release)
    assert (
        "Found megatron.core.fake.TransformerLayer._forward_attention: this megatron-core build differs from "
        "the supported release; install the supported versions listed in docs/versions.md" in message
    )
    assert "wrapped" not in message
    # Wrapped by someone else, the function at the end of the chain is still the library's own, changed.
    wrapper = functools.wraps(_changed_release)(lambda *args, **kwargs: None)
    wrapper.__module__, wrapper.__qualname__ = "other_library.patches", "wrap"
    assert (
        "Found other_library.patches.wrap, which wraps megatron.core.fake.TransformerLayer._forward_attention: "
        "this megatron-core build differs" in _mismatch(wrapper)
    )


def test_the_library_a_function_must_come_from_follows_where():
    te = "transformer_engine.pytorch.graph:save_fp8_tensors"
    assert "defined outside Transformer Engine: it looks wrapped" in _mismatch(_changed_release, ("modules",), te)
    assert "defined outside megatron-core, TE and torch" in _mismatch(_users_patch, where="Renamed.forward")
    assert "this megatron-core/TE build differs" in _mismatch(_changed_release, where="Renamed.forward")


def test_check_parameters_on_a_class_init():
    class Helper:
        def __init__(self, model, config):
            pass

    check_parameters(Helper.__init__, ("model", "config"), where="Helper")
    with pytest.raises(SignatureMismatchError, match="optimizers"):
        check_parameters(Helper.__init__, ("model", "optimizers"), where="Helper")
