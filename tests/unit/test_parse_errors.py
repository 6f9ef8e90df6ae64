"""Tests for megatron_cg_plugin.parse_errors: one-line argparse errors, on a toy parser and on
Megatron's real parser (megatron-core 0.19.2 here, no GPU), alone and through ``install()``."""

from __future__ import annotations

import argparse
import importlib
import sys

import pytest

import megatron_cg_plugin
from megatron_cg_plugin import installation, parse_errors
from megatron_cg_plugin.parse_errors import short_message, shorten

arguments = importlib.import_module("megatron.training.arguments")
CudaGraphModule = importlib.import_module("megatron.core.transformer.enums").CudaGraphModule
ORIGINAL_MODULES_TYPE = arguments._parse_cuda_graph_modules_arg
ORIGINAL_ADD_MEGATRON_ARGUMENTS = arguments.add_megatron_arguments
MODULE_NAMES = [member.name for member in CudaGraphModule]

# The smallest flag set Megatron's parse_args accepts (it does not validate).
MEGATRON_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "1"]


def toy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toy", allow_abbrev=False)
    parser.add_argument("--cuda-graph-modules", nargs="+", default=[])
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("-q", action="store_true")  # single-dash: never suggested
    return parser


def megatron_parser() -> argparse.ArgumentParser:
    return arguments.add_megatron_arguments(argparse.ArgumentParser(prog="megatron", allow_abbrev=False))


def parse_failure(parser, argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    out, err = capsys.readouterr()
    assert out == ""
    return info.value.code, err


# -- short_message ------------------------------------------------------------------------------


def test_short_message_one_unknown_flag_suggests_the_close_one():
    message = short_message(toy_parser(), "unrecognized arguments: --cuda-graph-modul attn")
    assert "\n" not in message
    assert message.startswith("toy: error: unknown flag --cuda-graph-modul ")
    assert "did you mean --cuda-graph-modules" in message
    assert "attn" not in message  # the value is not a flag
    assert "unknown flags" not in message  # singular


def test_short_message_several_unknown_flags_each_with_its_suggestion():
    message = short_message(toy_parser(), "unrecognized arguments: --cuda-graph-modul attn --hiden-size 5 --zzzz")
    assert "\n" not in message
    assert message.startswith("toy: error: unknown flags ")
    body = message[len("toy: error: unknown flags ") :]
    parts = body.split(", ")
    assert parts == [
        "--cuda-graph-modul (did you mean --cuda-graph-modules?)",
        "--hiden-size (did you mean --hidden-size?)",
        "--zzzz",
    ]


def test_short_message_token_with_value_is_matched_by_its_name():
    message = short_message(toy_parser(), "unrecognized arguments: --num-layer=3")
    assert message == "toy: error: unknown flag --num-layer=3 (did you mean --num-layers?)"


def test_short_message_never_suggests_single_dash_options():
    message = short_message(toy_parser(), "unrecognized arguments: -qq")
    assert message == "toy: error: unknown flag -qq"


def test_short_message_negative_value_is_not_a_flag(capsys):
    parser = toy_parser()
    parser.add_argument("--lr", type=float)
    shorten(parser)
    code, err = parse_failure(parser, ["--lr-warmup", "-1"], capsys)  # argparse leaves both tokens over
    assert code == 2
    assert err.startswith("toy: error: unknown flag --lr-warmup")
    assert "-1" not in err


def test_short_message_only_positional_leftovers_are_listed():
    assert (
        short_message(toy_parser(), "unrecognized arguments: extra words") == "toy: error: unknown flags extra, words"
    )


@pytest.mark.parametrize(
    "message",
    [
        "argument --hidden-size: invalid int value: 'x'",
        "the following arguments are required: --num-layers",
        "unrecognized argument --cuda-graph-modul",  # not argparse's prefix
    ],
)
def test_short_message_other_errors_pass_through_with_prog(message):
    assert short_message(toy_parser(), message) == f"toy: error: {message}"


def test_suggestions_strip_the_value_and_cap_at_three():
    options = ["--num-layers", "--num-layers-a", "--num-layers-b", "--num-layers-c"]
    close = parse_errors.suggestions("--num-layer=4", options)
    assert len(close) == 3 and close[0] == "--num-layers"
    assert parse_errors.suggestions("--completely-different", options) == []


# -- shorten on the toy parser ---------------------------------------------------------------------


def test_shorten_toy_parser_unknown_flag_is_one_line(capsys):
    parser = shorten(toy_parser())
    code, err = parse_failure(parser, ["--num-layer", "3"], capsys)
    assert code == 2
    assert err == "toy: error: unknown flag --num-layer (did you mean --num-layers?)\n"


def test_shorten_returns_the_same_parser_and_leaves_others_alone(capsys):
    parser = toy_parser()
    assert shorten(parser) is parser
    other = toy_parser()
    with pytest.raises(SystemExit):
        other.parse_args(["--num-layer", "3"])
    err = capsys.readouterr().err
    assert err.startswith("usage: toy")  # argparse's own error, usage first
    assert "unrecognized arguments" in err


def test_a_shortened_parser_names_the_command_it_reads_flags_for(capsys):
    """Megatron's parser is named after the script (``pretrain_gpt`` in the dry run): the line names the command
    typed, and only inside the block."""
    parser = shorten(toy_parser())
    with parse_errors.reported_as("megatron-cg check"):
        _, err = parse_failure(parser, ["--num-layer", "3"], capsys)
    assert err == "megatron-cg check: error: unknown flag --num-layer (did you mean --num-layers?)\n"
    assert parse_failure(parser, ["--num-layer", "3"], capsys)[1].startswith("toy: error: ")


def test_the_plugins_own_parsers_put_the_error_first_their_subcommands_too(capsys):
    parser = parse_errors.OneLineErrors(prog="megatron-cg golden")
    compare = parser.add_subparsers(dest="action", required=True).add_parser("compare")
    compare.add_argument("expected")
    code, err = parse_failure(parser, ["compare"], capsys)
    assert code == 2
    assert err.splitlines() == [
        "megatron-cg golden compare: error: the following arguments are required: expected",
        "  (megatron-cg golden compare --help lists its arguments)",
    ]
    _, err = parse_failure(parser, ["compare", "x", "--expectd"], capsys)  # argparse says it at the top level
    assert err.startswith("megatron-cg golden: error: unknown flag --expectd")


# -- shorten on Megatron's real parser -------------------------------------------------------------


@pytest.fixture(scope="module")
def real_parser() -> argparse.ArgumentParser:
    return shorten(megatron_parser())


def _module_actions(parser):
    return [action for action in parser._actions if parse_errors.GRAPH_MODULE_FLAGS & set(action.option_strings)]


def test_megatron_parser_has_the_flags_shorten_wraps():
    actions = _module_actions(megatron_parser())
    assert sorted(flag for action in actions for flag in action.option_strings) == [
        "--cuda-graph-modules",
        "--cuda-graph-scope",
    ]
    assert all(action.type is ORIGINAL_MODULES_TYPE for action in actions)


def test_unshortened_megatron_parser_escapes_with_a_key_error():
    """What ``shorten`` fixes: Megatron's own type function raises KeyError, which argparse does
    not turn into a usage error, so the user sees a traceback."""
    with pytest.raises(KeyError):
        megatron_parser().parse_args(["--cuda-graph-modules", "atn"])


@pytest.mark.parametrize("flag", ["--cuda-graph-modules", "--cuda-graph-scope"])
def test_bad_graph_module_is_one_line_listing_valid_modules(real_parser, capsys, flag):
    code, err = parse_failure(real_parser, [flag, "attn", "atn"], capsys)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"megatron: error: argument {flag}: 'atn' is not a CUDA graph module")
    assert f"use any of {' '.join(MODULE_NAMES)}" in lines[0]
    for name in ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"):
        assert name in lines[0].split("use any of ")[1].split()
    assert "Traceback" not in err and "KeyError" not in err and "usage:" not in err


def test_unknown_flag_on_megatron_parser_is_one_line(real_parser, capsys):
    code, err = parse_failure(real_parser, [*MEGATRON_FLAGS, "--cuda-graph-modul", "attn"], capsys)
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("megatron: error: unknown flag --cuda-graph-modul (did you mean --cuda-graph-modules")
    assert "attn" not in err.split("(did you mean")[0]


def test_shortened_error_is_far_shorter_than_argparses(real_parser, capsys):
    argv = [*MEGATRON_FLAGS, "--hiden-size", "64"]
    _, plain = parse_failure(megatron_parser(), argv, capsys)
    _, short = parse_failure(real_parser, argv, capsys)
    assert len(short.splitlines()) == 1
    assert len(plain.splitlines()) > 100  # argparse prints Megatron's whole usage first
    assert "did you mean --hidden-size" in short


def test_valid_graph_modules_still_parse_to_enum_members(real_parser):
    args = real_parser.parse_args([*MEGATRON_FLAGS, "--cuda-graph-modules", "attn", "mlp"])
    assert args.cuda_graph_modules == [CudaGraphModule.attn, CudaGraphModule.mlp]
    args = real_parser.parse_args([*MEGATRON_FLAGS, "--cuda-graph-modules", "full"])
    assert args.cuda_graph_modules == ["full"]  # deprecated spelling, migrated by validate_args


def test_shorten_is_idempotent_and_wraps_the_original_type_once():
    parser = megatron_parser()
    shorten(parser)
    first = {id(action): action.type for action in _module_actions(parser)}
    error = parser.error
    assert shorten(parser) is parser
    for action in _module_actions(parser):
        assert action.type is first[id(action)]  # not wrapped again
        assert action.type.__wrapped__ is ORIGINAL_MODULES_TYPE
    assert parser.error is error


# -- through install() -----------------------------------------------------------------------------


@pytest.fixture
def installed():
    installation.uninstall()
    session = installation.install()
    assert arguments.add_megatron_arguments is not ORIGINAL_ADD_MEGATRON_ARGUMENTS
    try:
        yield session
    finally:
        installation.uninstall()
    assert installation.active_session() is None


PLUGIN_FLAGS = ["--cg-no-report", "--cg-contract-check", "shapes"]


def test_installed_parse_args_accepts_cg_flags_without_extra_args_provider(installed, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["script", *MEGATRON_FLAGS, *PLUGIN_FLAGS])
    args = arguments.parse_args()
    assert args.cg_no_report is True
    assert args.cg_contract_check == "shapes"
    assert args.num_layers == 2 and args.hidden_size == 64


def test_installed_parse_args_with_the_plugins_own_provider_too(installed, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["script", *MEGATRON_FLAGS, *PLUGIN_FLAGS])
    args = arguments.parse_args(extra_args_provider=megatron_cg_plugin.add_plugin_args)  # no argparse conflict
    assert args.cg_no_report is True and args.cg_contract_check == "shapes"


def test_installed_parse_args_errors_are_one_line(installed, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["script", *MEGATRON_FLAGS, "--cuda-graph-modules", "atn"])
    with pytest.raises(SystemExit) as info:
        arguments.parse_args()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "is not a CUDA graph module" in err


def test_after_uninstall_parse_args_rejects_cg_flags(monkeypatch, capsys):
    installation.install()
    installation.uninstall()
    monkeypatch.setattr(sys, "argv", ["script", *MEGATRON_FLAGS, "--cg-no-report"])
    with pytest.raises(SystemExit) as info:
        arguments.parse_args()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --cg-no-report" in err
    assert arguments.add_megatron_arguments is ORIGINAL_ADD_MEGATRON_ARGUMENTS
