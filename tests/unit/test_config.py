"""Tests for megatron_cg_plugin.config (PluginConfig, the --cg-* flags) and the launcher presets."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from megatron_cg_plugin.config import PRESETS, ContractCheck, PluginConfig, add_plugin_args, config_from_args
from megatron_cg_plugin.launch.presets import PRESET_FLAGS, expand_preset, find_preset

# -- PluginConfig -----------------------------------------------------------------------------------


def test_defaults():
    config = PluginConfig()
    assert (config.preset, config.metrics_out, config.report_out, config.print_report) == (None, None, None, True)


@pytest.mark.parametrize("preset", PRESETS)
def test_known_presets_accepted(preset):
    assert PluginConfig(preset=preset).preset == preset


@pytest.mark.parametrize("bad", ["tiny", "TINY-GPT", "", "gpt"])
def test_unknown_preset_rejected(bad):
    with pytest.raises(ValueError, match="--cg-preset") as info:
        PluginConfig(preset=bad)
    for valid in PRESETS:
        assert valid in str(info.value)


@pytest.mark.parametrize("field, flag", [("metrics_out", "--cg-metrics-out"), ("report_out", "--cg-report-out")])
def test_directory_output_rejected(tmp_path, field, flag):
    with pytest.raises(ValueError, match=flag) as info:
        PluginConfig(**{field: tmp_path})
    assert "directory" in str(info.value)
    assert str(tmp_path / "out.json") in str(info.value)


def test_file_outputs_accepted(tmp_path):
    existing = tmp_path / "existing.json"
    existing.write_text("{}")
    config = PluginConfig(metrics_out=existing, report_out=tmp_path / "new" / "report.json")
    assert config.metrics_out == existing


def test_same_output_file_rejected(tmp_path):
    with pytest.raises(ValueError, match="--cg-metrics-out and --cg-report-out"):
        PluginConfig(metrics_out=tmp_path / "x.json", report_out=tmp_path / "x.json")


def test_same_output_file_rejected_through_different_spellings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="same file"):
        PluginConfig(metrics_out=Path("sub/../x.json"), report_out=tmp_path / "x.json")


def test_frozen():
    config = PluginConfig(preset="tiny-gpt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.preset = "tiny-moe"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.print_report = False


def test_replace_revalidates(tmp_path):
    with pytest.raises(ValueError, match="--cg-report-out"):
        dataclasses.replace(PluginConfig(), report_out=tmp_path)


def test_the_contract_check_is_parsed_once_into_its_enum():
    """Given as the flag spells it or as the enum, the config holds the enum: every later reader
    compares enum members and checks nothing again."""
    assert PluginConfig().contract_check is ContractCheck.FULL
    assert PluginConfig(contract_check="shapes").contract_check is ContractCheck.SHAPES
    assert PluginConfig(contract_check="off") == PluginConfig(contract_check=ContractCheck.OFF)
    assert dataclasses.replace(PluginConfig(), contract_check="off").contract_check is ContractCheck.OFF
    assert f"--cg-contract-check {ContractCheck.OFF}" == "--cg-contract-check off"  # printed as spelled


@pytest.mark.parametrize("bad", ["strict", "FULL", ""])
def test_an_unknown_contract_check_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match=f"--cg-contract-check '{bad}' is unknown; use one of full, shapes, off\\."):
        PluginConfig(contract_check=bad)


def test_keyword_only():
    with pytest.raises(TypeError):
        PluginConfig("tiny-gpt")


# -- flags ------------------------------------------------------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser()
    assert add_plugin_args(parser) is parser
    return parser.parse_args(argv)


def test_flags_into_config(tmp_path):
    args = parse(
        [
            "--cg-preset",
            "tiny-moe",
            "--cg-metrics-out",
            str(tmp_path / "m.json"),
            "--cg-report-out",
            str(tmp_path / "r.json"),
            "--cg-no-report",
        ]
    )
    config = config_from_args(args)
    assert config == PluginConfig(
        preset="tiny-moe", metrics_out=tmp_path / "m.json", report_out=tmp_path / "r.json", print_report=False
    )
    assert isinstance(config.metrics_out, Path)


def test_flag_defaults_into_config():
    assert config_from_args(parse([])) == PluginConfig()


def test_the_contract_check_flag_becomes_its_enum():
    assert config_from_args(parse(["--cg-contract-check", "shapes"])).contract_check is ContractCheck.SHAPES


def test_the_packed_max_seqlen_flag():
    assert config_from_args(parse([])).thd_max_seqlen is None  # --seq-length
    config = config_from_args(parse(["--cg-thd-max-seqs", "32", "--cg-thd-max-seqlen", "600"]))
    assert (config.thd_max_seqs, config.thd_max_seqlen) == (32, 600)
    assert PluginConfig(thd_max_seqlen=1).thd_max_seqlen == 1
    for bad in (0, -4):
        with pytest.raises(ValueError, match=f"--cg-thd-max-seqlen {bad} must be >= 1"):
            config_from_args(parse(["--cg-thd-max-seqlen", str(bad)]))


def test_the_memory_budget_flag():
    assert config_from_args(parse([])).memory_budget_gib is None  # what the GPU has free
    assert config_from_args(parse(["--cg-memory-budget-gib", "12.5"])).memory_budget_gib == 12.5
    for bad in ("0", "-4", "nan", "inf"):
        with pytest.raises(ValueError, match=r"--cg-memory-budget-gib \S+ must be a number of GiB above 0"):
            config_from_args(parse(["--cg-memory-budget-gib", bad]))


def test_flag_rejects_unknown_preset(capsys):
    with pytest.raises(SystemExit):
        parse(["--cg-preset", "huge"])
    assert "--cg-preset" in capsys.readouterr().err


def test_flags_validated_through_config(tmp_path):
    args = parse(["--cg-metrics-out", str(tmp_path)])
    with pytest.raises(ValueError, match="--cg-metrics-out"):
        config_from_args(args)


@pytest.mark.parametrize(
    "namespace",
    [
        argparse.Namespace(),
        argparse.Namespace(num_layers=2, cg_preset=None),  # partly there
    ],
)
def test_config_from_args_without_plugin_flags(namespace):
    with pytest.raises(ValueError, match="add_plugin_args") as info:
        config_from_args(namespace)
    assert "cg_no_report" in str(info.value)


# -- presets ----------------------------------------------------------------------------------------


def test_presets_match_config():
    assert set(PRESET_FLAGS) == set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_never_turn_graphs_on(preset):
    assert "--cuda-graph-impl" not in PRESET_FLAGS[preset]
    # tiny-moe names the scope Megatron graphs a dropless MoE with, so it passes check as given.
    scope = [flag for flag in PRESET_FLAGS[preset] if flag.startswith("--cuda-graph")]
    assert scope == (["--cuda-graph-modules"] if preset == "tiny-moe" else [])


@pytest.mark.parametrize(
    "user", [["--cuda-graph-modules", "attn"], ["--cuda-graph-scope", "attn"], ["--cuda-graph-modules=attn"]]
)
def test_a_users_graph_scope_replaces_the_presets(user):
    expanded = expand_preset(["--cg-preset", "tiny-moe", *user])
    assert "moe_router" not in expanded and expanded[-len(user) :] == user
    assert expanded.count("--num-experts") == 1  # the rest of the preset stays


@pytest.mark.parametrize("spelling", [["--cg-preset", "tiny-gpt"], ["--cg-preset=tiny-gpt"]])
def test_expand_preset_puts_preset_first(spelling):
    user = ["--num-layers", "4", *spelling, "--cuda-graph-impl", "transformer_engine"]
    expanded = expand_preset(user)
    preset = list(PRESET_FLAGS["tiny-gpt"])
    assert expanded[: len(preset)] == preset
    assert expanded[len(preset) :] == user


def test_expand_without_preset_is_identity():
    user = ["--num-layers", "4"]
    assert expand_preset(user) == user
    assert expand_preset(user) is not user
    assert expand_preset([]) == []


def test_last_preset_wins():
    assert find_preset(["--cg-preset", "tiny-gpt", "--cg-preset=tiny-moe"]) == "tiny-moe"
    assert expand_preset(["--cg-preset=tiny-gpt", "--cg-preset", "tiny-moe"])[: len(PRESET_FLAGS["tiny-moe"])] == list(
        PRESET_FLAGS["tiny-moe"]
    )


@pytest.mark.parametrize("argv", [["--cg-preset", "huge"], ["--cg-preset=huge"], ["--cg-preset="]])
def test_unknown_preset_lists_valid_ones(argv):
    with pytest.raises(ValueError, match="unknown") as info:
        expand_preset(argv)
    for valid in PRESETS:
        assert valid in str(info.value)


def test_missing_preset_value():
    with pytest.raises(ValueError, match="needs a value"):
        expand_preset(["--num-layers", "4", "--cg-preset"])


@pytest.fixture
def megatron_parse(monkeypatch):
    from megatron_cg_plugin.launch.pretrain_gpt import parse_megatron_args

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    return lambda argv: parse_megatron_args(argv, validate=False)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_parses_with_megatron(megatron_parse, preset):
    import sys

    argv_before = list(sys.argv)
    args = megatron_parse(["--cg-preset", preset])
    assert sys.argv == argv_before  # the parser's sys.argv swap is undone
    assert args.cg_preset == preset
    hybrid = preset == "tiny-gpt-hybrid-cp"
    assert args.num_layers == 2 and args.hidden_size == 256 and args.micro_batch_size == (1 if hybrid else 2)
    assert args.global_batch_size == (4 if hybrid else 8) and args.mock_data and args.bf16
    assert args.hybrid_context_parallel is hybrid
    if hybrid:  # what the launcher's hybrid-CP data path needs (check_hybrid_cp_launch)
        assert args.max_seqlen_per_dp_cp_rank == 256 and args.rerun_mode == "disabled"
        assert args.dataloader_inter_document_masking and args.calculate_per_token_loss
        assert args.position_embedding_type == "rope" and args.apply_rope_fusion
    assert args.gradient_accumulation_fusion is False
    assert args.cuda_graph_impl == "none"
    assert args.num_experts == (4 if preset == "tiny-moe" else None)
    assert config_from_args(args) == PluginConfig(preset=preset)


@pytest.mark.parametrize("preset", PRESETS)
def test_user_flags_override_preset(megatron_parse, preset):
    args = megatron_parse(
        [
            "--cg-preset",
            preset,
            "--num-layers",
            "4",
            "--micro-batch-size",
            "1",
            "--cuda-graph-impl",
            "transformer_engine",
        ]
    )
    assert args.num_layers == 4 and args.micro_batch_size == 1
    assert args.cuda_graph_impl == "transformer_engine"
    assert args.hidden_size == 256  # untouched preset flags stay


def test_user_flags_before_preset_also_win(megatron_parse):
    args = megatron_parse(["--num-layers", "6", "--cg-preset=tiny-moe", "--num-experts", "8"])
    assert args.num_layers == 6 and args.num_experts == 8


@pytest.mark.parametrize("value, expected", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_slot_debug_from_environment(value, expected):
    from megatron_cg_plugin.config import SLOT_DEBUG_ENV, slot_debug_from_environment

    environ = {} if value is None else {SLOT_DEBUG_ENV: value}
    assert slot_debug_from_environment(environ) is expected


def test_slot_debug_refuses_what_it_does_not_understand():
    from megatron_cg_plugin.config import slot_debug_from_environment

    with pytest.raises(ValueError, match="MEGATRON_CG_SLOT_DEBUG='yes' is not understood; set it to 1"):
        slot_debug_from_environment({"MEGATRON_CG_SLOT_DEBUG": "yes"})


@pytest.mark.parametrize(
    "drop, rule, message",
    [
        ("--rerun-mode", "hybrid-cp-rerun-mode", "--rerun-mode disabled"),
        ("--dataloader-inter-document-masking", "hybrid-cp-document-masking", "--dataloader-inter-document-masking"),
        ("--max-seqlen-per-dp-cp-rank", "hybrid-cp-seqlen-per-rank", "--max-seqlen-per-dp-cp-rank N"),
    ],
)
def test_hybrid_cp_rules_name_what_the_data_path_needs(megatron_parse, monkeypatch, drop, rule, message):
    from megatron_cg_plugin.launch.presets import PRESET_FLAGS
    from megatron_cg_plugin.rules import RuleViolation, check_run

    flags = list(PRESET_FLAGS["tiny-gpt-hybrid-cp"])
    index = flags.index(drop)
    del flags[index : index + (1 if drop == "--dataloader-inter-document-masking" else 2)]
    if drop == "--rerun-mode":
        flags += ["--rerun-mode", "validate_results"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # hybrid CP needs 2 or more ranks (rule hybrid-cp-ranks)
    check_run(megatron_parse(list(PRESET_FLAGS["tiny-gpt-hybrid-cp"])), env={}, launcher=True)  # the preset passes
    with pytest.raises(RuleViolation) as info:
        check_run(megatron_parse(flags), env={}, launcher=True)
    assert [(name, message in text) for name, text in info.value.violations] == [(rule, True)]


def test_preset_mock_data_gives_way_to_a_data_path(megatron_parse):
    args = megatron_parse(
        [
            "--cg-preset",
            "tiny-gpt",
            "--data-path",
            "0.3",
            "/data/a_text_document",
            "0.7",
            "/data/b_text_document",
            "--split",
            "99,1,0",
        ]
    )
    assert not args.mock_data and args.data_path == ["0.3", "/data/a_text_document", "0.7", "/data/b_text_document"]
    assert args.split == "99,1,0"
    assert megatron_parse(["--cg-preset", "tiny-gpt", "--train-data-path=/d/t"]).mock_data is False
    assert megatron_parse(["--cg-preset", "tiny-gpt"]).mock_data is True
