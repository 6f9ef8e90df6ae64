"""Tests for megatron_cg_plugin.installation and megatron_cg_plugin.patching.ledger, on the real
megatron-core installed here (no GPU, no Transformer Engine needed)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import subprocess
import sys
import types
import unittest.mock
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import megatron_cg_plugin
from megatron_cg_plugin import compat, foreign_state, host_stand_ins, installation
from megatron_cg_plugin.capture_lifecycle import PluginHelperMixin
from megatron_cg_plugin.compat import SignatureMismatchError, UnsupportedVersionError, Versions
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.patching import builders, ledger
from megatron_cg_plugin.patching.ledger import PATCHES, Patch, PatchSet
from megatron_cg_plugin.session import RunSession

training = importlib.import_module("megatron.training.training")
dataset_utils = importlib.import_module("megatron.core.datasets.utils")
global_vars = importlib.import_module("megatron.training.global_vars")

ORIGINAL_HELPER = training.TECudaGraphHelper
ORIGINAL_TRAINING_LOG = training.training_log
ORIGINAL_COMPILE_HELPERS = dataset_utils.compile_helpers

PATCH_BY_NAME = {patch.name: patch for patch in PATCHES}


def current() -> tuple:
    return (training.TECudaGraphHelper, training.training_log, dataset_utils.compile_helpers)


def _target(patch: Patch):
    owner, name = patch.locate()
    return getattr(owner, name)


# Every patch the CPU can apply (TE's needs Transformer Engine), by identity.
ORIGINALS = {patch.name: _target(patch) for patch in PATCHES if not patch.needs_te}


def assert_pristine() -> None:
    assert training.TECudaGraphHelper is ORIGINAL_HELPER
    assert training.training_log is ORIGINAL_TRAINING_LOG
    assert dataset_utils.compile_helpers is ORIGINAL_COMPILE_HELPERS
    assert {name: _target(PATCH_BY_NAME[name]) for name in ORIGINALS} == ORIGINALS
    assert installation.active_session() is None


def test_install_replaces_every_patch_target_and_uninstall_restores_each_by_identity():
    installation.install()
    for name, original in ORIGINALS.items():
        replaced = _target(PATCH_BY_NAME[name])
        assert replaced is not original, name
    installation.uninstall()
    for name, original in ORIGINALS.items():
        assert _target(PATCH_BY_NAME[name]) is original, name


@pytest.fixture(autouse=True)
def clean_install():
    installation.uninstall()
    assert_pristine()
    yield
    installation.uninstall()
    assert_pristine()


@pytest.fixture
def fake_module(monkeypatch):
    """A throwaway module registered in sys.modules, to be the target of patches."""
    made = []

    def make(name="fake_target", **attrs):
        module = types.ModuleType(f"{name}_{len(made)}_{id(made)}")
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        made.append(module)
        return module

    return make


# ---------------------------------------------------------------- install / uninstall


def test_install_replaces_each_target_and_uninstall_restores_by_identity():
    session = megatron_cg_plugin.install()

    assert isinstance(session, RunSession)
    assert installation.active_session() is session
    helper_cls, training_log, compile_helpers = current()
    assert helper_cls is not ORIGINAL_HELPER
    assert issubclass(helper_cls, ORIGINAL_HELPER)
    assert issubclass(helper_cls, PluginHelperMixin)
    assert helper_cls.session is session
    assert training_log is not ORIGINAL_TRAINING_LOG
    assert training_log.__wrapped__ is ORIGINAL_TRAINING_LOG
    assert inspect.signature(training_log) == inspect.signature(ORIGINAL_TRAINING_LOG)
    assert compile_helpers is not ORIGINAL_COMPILE_HELPERS
    assert compile_helpers.__wrapped__ is ORIGINAL_COMPILE_HELPERS

    megatron_cg_plugin.uninstall()
    assert_pristine()


def test_install_is_idempotent():
    session = installation.install()
    patched = current()
    assert installation.install() is session
    assert megatron_cg_plugin.install() is session
    assert current() == patched  # not patched twice (a wrapper of a wrapper)
    assert training.training_log.__wrapped__ is ORIGINAL_TRAINING_LOG


def test_install_with_equal_config_returns_same_session(tmp_path):
    config = PluginConfig(preset="tiny-gpt", metrics_out=tmp_path / "m.json")
    session = installation.install(config)
    assert session.config is config
    assert installation.install(PluginConfig(preset="tiny-gpt", metrics_out=tmp_path / "m.json")) is session
    assert installation.install(None) is session


def test_install_with_different_config_is_refused_and_changes_nothing():
    session = installation.install(PluginConfig(preset="tiny-gpt"))
    patched = current()
    with pytest.raises(RuntimeError, match="different config"):
        installation.install(PluginConfig(preset="tiny-moe"))
    assert current() == patched
    assert installation.active_session() is session
    assert session.config == PluginConfig(preset="tiny-gpt")
    assert training.TECudaGraphHelper.session is session


def test_uninstall_twice_and_without_install_is_harmless():
    installation.uninstall()  # never installed
    assert_pristine()
    installation.install()
    installation.uninstall()
    installation.uninstall()
    assert_pristine()


def test_install_again_after_uninstall():
    first = installation.install()
    installation.uninstall()
    second = installation.install(PluginConfig(preset="tiny-moe"))
    assert second is not first
    assert training.TECudaGraphHelper.session is second
    assert training.training_log.__wrapped__ is ORIGINAL_TRAINING_LOG
    assert dataset_utils.compile_helpers.__wrapped__ is ORIGINAL_COMPILE_HELPERS
    installation.uninstall()
    assert_pristine()


def test_install_refuses_unsupported_megatron_core_and_patches_nothing(monkeypatch):
    monkeypatch.setattr(compat, "installed_versions", lambda: Versions(torch.__version__, "0.18.0", None))
    with pytest.raises(UnsupportedVersionError, match=r">=0\.19\.2,<0\.20\.0"):
        installation.install()
    assert_pristine()


def test_install_refuses_unsupported_transformer_engine(monkeypatch):
    monkeypatch.setattr(compat, "installed_versions", lambda: Versions(torch.__version__, "0.19.2", "2.19.0"))
    with pytest.raises(UnsupportedVersionError, match="transformer-engine"):
        installation.install()
    assert_pristine()


def test_install_without_transformer_engine_is_allowed(monkeypatch):
    monkeypatch.setattr(compat, "installed_versions", lambda: Versions(torch.__version__, "0.19.2", None))
    assert installation.install() is installation.active_session()


def test_install_refuses_changed_megatron_signature_and_reverts(monkeypatch):
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration):  # no num_zeros_in_grad
        return None

    monkeypatch.setattr(training, "training_log", training_log)
    with pytest.raises(SignatureMismatchError, match="num_zeros_in_grad"):
        installation.install()
    assert training.TECudaGraphHelper is ORIGINAL_HELPER  # applied first, then reverted
    assert training.training_log is training_log
    assert dataset_utils.compile_helpers is ORIGINAL_COMPILE_HELPERS
    assert installation.active_session() is None


def test_install_is_transactional_when_a_later_patch_fails(monkeypatch, fake_module):
    target = fake_module(g=lambda a: a)
    failing = Patch(
        name="failing",
        module=target.__name__,
        attribute="g",
        reason="test",
        expected_params=("does_not_exist",),
        build=lambda original, session: original,
    )
    monkeypatch.setattr(installation, "PatchSet", lambda ledger: PatchSet((*ledger, failing)))
    with pytest.raises(SignatureMismatchError, match="does_not_exist"):
        installation.install()
    assert_pristine()
    monkeypatch.undo()
    assert installation.install() is installation.active_session()  # a later install still works


def test_real_patches_match_installed_megatron():
    assert [patch.name for patch in PATCHES] == [
        "plugin-args",
        "validate-args-rules",
        "train-step-timer",
        "train-end-report",
        "helper-swap",
        "training-log-tap",
        "evaluation-tap",
        "mtp-loss-tap",
        "prebuilt-dataset-helpers",
        "strided-weak-ref",
        "offload-reload-waits-for-its-copy",
        "packed-thd-layout",
        "packed-graph-capture",
        "packed-graph-replay",
    ]
    assert len({patch.where for patch in PATCHES}) == len(PATCHES)
    for patch in PATCHES:
        assert patch.reason.strip()
        if patch.needs_te:
            continue  # TE is not installable on CPU; its patch is checked on the GPU host
        patch.check(_target(patch))


def test_mtp_losses_are_recorded_with_the_iterations_other_metrics(probe):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    class Helper:  # shaped like Megatron's: adds each layer's reduced loss of the iteration
        tracker: ClassVar[dict] = {}

        @staticmethod
        def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
            for index, loss in enumerate(Helper.tracker.pop("losses", [])):
                name = f"mtp_{index + 1} loss"
                total_loss_dict[name] = total_loss_dict.get(name, 0.0) + loss * loss_scale
            return "Megatron's result"

    session = RunSession(PluginConfig(metrics_out=Path("unwritten-metrics.json")), probe=probe)
    tapped = builders.build_mtp_loss_tap(Helper, session)
    assert issubclass(tapped, Helper) and tapped.tracker is Helper.tracker
    totals = {"lm loss": 9.0, "mtp_1 loss": 4.0}  # accumulated since the last log line
    Helper.tracker["losses"] = [3.0, 5.0]
    assert tapped.track_mtp_metrics(0.5, 7, None, None, totals) == "Megatron's result"
    assert totals == {"lm loss": 9.0, "mtp_1 loss": 5.5, "mtp_2 loss": 2.5}  # Megatron's dict as it would be
    session.on_training_log(iteration=7, loss_dict={"lm loss": 2.0})
    values = session.metrics().metrics
    assert values["mtp_1 loss"].values == {7: 1.5} and values["mtp_2 loss"].values == {7: 2.5}
    session.on_training_log(iteration=8, loss_dict={"lm loss": 2.0})  # no MTP this time: nothing carried over
    assert 8 not in session.metrics().metrics["mtp_1 loss"].values
    builders.build_mtp_loss_tap(MTPLossLoggingHelper, session)  # the installed release's signature fits


# ---------------------------------------------------------------- deferred config


def test_install_without_config_or_parsed_args_gives_default_config():
    with pytest.raises(AssertionError):
        global_vars.get_args()  # nothing parsed Megatron's arguments in this process
    session = installation.install()
    assert session.config == PluginConfig()


def test_install_without_config_reads_cg_flags_when_training_starts(monkeypatch, tmp_path):
    session = installation.install()  # before Megatron parsed anything
    args = megatron_namespace(
        monkeypatch,
        "--no-gradient-accumulation-fusion",
        "--cg-preset",
        "tiny-moe",
        "--cg-metrics-out",
        str(tmp_path / "m.json"),
        "--cg-no-report",
    )
    monkeypatch.setattr(global_vars, "get_args", lambda: args)
    # used before Megatron's validation: the rules run on the parsed flags, the one path that reads them
    assert session.config == PluginConfig(preset="tiny-moe", metrics_out=tmp_path / "m.json", print_report=False)
    assert session.settings is not None and session.settings.num_layers == 2


def test_a_run_whose_flags_megatron_never_validated_gets_the_rules_as_training_starts(monkeypatch, capsys):
    """A --yaml-cfg run calls validate_yaml, not validate_args: the patched train() checks the flags
    first (the host's rules too), explicit config or not, and once only."""
    from megatron_cg_plugin.refusal import RunRefused

    parsed = {}

    def get_args():
        assert "args" in parsed, "not parsed yet"  # as Megatron's get_args before its parser ran
        return parsed["args"]

    monkeypatch.setattr(global_vars, "get_args", get_args)
    session = installation.install(PluginConfig())  # before Megatron parsed anything
    parsed["args"] = megatron_namespace(monkeypatch, "--no-gradient-accumulation-fusion")
    assert train_under(session) == "trained" and session.settings.num_layers == 2
    installation.uninstall()

    parsed.clear()
    session = installation.install(PluginConfig())
    parsed["args"] = megatron_namespace(monkeypatch, "--cuda-graph-impl", "transformer_engine")  # APEX fusion on
    monkeypatch.setattr(compat, "te_available", lambda: True)
    with pytest.raises(RunRefused) as info:
        train_under(session)
    assert [name for name, _ in info.value.violations] == ["gradient-accumulation-fusion"]
    assert "--no-gradient-accumulation-fusion" in capsys.readouterr().err
    session.ensure_checked()  # checked once: no second refusal
    assert session.settings is None and not capsys.readouterr().err


def train_under(session):
    return builders.build_train_end_report(lambda *args, **kwargs: "trained", session)()


def test_a_deferred_config_is_refused_by_the_rules_as_validation_would(monkeypatch, capsys):
    from megatron_cg_plugin.refusal import RunRefused

    session = installation.install()
    args = megatron_namespace(monkeypatch, "--cg-offload-window", "0")
    monkeypatch.setattr(global_vars, "get_args", lambda: args)
    with pytest.raises(RunRefused):
        _ = session.config
    assert "[cg-flags]" in capsys.readouterr().err and not session.config_resolved


def megatron_namespace(monkeypatch, *flags: str) -> argparse.Namespace:
    """What a script that parsed Megatron's flags without the plugin's holds."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(
        sys,
        "argv",
        [
            "script",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--micro-batch-size",
            "1",
            *flags,
        ],
    )
    return parse_args()


def test_install_without_config_and_args_lacking_cg_flags(monkeypatch):
    args = megatron_namespace(monkeypatch, "--no-gradient-accumulation-fusion")
    assert not hasattr(args, "cg_preset")
    monkeypatch.setattr(global_vars, "get_args", lambda: args)
    assert installation.install().config == PluginConfig()


def test_install_after_the_script_parsed_runs_the_rules_at_once(monkeypatch, capsys):
    from megatron_cg_plugin.refusal import RunRefused

    args = megatron_namespace(monkeypatch, "--cuda-graph-impl", "transformer_engine")  # APEX fusion left on
    monkeypatch.setattr(global_vars, "get_args", lambda: args)
    monkeypatch.setattr(compat, "te_available", lambda: True)
    with pytest.raises(RunRefused) as info:
        installation.install()
    assert info.value.code == 2
    assert [name for name, _ in info.value.violations] == ["gradient-accumulation-fusion"]
    assert "--no-gradient-accumulation-fusion" in capsys.readouterr().err
    assert_pristine()  # nothing left half-installed


# ---------------------------------------------------------------- finish


def test_finish_without_install_returns_none():
    printed = []
    assert installation.finish(print_fn=printed.append) is None
    assert printed == []


def test_finish_writes_files_on_rank0(tmp_path, probe):
    config = PluginConfig(preset="tiny-gpt", metrics_out=tmp_path / "m.json", report_out=tmp_path / "r.json")
    session = installation.install(config)
    session.probe = probe
    session.on_training_log(iteration=1, loss_dict={"lm loss": 2.0})
    printed = []
    report = installation.finish(print_fn=printed.append)
    assert report.iterations == 1 and report.preset == "tiny-gpt"
    assert config.metrics_out.exists() and config.report_out.exists()
    assert printed == [report.format_table()]


# ---------------------------------------------------------------- PatchSet, transactional


def _wrap_build(original, session):
    def replacement(*args, **kwargs):
        return ("wrapped", original(*args, **kwargs))

    replacement.session = session
    return replacement


def _patch(*fields, build=_wrap_build, **named):
    """A test's patch, built by ``_wrap_build`` unless it names its own builder."""
    return Patch(*fields, build=build, **named)


def _patch_set(*ledger):
    return PatchSet(ledger)


def _f(x, y=1):
    return x + y


def _g(a):
    return a


def test_patchset_applies_and_reverts_by_identity(fake_module):
    target = fake_module(f=_f, g=_g)
    good = _patch("good", target.__name__, "f", "test", expected_params=("x",))
    other = _patch("other", target.__name__, "g", "test")
    patch_set = _patch_set(good, other)
    session = object()
    patch_set.apply_all(session)
    assert target.f(1) == ("wrapped", 2) and target.f.session is session and target.g is not _g
    patch_set.revert_all()
    assert target.f is _f and target.g is _g
    patch_set.revert_all()  # harmless
    patch_set.apply_all(session)  # can be applied again after a revert
    assert target.f(1) == ("wrapped", 2)
    patch_set.revert_all()
    assert target.f is _f


def test_every_patch_owns_its_builder(fake_module):
    assert all(callable(patch.build) for patch in PATCHES)
    assert len({patch.build for patch in PATCHES}) == len(PATCHES)  # one builder per patch
    target = fake_module(f=_f)
    with pytest.raises(TypeError):
        Patch("listed", target.__name__, "f", "test")  # an entry without its builder
    with pytest.raises(ValueError, match=r"each patch needs a builder: none for \['listed'\]"):
        PatchSet((_patch("listed", target.__name__, "f", "test", build=None),))
    assert target.f is _f


def test_patchset_refuses_double_apply(fake_module):
    target = fake_module(f=_f)
    patch_set = _patch_set(_patch("good", target.__name__, "f", "test"))
    patch_set.apply_all(None)
    wrapped = target.f
    with pytest.raises(AssertionError):
        patch_set.apply_all(None)
    assert target.f is wrapped
    patch_set.revert_all()
    assert target.f is _f


def _raising_build(original, session):
    raise RuntimeError("build failed")


@pytest.mark.parametrize(
    "second, error",
    [
        (dict(attribute="g", expected_params=("no_such_param",)), SignatureMismatchError),
        (dict(attribute="g", builder=_raising_build), RuntimeError),
        (dict(attribute="missing_attribute"), AttributeError),
        (dict(attribute="g", module="no_such_module_for_cg_tests"), ModuleNotFoundError),
        (dict(attribute="g", expected_methods=("reset",)), SignatureMismatchError),
    ],
)
def test_apply_all_is_all_or_nothing(fake_module, second, error):
    target = fake_module(f=_f, g=_g)
    good = _patch("good", target.__name__, "f", "test", expected_params=("x", "y"))
    fields = dict(name="bad", module=target.__name__, reason="test")
    fields.update(second)
    fields["build"] = fields.pop("builder", _wrap_build)
    patch_set = _patch_set(good, Patch(**fields))
    with pytest.raises(error):
        patch_set.apply_all(object())
    assert target.f is _f
    assert target.g is _g
    with pytest.raises(error):  # nothing left applied: a second try fails the same way, not as applied twice
        patch_set.apply_all(object())


def test_signature_mismatch_names_the_parameter_and_target(fake_module):
    target = fake_module(g=_g)
    patch = _patch("bad", target.__name__, "g", "test", expected_params=("a", "iteration"))
    with pytest.raises(SignatureMismatchError) as info:
        _patch_set(patch).apply_all(None)
    assert f"{target.__name__}.g" in str(info.value)
    assert "iteration" in str(info.value)


def test_revert_restores_the_first_original_when_patches_stack(fake_module):
    target = fake_module(f=_f)
    first = _patch("first", target.__name__, "f", "test")
    second = _patch("second", target.__name__, "f", "test")
    patch_set = _patch_set(first, second)
    patch_set.apply_all(None)
    assert target.f(1) == ("wrapped", ("wrapped", 2))
    patch_set.revert_all()
    assert target.f is _f  # reverted last-applied first


def test_class_patch_checks_init_and_methods(fake_module):
    class Helper:
        def __init__(self, model, config, seq_length, micro_batch_size, optimizers=()):
            pass

    class OldHelper(Helper):
        def __init__(self, model, config):
            pass

    for name in ledger.HELPER_METHODS:
        setattr(Helper, name, lambda self: None)
    target = fake_module(Helper=Helper, OldHelper=OldHelper)
    helper_patch = PATCH_BY_NAME["helper-swap"]

    helper_patch.check(Helper)
    with pytest.raises(SignatureMismatchError, match="seq_length, micro_batch_size, optimizers"):
        helper_patch.check(OldHelper)

    class NoDelete(Helper):
        delete_cuda_graphs = None

    with pytest.raises(SignatureMismatchError, match="lacks method\\(s\\) delete_cuda_graphs"):
        helper_patch.check(NoDelete)
    assert target.Helper is Helper


# ---------------------------------------------------------------- training_log tap


def _fake_training_log_factory(calls):
    def training_log(
        loss_dict,
        total_loss_dict,
        learning_rate,
        iteration,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        num_zeros_in_grad,
        max_attention_logit,
        pg_collection=None,
        is_first_iteration=False,
        seqlen_squared_sum_in_batch=None,
        total_real_tokens_in_batch=None,
    ):
        calls.append(dict(locals()))
        return "report_memory_flag_out"

    return training_log


class RecordingSession:
    times_steps = keeps_values = True  # a run with --cg-metrics-out

    def __init__(self):
        self.logged = []

    def on_training_log(self, **kwargs):
        self.logged.append(kwargs)


@pytest.fixture
def tapped(fake_module):
    calls = []
    original = _fake_training_log_factory(calls)
    target = fake_module(training_log=original)
    tap = dataclasses.replace(PATCH_BY_NAME["training-log-tap"], module=target.__name__)
    session = RecordingSession()
    patch_set = _patch_set(tap)
    patch_set.apply_all(session)
    yield types.SimpleNamespace(target=target, original=original, calls=calls, session=session)
    patch_set.revert_all()
    assert target.training_log is original


def test_fake_training_log_has_megatrons_parameters():
    calls = []
    fake = inspect.signature(_fake_training_log_factory(calls)).parameters
    assert list(fake) == list(inspect.signature(ORIGINAL_TRAINING_LOG).parameters)


LOSS = {"lm loss": torch.tensor(10.5)}
POSITIONAL = (LOSS, {}, 1e-4, 7, 65536.0, True, 0, 1.5, 40.0, 123, None)


def test_training_log_tap_positional_call(tapped):
    result = tapped.target.training_log(*POSITIONAL, pg_collection="pg", is_first_iteration=True)
    assert result == "report_memory_flag_out"
    (call,) = tapped.calls
    assert call["loss_dict"] is LOSS and call["iteration"] == 7 and call["num_zeros_in_grad"] == 123
    assert call["pg_collection"] == "pg" and call["is_first_iteration"] is True
    assert call["learning_rate"] == 1e-4 and call["max_attention_logit"] is None
    (logged,) = tapped.session.logged
    assert logged == {"iteration": 7, "loss_dict": LOSS, "num_zeros_in_grad": 123}
    assert logged["loss_dict"] is LOSS


def test_training_log_tap_keyword_call(tapped):
    names = list(inspect.signature(tapped.original).parameters)[: len(POSITIONAL)]
    kwargs = dict(zip(names, POSITIONAL))
    kwargs["iteration"], kwargs["num_zeros_in_grad"] = 9, None
    result = tapped.target.training_log(**kwargs)
    assert result == "report_memory_flag_out"
    (call,) = tapped.calls
    assert {name: call[name] for name in kwargs} == kwargs
    assert tapped.session.logged == [{"iteration": 9, "loss_dict": LOSS, "num_zeros_in_grad": None}]


def test_training_log_tap_mixed_call_like_megatrons_train_loop(tapped):
    # train() passes the first eleven positionally and the rest by keyword (training.py l.3985).
    tapped.target.training_log(
        *POSITIONAL[:3],
        iteration=3,
        loss_scale=1.0,
        report_memory_flag=False,
        skipped_iter=0,
        grad_norm=None,
        params_norm=None,
        num_zeros_in_grad=torch.tensor(5.0),
        max_attention_logit=None,
    )
    (logged,) = tapped.session.logged
    assert logged["iteration"] == 3 and float(logged["num_zeros_in_grad"]) == 5.0


def test_training_log_tap_feeds_a_real_session(fake_module, probe, clock):
    target = fake_module(training_log=_fake_training_log_factory([]))
    tap = dataclasses.replace(PATCH_BY_NAME["training-log-tap"], module=target.__name__)
    session = RunSession(PluginConfig(metrics_out=Path("unwritten-metrics.json")), probe=probe, clock=clock)
    _patch_set(tap).apply_all(session)
    target.training_log(*POSITIONAL)
    golden = session.metrics()
    assert dict(golden.metrics["lm loss"].values) == {7: 10.5}
    assert dict(golden.metrics["num-zeros"].values) == {7: 123.0}


def test_the_taps_do_nothing_of_their_own_where_the_run_records_nothing(fake_module, probe, clock):
    """No --cg-metrics-out, no --cg-report-out, --cg-no-report: Megatron's training_log and MTP
    logging run as they would without the plugin, and the session sees no call."""

    class Untimed(RecordingSession):
        times_steps = keeps_values = False

    calls = []
    target = fake_module(training_log=_fake_training_log_factory(calls))
    tap = dataclasses.replace(PATCH_BY_NAME["training-log-tap"], module=target.__name__)
    session = Untimed()
    _patch_set(tap).apply_all(session)
    assert target.training_log(*POSITIONAL) == "report_memory_flag_out" and len(calls) == 1
    assert session.logged == []

    class Totals(dict):  # the tap's difference of totals would read every entry
        def __getitem__(self, name):
            raise AssertionError("the MTP tap read Megatron's totals")

    class Helper:
        @staticmethod
        def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
            return "Megatron's result"

    real = RunSession(PluginConfig(print_report=False), probe=probe, clock=clock)
    assert (
        builders.build_mtp_loss_tap(Helper, real).track_mtp_metrics(1.0, 1, None, None, Totals({"mtp_1 loss": 1.0}))
        == "Megatron's result"
    )
    assert real._pending_mtp == {}


# What waits for the device or reads a device value to the host: none may run on the step path.
DEVICE_READS = [
    (torch.cuda, "synchronize"),
    (torch.cuda.Stream, "synchronize"),
    (torch.cuda.Event, "synchronize"),
    (torch.cuda.Event, "elapsed_time"),
    (torch.Tensor, "item"),
    (torch.Tensor, "cpu"),
    (torch.Tensor, "tolist"),
    (torch.Tensor, "numpy"),
    (torch.Tensor, "to"),
    (torch.Tensor, "__float__"),
    (torch.Tensor, "__int__"),
    (torch.Tensor, "__bool__"),
]


@contextlib.contextmanager
def device_reads_forbidden():
    """Every way in ``DEVICE_READS`` raises (and is counted) inside the block."""
    seen: list[str] = []

    def forbidden(name):
        def call(*args, **kwargs):
            seen.append(name)
            raise AssertionError(f"{name} ran on the recording's step path")

        return call

    with contextlib.ExitStack() as stack:
        for owner, name in DEVICE_READS:
            stack.enter_context(unittest.mock.patch.object(owner, name, forbidden(f"{owner.__name__}.{name}")))
        yield seen


def test_the_recording_path_never_waits_for_the_device_per_step(tmp_path):
    """A run with --cg-metrics-out and --cg-report-out, through the patches' own code (the
    train_step timer, the training_log and MTP taps) and the real device probe: 40 iterations
    with device reads made to fail; the values are read once, when the run ends."""
    config = PluginConfig(
        metrics_out=tmp_path / "metrics.json", report_out=tmp_path / "report.json", print_report=False
    )
    session = RunSession(config)  # CudaProbe: the allocator's host counters
    weight = torch.ones(3, requires_grad=True)

    def train_step(forward_step_func, data_iterator, model, *rest):
        return {"lm loss": (weight * data_iterator).sum()}

    class Helper:
        @staticmethod
        def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
            total_loss_dict["mtp_1 loss"] = total_loss_dict.get("mtp_1 loss", 0.0) + weight.sum() * loss_scale

    timed = builders.build_train_step_timer(train_step, session)
    logged = builders.build_training_log_tap(_fake_training_log_factory([]), session)
    mtp = builders.build_mtp_loss_tap(Helper, session)
    with device_reads_forbidden() as seen:
        for iteration in range(1, 41):
            loss_dict = timed(None, iteration, None)
            totals = {"mtp_1 loss": weight.sum()}
            mtp.track_mtp_metrics(0.5, iteration, None, None, totals)
            logged(loss_dict, {}, 1e-4, iteration, 1.0, False, 0, 1.0, None, weight.sum() * iteration, None)
    assert seen == []
    session.finish()
    metrics = json.loads(config.metrics_out.read_text())
    assert metrics["lm loss"]["values"]["40"] == 120.0 and metrics["num-zeros"]["values"]["2"] == 6.0
    assert metrics["mtp_1 loss"]["values"]["1"] == 1.5 and len(metrics["iteration-time"]["values"]) == 40


def test_the_forbidden_device_reads_are_caught():
    """The guard itself: each way the recording could wait for the device fails inside it."""
    value = torch.ones(1)
    with device_reads_forbidden() as seen:
        for read in (
            value.item,
            value.cpu,
            value.tolist,
            lambda: float(value),
            lambda: bool(value),
            torch.cuda.synchronize,
        ):
            with pytest.raises(AssertionError, match="ran on the recording's step path"):
                read()
    assert len(seen) == 6


def test_training_log_tap_propagates_original_errors(fake_module):
    def training_log(loss_dict, iteration, num_zeros_in_grad):
        raise ValueError("megatron failed")

    target = fake_module(training_log=training_log)
    tap = dataclasses.replace(PATCH_BY_NAME["training-log-tap"], module=target.__name__)
    session = RecordingSession()
    _patch_set(tap).apply_all(session)
    with pytest.raises(ValueError, match="megatron failed"):
        target.training_log({}, 1, None)
    assert session.logged == []


def test_installed_tap_wraps_megatrons_training_log(monkeypatch):
    calls = []
    fake = _fake_training_log_factory(calls)
    monkeypatch.setattr(training, "training_log", fake)
    session = installation.install()
    session.probe = types.SimpleNamespace(synchronize=lambda: None, allocated_bytes=lambda: (0, 0))
    assert training.training_log(*POSITIONAL) == "report_memory_flag_out"
    assert len(calls) == 1
    assert [r.iteration for r in session.iterations] == [7]
    installation.uninstall()
    assert training.training_log is fake


# ---------------------------------------------------------------- prebuilt dataset helpers


@pytest.fixture
def compile_patch(fake_module):
    calls = []

    def compile_helpers():
        calls.append("make")

    target = fake_module(compile_helpers=compile_helpers)
    patch = dataclasses.replace(PATCH_BY_NAME["prebuilt-dataset-helpers"], module=target.__name__)
    patch_set = _patch_set(patch)
    patch_set.apply_all(object())
    yield types.SimpleNamespace(target=target, calls=calls)
    patch_set.revert_all()
    assert target.compile_helpers is compile_helpers


def test_helpers_cpp_ships_in_the_wheel():
    module = importlib.import_module("megatron.core.datasets.helpers_cpp")
    assert Path(module.__file__).suffix in {".so", ".pyd"}


def test_prebuilt_helpers_skip_the_build(compile_patch):
    assert compile_patch.target.compile_helpers() is None
    assert compile_patch.calls == []


def _block_helpers_by_import_module(monkeypatch):
    real = importlib.import_module

    def import_module(name, package=None):
        if name == "megatron.core.datasets.helpers_cpp":
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)


def _block_helpers_in_sys_modules(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)


@pytest.mark.parametrize("block", [_block_helpers_by_import_module, _block_helpers_in_sys_modules])
def test_missing_helpers_fall_back_to_building(compile_patch, monkeypatch, block):
    block(monkeypatch)
    compile_patch.target.compile_helpers()
    assert compile_patch.calls == ["make"]


def test_installed_compile_helpers_does_not_run_make(monkeypatch):
    runs = []

    def fake_run(*args, **kwargs):
        runs.append(args)
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    installation.install()
    dataset_utils.compile_helpers()
    assert runs == []
    installation.uninstall()
    dataset_utils.compile_helpers()  # the original, restored: it runs make
    assert len(runs) == 1 and runs[0][0][0] == "make"


# ---------------------------------------------------------------- TE patches


def test_te_patches_are_skipped_without_te(fake_module):
    target = fake_module(f=_f)
    te_only = _patch("te-only", target.__name__, "f", "test", needs_te=True)
    patch_set = _patch_set(te_only)
    patch_set.apply_all(None, with_te=False)
    assert target.f is _f
    patch_set.apply_all(None, with_te=True)  # nothing was recorded as applied, or this would refuse
    assert target.f is not _f
    patch_set.revert_all()
    assert target.f is _f


def _row_major_weak_ref(x):
    """What TE 2.20's make_weak_ref does to a tensor: same data pointer, shape, row-major strides."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), x.storage_offset(), tuple(x.shape))


def test_strided_weak_ref_keeps_strides_and_aliases_the_same_memory():
    make_weak_ref = builders.build_strided_weak_ref(_row_major_weak_ref, None)
    base = torch.arange(24.0).reshape(4, 6)
    views = {"transposed": base.t(), "sliced": base[1:, ::2], "expanded": torch.arange(3.0).reshape(3, 1).expand(3, 5)}
    for name, view in views.items():
        assert _row_major_weak_ref(view).stride() != view.stride(), name  # TE's behaviour, the bug
        ref = make_weak_ref(view)
        assert ref.stride() == view.stride() and ref.shape == view.shape, name
        assert ref.data_ptr() == view.data_ptr() and torch.equal(ref, view), name
    nested = make_weak_ref({"a": [views["transposed"], (views["expanded"], 3)], "b": None})
    assert nested["a"][0].stride() == views["transposed"].stride()
    assert nested["a"][1][0].stride() == views["expanded"].stride() and nested["a"][1][1] == 3
    assert nested["b"] is None
    contiguous = torch.ones(3)
    assert make_weak_ref(contiguous).data_ptr() == contiguous.data_ptr()


# ---------------------------------------------------------------- hooks into the training loop


def test_train_end_report_finishes_on_return_and_on_megatrons_own_exits(probe):
    session = RunSession(PluginConfig(print_report=False), probe=probe)
    train = builders.build_train_end_report(lambda: "done", session)
    assert train() == "done" and session._finished is not None

    session = RunSession(PluginConfig(print_report=False), probe=probe)

    def exits():  # --exit-interval / --exit-duration-in-mins end train() with sys.exit
        raise SystemExit(0)

    with pytest.raises(SystemExit):
        builders.build_train_end_report(exits, session)()
    assert session._finished is not None

    session = RunSession(PluginConfig(print_report=False), probe=probe)

    def crashes():
        raise RuntimeError("CUDA error")

    with pytest.raises(RuntimeError):
        builders.build_train_end_report(crashes, session)()
    assert session._finished is None  # a crashed run writes no files that look like a finished one


def test_train_step_timer_marks_each_iteration(probe, clock):
    session = RunSession(PluginConfig(), probe=probe, clock=clock)
    calls = []
    step = builders.build_train_step_timer(lambda *a, **k: calls.append((a, k)) or "stepped", session)
    assert step(1, data_iterator=2) == "stepped" and calls == [((1,), {"data_iterator": 2})]
    clock.advance(0.5)
    session.on_training_log(iteration=1, loss_dict={})
    assert session.iterations[0].seconds == 0.5


def _train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    opt_param_scheduler,
    config,
    forward_backward_func,
    iteration=None,
):
    """Megatron 0.19's train_step signature: around the schedule, work of its own (optimizer step ...)."""
    before = model.step_now()
    during = forward_backward_func()
    return before, during, model.step_now()


def test_train_step_timer_marks_only_the_schedule_for_the_replay_contracts(probe, clock):
    session = RunSession(PluginConfig(), probe=probe, clock=clock)
    marks = session.step_marks
    step = builders.build_train_step_timer(_train_step, session)
    first = step(None, None, marks, None, None, None, marks.step_now, iteration=3)
    second = step(None, None, marks, None, None, None, forward_backward_func=marks.step_now)
    assert first[0] is None and first[2] is None  # before and after the schedule: outside the step
    assert None not in (first[1], second[1]) and first[1] != second[1]  # inside it, a different one each time
    with pytest.raises(ZeroDivisionError):
        step(None, None, marks, None, None, None, lambda: 1 / 0)
    assert marks.step_now() is None  # a schedule that raised has ended too


def test_a_forward_of_a_wrapped_train_step_after_its_schedule_reads_the_held_state(probe, clock):
    # A train_step of one's own (installed before the plugin) that moves a parameter and runs a forward after
    # Megatron's schedule: Megatron marks that forward as a later microbatch; it is outside the step's marks.
    import torch

    from megatron_cg_plugin.capture.contracts import ContractViolation, ReplayContract
    from megatron_cg_plugin.config import ContractCheck

    session = RunSession(PluginConfig(), probe=probe, clock=clock)
    weight = torch.nn.Parameter(torch.ones(3))
    contract = ReplayContract.record("g", (torch.zeros(2),), {}, params=[("w", weight)], step_marks=session.step_marks)

    def replay(first):
        contract.check((torch.zeros(2),), {"is_first_microbatch": first}, mode=ContractCheck.FULL)

    def schedule():
        for first in (True, False):  # the first replay reads the held state, the second skips it
            replay(first)

    def users_train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        opt_param_scheduler,
        config,
        forward_backward_func,
        iteration=None,
    ):
        forward_backward_func()
        weight.data = torch.ones(3)
        replay(False)

    step = builders.build_train_step_timer(users_train_step, session)
    with pytest.raises(ContractViolation, match="parameter storage"):
        step(None, None, None, None, None, None, schedule)


def test_a_scripts_own_install_config_is_taken_while_the_first_is_deferred():
    # megatron-cg run installs with the config deferred; the script's install(config) then wins.
    first = installation.install()
    assert not first.config_resolved
    config = PluginConfig(contract_check="shapes")
    assert installation.install(config) is first
    assert first.config == config
    with pytest.raises(RuntimeError, match="different config"):
        installation.install(PluginConfig(contract_check="off"))


# ---------------------------------------------------------------- foreign state beyond PATCHES


def test_every_foreign_state_entry_resolves_and_is_documented():
    text = (Path(__file__).resolve().parents[2] / "docs" / "patches.md").read_text()
    for entry in (*ledger.LENT, *ledger.SCOPED, *ledger.PRIVATE_API):
        assert entry.reason.strip() and entry.where.strip(), entry
        assert f"`{entry.name}`" in text and entry.target.replace(":", ".") in text, entry.name
        if not entry.needs_te:
            entry.resolve()  # present in the installed megatron-core / torch


@pytest.fixture
def lent_owner(monkeypatch, fake_module):
    """A class whose ``cp_stream`` the ledger lists as lent (held by install, restored by uninstall)."""

    class Owner:
        cp_stream = None

    module = fake_module(Owner=Owner)
    entry = ledger.ForeignState("dynamic-cp-stream", f"{module.__name__}:Owner.cp_stream", "test", "test", held=True)
    monkeypatch.setattr(ledger, "LENT", (entry,))
    return Owner


def test_lent_attributes_are_restored_by_uninstall_by_identity(lent_owner):
    original = lent_owner.cp_stream
    installation.install()
    first, second = object(), object()
    foreign_state.put(lent_owner, "cp_stream", first)
    foreign_state.put(lent_owner, "cp_stream", second)  # lent twice: the first original is kept
    assert lent_owner.cp_stream is second
    installation.uninstall()
    assert lent_owner.cp_stream is original


def test_a_lent_attribute_the_owner_only_inherited_is_deleted_again(monkeypatch, fake_module):
    class Base:
        cp_stream = None

    class Owner(Base):
        pass

    module = fake_module(Owner=Owner)
    entry = ledger.ForeignState("dynamic-cp-stream", f"{module.__name__}:Owner.cp_stream", "test", "test", held=True)
    monkeypatch.setattr(ledger, "LENT", (entry,))
    installation.install()
    foreign_state.put(Owner, "cp_stream", object())
    installation.uninstall()
    assert "cp_stream" not in vars(Owner) and Owner.cp_stream is None


def test_every_change_the_package_makes_names_a_listed_entry():
    """Each ``change=`` the package hands ``foreign_state`` names an entry of the ledger (unlisted
    changes are refused here, before any run), and the plugin reaches foreign attributes through it."""
    import ast

    listed = {entry.name for entry in (*ledger.PATCHES, *ledger.LENT, *ledger.SCOPED)}
    named = []
    for path in Path(megatron_cg_plugin.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                named += [
                    (path.name, keyword.value.value)
                    for keyword in node.keywords
                    if keyword.arg == "change" and isinstance(keyword.value, ast.Constant)
                ]
    # and every entry that says it is made through foreign_state is: its name is handed as change=
    through_the_primitive = {entry.name for entry in (*ledger.LENT, *ledger.SCOPED) if not entry.made_with}
    assert through_the_primitive - {entry.name for entry in ledger.LENT if entry.held} <= {name for _, name in named}
    assert {name for _, name in named} >= {
        "megatron-capture-call",
        "layer-capture-tracker",
        "tracked-cuda-graphs",
        "offload-group-names",
        "bench-train-step",
        "te-capture-flag",
    }
    unlisted = [(file, name) for file, name in named if name not in listed]
    assert not unlisted, f"list these changes in patching/ledger.py: {unlisted}"


def test_a_lend_outside_an_installed_run_is_the_callers_and_stays(lent_owner):
    lent = object()
    foreign_state.put(lent_owner, "cp_stream", lent)  # a probe, no plugin installed
    installation.install()
    installation.uninstall()
    assert lent_owner.cp_stream is lent  # a later install/uninstall does not undo what it never made


def test_uninstall_restores_a_lent_attribute_to_what_it_was_at_install(lent_owner):
    original = lent_owner.cp_stream
    installation.install()
    foreign_state.put(lent_owner, "cp_stream", object())
    lent_owner.cp_stream = object()  # set again during the run, by whomever
    installation.uninstall()
    assert lent_owner.cp_stream is original


def test_scoped_cpu_stand_ins_are_restored_by_identity():
    from megatron.core import utils as megatron_utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import moe_utils

    before = (
        torch.cuda.get_device_capability,
        torch.cuda.get_device_properties,
        rope_utils.fused_apply_rotary_pos_emb,
        rope_utils.fused_apply_rotary_pos_emb_thd,
        moe_utils.fused_permute,
        moe_utils.fused_unpermute,
        megatron_utils._te_version,
    )
    with pytest.raises(KeyError), host_stand_ins.gpu_host_stand_ins():
        assert torch.cuda.get_device_capability() == (9, 0)
        assert rope_utils.fused_apply_rotary_pos_emb is not None
        assert moe_utils.fused_permute is not None
        # Megatron's TE-gated config checks see a supported TE, not 0.0.0.
        assert megatron_utils.is_te_min_version("2.6.0dev0")
        raise KeyError("restored on an error too")
    after = (
        torch.cuda.get_device_capability,
        torch.cuda.get_device_properties,
        rope_utils.fused_apply_rotary_pos_emb,
        rope_utils.fused_apply_rotary_pos_emb_thd,
        moe_utils.fused_permute,
        moe_utils.fused_unpermute,
        megatron_utils._te_version,
    )
    assert all(a is b for a, b in zip(before, after, strict=True))


def test_scoped_leaves_an_attribute_absent_where_the_owner_had_none_of_its_own(fake_module):
    class Layer:
        def capture(self):
            return "the class's"

    layer, module = Layer(), fake_module()
    with (
        foreign_state.setting(layer, "capture", lambda: "lent", change="megatron-capture-call"),
        foreign_state.setting(module, "make_graphed_callables", len, change="megatron-capture-call"),
    ):
        assert layer.capture() == "lent" and module.make_graphed_callables is len
    assert "capture" not in vars(layer) and layer.capture() == "the class's"  # the method again, no copy of it
    assert not hasattr(module, "make_graphed_callables")


def test_scoped_megatron_capture_call_is_restored_by_identity(monkeypatch):
    from megatron.core.transformer import cuda_graphs

    def te_make_graphed_callables(*args, **kwargs):
        return "TE's"

    monkeypatch.setattr(cuda_graphs, "make_graphed_callables", te_make_graphed_callables, raising=False)
    with (
        pytest.raises(KeyError),
        foreign_state.setting(cuda_graphs, "make_graphed_callables", len, change="megatron-capture-call"),
    ):
        assert cuda_graphs.make_graphed_callables is len
        raise KeyError("restored on an error too")
    assert cuda_graphs.make_graphed_callables is te_make_graphed_callables


def test_scoped_te_capture_flag_is_restored(monkeypatch):
    from megatron_cg_plugin.capture import te_backend

    graph = types.ModuleType("transformer_engine.pytorch.graph")
    graph._IS_GRAPH_CAPTURING = False

    def set_capture_start():
        graph._IS_GRAPH_CAPTURING = True

    graph.set_capture_start = set_capture_start
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.graph", graph)
    sys.modules["transformer_engine.pytorch"].graph = graph
    with pytest.raises(ValueError), te_backend.te_capture_flag():
        assert graph._IS_GRAPH_CAPTURING is True
        raise ValueError("capture failed")
    assert graph._IS_GRAPH_CAPTURING is False


def test_install_refuses_a_moved_private_megatron_method_and_patches_nothing(monkeypatch):
    from megatron.core.transformer import cuda_graphs

    monkeypatch.delattr(cuda_graphs.TECudaGraphHelper, "_reset_after_capture")
    with pytest.raises(SignatureMismatchError, match="_reset_after_capture"):
        installation.install()
    assert_pristine()


def test_install_refuses_a_private_method_whose_parameters_changed(monkeypatch):
    from megatron.core.transformer import transformer_layer

    monkeypatch.setattr(transformer_layer.TransformerLayer, "_forward_attention", lambda self, hidden_states: None)
    with pytest.raises(SignatureMismatchError, match="attention_mask"):
        installation.install()
    assert_pristine()


def _users_patch(method):
    """A user's own patch of a Megatron method, made without functools.wraps."""

    def patched(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    return patched


@pytest.mark.parametrize(
    "module, owner, name",
    [
        ("megatron.core.transformer.transformer_layer", "TransformerLayer", "_forward_attention"),  # its parameters
        ("megatron.core.transformer.cuda_graphs", "TECudaGraphHelper", "create_cudagraphs"),  # the calls it makes
    ],
)
def test_install_takes_a_private_method_wrapped_with_functools_wraps(monkeypatch, module, owner, name):
    cls = getattr(importlib.import_module(module), owner)
    method = getattr(cls, name)
    monkeypatch.setattr(cls, name, functools.wraps(method)(_users_patch(method)))
    assert installation.install() is installation.active_session()  # checked through __wrapped__


def test_install_names_a_private_method_wrapped_by_a_users_patch(monkeypatch):
    from megatron.core.transformer import transformer_layer

    method = transformer_layer.TransformerLayer._forward_attention
    monkeypatch.setattr(transformer_layer.TransformerLayer, "_forward_attention", _users_patch(method))
    with pytest.raises(SignatureMismatchError) as info:
        installation.install()
    message = str(info.value)
    assert f"Found {__name__}._users_patch.<locals>.patched, defined outside megatron-core: it looks wrapped" in message
    assert "build differs" not in message
    assert_pristine()


def test_install_names_a_wrapped_create_cudagraphs_whose_calls_it_cannot_see(monkeypatch):
    from megatron.core.transformer import cuda_graphs

    method = cuda_graphs.TECudaGraphHelper.create_cudagraphs
    monkeypatch.setattr(cuda_graphs.TECudaGraphHelper, "create_cudagraphs", _users_patch(method))
    with pytest.raises(
        SignatureMismatchError,
        match="no longer calls make_graphed_callables.* Found "
        f"{__name__}._users_patch.<locals>.patched, defined outside megatron-core: it looks wrapped",
    ):
        installation.install()
    assert_pristine()


def test_install_names_a_wrapped_mtp_logging_method(monkeypatch):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    def track_mtp_metrics(*args, **kwargs):  # a user's patch without functools.wraps
        pass

    monkeypatch.setattr(MTPLossLoggingHelper, "track_mtp_metrics", staticmethod(track_mtp_metrics))
    with pytest.raises(SignatureMismatchError) as info:
        installation.install()
    message = str(info.value)
    assert "track_mtp_metrics no longer takes parameter(s) loss_scale, iteration, total_loss_dict" in message
    assert f"Found {__name__}.{track_mtp_metrics.__qualname__}, defined outside megatron-core" in message
    assert_pristine()


def test_install_refuses_a_create_cudagraphs_that_no_longer_calls_make_graphed_callables(monkeypatch):
    from megatron.core.transformer import cuda_graphs

    def create_cudagraphs(self):  # a release that captures through another function
        return self._capture_graphs()

    monkeypatch.setattr(cuda_graphs.TECudaGraphHelper, "create_cudagraphs", create_cudagraphs)
    with pytest.raises(SignatureMismatchError, match="no longer calls make_graphed_callables"):
        installation.install()
    assert_pristine()


def test_scoped_puts_back_an_attribute_a_property_of_its_class_holds():
    # A property's setter keeps the value off the instance's __dict__: it is set back through the
    # property, not left at the scoped value for want of an own entry to restore.
    class Layer:
        def __init__(self):
            self._flag = True

        @property
        def flag(self):
            return self._flag

        @flag.setter
        def flag(self, value):
            self._flag = value

    class Holder:
        helper = staticmethod(len)

    layer = Layer()
    with (
        foreign_state.setting(layer, "flag", False, change="offload-in-graph-flag"),
        foreign_state.setting(Holder, "helper", abs, change="megatron-capture-call"),
    ):
        assert layer.flag is False and Holder.helper is abs
    assert layer.flag is True and "flag" not in vars(layer)
    assert isinstance(vars(Holder)["helper"], staticmethod) and Holder.helper is len  # stored as it was


def test_a_class_method_patch_goes_back_to_the_class_as_it_was(fake_module):
    """A patch of ``Class.method`` (the packed-graph patches of TransformerLayer) restores the class's own
    function by identity, and deletes again what the class only inherited, so the base's stays in force."""

    class Base:
        def inherited(self):
            return "base"

    class Child(Base):
        def own(self):
            return "own"

    own = vars(Child)["own"]
    target = fake_module(Child=Child)

    def build(original, session):
        return lambda self: ("wrapped", original(self))

    patch_set = PatchSet(
        (
            Patch("own", target.__name__, "Child.own", "test", build=build),
            Patch("inherited", target.__name__, "Child.inherited", "test", build=build),
        )
    )
    patch_set.apply_all(None)
    assert (Child().own(), Child().inherited()) == (("wrapped", "own"), ("wrapped", "base"))
    patch_set.revert_all()
    assert vars(Child)["own"] is own and "inherited" not in vars(Child) and Child().inherited() == "base"


def test_the_packed_graph_patches_reach_megatrons_classes():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_layer import TransformerLayer

    originals = (GPTModel.forward, TransformerLayer._te_cuda_graph_capture, TransformerLayer._te_cuda_graph_replay)
    installation.install()
    try:
        patched = (GPTModel.forward, TransformerLayer._te_cuda_graph_capture, TransformerLayer._te_cuda_graph_replay)
        assert all(now is not before and now.__wrapped__ is before for now, before in zip(patched, originals))
    finally:
        installation.uninstall()
    assert (
        GPTModel.forward,
        TransformerLayer._te_cuda_graph_capture,
        TransformerLayer._te_cuda_graph_replay,
    ) == originals


def test_an_offloaded_tensor_is_reloaded_only_after_its_copy_to_the_host(monkeypatch):
    """Megatron's tensor_pop reloads a tensor no bulk reload brought back on the current stream; the
    patch makes that stream wait for the group's offload event first, and only for such a tensor."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as offload

    from megatron_cg_plugin.patching.builders import build_offload_reload_wait

    events: list = []

    class Group:
        def __init__(self, tensors):
            self._tensors = tensors

        def wait_offload_event(self, stream):
            events.append(("wait", stream))

    def original(self, tensor_tag):
        events.append(("pop", tensor_tag))
        return tensor_tag

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "compute")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    tensor_pop = build_offload_reload_wait(original, session=None)
    handler = types.SimpleNamespace(offload_groups=[Group({(1, 0): ("cpu", "state"), (1, 1): torch.ones(1)})])
    tensor_pop(handler, (1, 0))
    assert events == [("wait", "compute"), ("pop", (1, 0))]  # still on the host: wait, then Megatron reloads
    events.clear()
    tensor_pop(handler, (1, 1))  # already reloaded by a bulk reload
    passthrough = torch.ones(1)
    tensor_pop(handler, passthrough)  # never offloaded
    assert events == [("pop", (1, 1)), ("pop", passthrough)]
    events.clear()
    capturing[0] = True  # a graph capture must not wait on an event recorded outside it
    handler.offload_groups[0]._tensors[(1, 2)] = ("cpu", "state")
    tensor_pop(handler, (1, 2))
    assert events == [("pop", (1, 2))]
    compat.check_parameters(offload.ChunkOffloadHandler.tensor_pop, ("tensor_tag",), where="tensor_pop")
