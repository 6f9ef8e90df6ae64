"""Tests for the ``validate-args-rules`` patch: with ``install()`` active, Megatron's own
``parse_and_validate_args`` (megatron-core 0.19.2, on CPU with ``gpu_host_stand_ins``) runs the
plugin's rules and stops a broken run with one line per rule (``refusal.RunRefused``)."""

from __future__ import annotations

import importlib
import sys

import pytest

from megatron_cg_plugin import compat, host_stand_ins, installation, refusal
from megatron_cg_plugin.host_stand_ins import gpu_host_stand_ins
from megatron_cg_plugin.launch.presets import PRESET_FLAGS

arguments = importlib.import_module("megatron.training.arguments")
global_vars = importlib.import_module("megatron.training.global_vars")
microbatches = importlib.import_module("megatron.core.num_microbatches_calculator")

TINY_GPT = list(PRESET_FLAGS["tiny-gpt"])  # spelled out: Megatron's parser does not expand --cg-preset
TE = ["--cuda-graph-impl", "transformer_engine"]
WITH_FUSION = [flag for flag in TINY_GPT if flag != "--no-gradient-accumulation-fusion"]
PREFIX = "megatron-cg-plugin: "


def reset_megatron_globals() -> None:
    global_vars.unset_global_variables()  # args, tokenizer, timers, ... and the microbatch calculator
    global_vars.destroy_global_vars()
    microbatches.unset_num_microbatches_calculator()


@pytest.fixture(autouse=True)
def plugin(monkeypatch):
    """The plugin installed (its config deferred to the --cg-* flags), TE present as on the GPU host,
    a one-rank environment and no Megatron globals; everything put back after."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_GRAPH_REGISTER"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(compat, "te_available", lambda: True)
    installation.uninstall()
    reset_megatron_globals()
    session = installation.install()
    try:
        yield session
    finally:
        installation.uninstall()
        reset_megatron_globals()
    assert installation.active_session() is None


def parse_and_validate(monkeypatch, flags):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    with gpu_host_stand_ins():
        return arguments.parse_and_validate_args()


def refused(monkeypatch, capsys, flags) -> tuple[refusal.RunRefused, str]:
    with pytest.raises(refusal.RunRefused) as info:
        parse_and_validate(monkeypatch, flags)
    out, err = capsys.readouterr()
    assert out == ""  # Megatron's printout of every argument is held back (in a log) when the run stops here
    assert isinstance(info.value, SystemExit)
    assert info.value.code == 2
    assert "Traceback" not in err
    return info.value, err


def plugin_block(err: str) -> list[str]:
    """The refusal the plugin printed, first: its cause (the first broken rule) on the plugin's line, the other
    rules indented under it, then one line pointing to the docs."""
    lines = err.splitlines()
    assert lines and lines[0].startswith(f"{PREFIX}["), err
    block = lines[:1]
    for line in lines[1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    assert block[-1] == f"  ({len(block) - 1} rule{'s' if len(block) > 2 else ''} broken: see docs/troubleshooting.md)"
    return block


def test_rule_violation_stops_validation_with_one_line_per_rule(monkeypatch, capsys):
    run_refused, err = refused(monkeypatch, capsys, [*WITH_FUSION, *TE])
    assert [name for name, _ in run_refused.violations] == ["gradient-accumulation-fusion"]
    block = plugin_block(err)
    assert len(block) == 2, err
    assert block[0].startswith(f"{PREFIX}[gradient-accumulation-fusion] ")
    assert "--no-gradient-accumulation-fusion" in block[0]


TINY_MOE = list(PRESET_FLAGS["tiny-moe"])


def validated_on_this_host(monkeypatch, flags):
    """Megatron's parse_and_validate_args as a script calls it, on a host without a GPU (this one, or any:
    ``gpu_missing`` says so), with no stand-ins around it."""
    monkeypatch.setattr(host_stand_ins, "gpu_missing", lambda: True)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    return arguments.parse_and_validate_args()


def test_without_a_gpu_the_flags_are_checked_as_on_the_gpu_host_first(monkeypatch, capsys):
    """Megatron asks the device about an MoE model's grouped GEMM: without a GPU that read as Megatron
    refusing the flags ("Found no NVIDIA driver"), before the rule the flags break."""
    with pytest.raises(refusal.RunRefused):
        validated_on_this_host(monkeypatch, [*TINY_MOE, *TE, "--cg-thd-max-seqlen", "5"])
    out, err = capsys.readouterr()
    assert out == "" and "NVIDIA driver" not in err
    assert plugin_block(err)[0].startswith(f"{PREFIX}[thd-max-seqlen-without-packed-graphs] ")


def test_without_a_gpu_flags_that_pass_are_refused_naming_the_host(monkeypatch, capsys):
    with pytest.raises(refusal.RunRefused) as info:
        validated_on_this_host(monkeypatch, TINY_MOE)
    assert info.value.code == 2 and info.value.violations == []
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[0] == (
        f"{PREFIX}this host has no CUDA GPU, which training needs (the flags pass Megatron's checks and the "
        "plugin's rules; megatron-cg check validates flags on a machine without one)."
    )


def test_several_broken_rules_each_get_a_line_and_the_hosts_come_once_the_flags_pass(plugin, monkeypatch, capsys):
    flags = [*WITH_FUSION, *TE, "--recompute-granularity", "full", "--recompute-method", "uniform", "--cg-graph-banks"]
    run_refused, err = refused(monkeypatch, capsys, flags)
    names = [name for name, _ in run_refused.violations]
    # APEX (gradient-accumulation-fusion) is what this host lacks: asked once the flags' own rules pass
    assert names == ["full-recompute", "banks-need-hybrid-cp"]
    block = plugin_block(err)
    assert len(block) == 1 + len(names)
    assert [line.split("]")[0] for line in block[:-1]] == [f"{PREFIX}[{names[0]}", *(f"  [{n}" for n in names[1:])]
    assert not plugin.config_resolved  # flags a rule refuses do not get a config


def test_without_te_the_te_rule_fires_too(monkeypatch, capsys):
    monkeypatch.setattr(compat, "te_available", lambda: False)
    run_refused, _ = refused(monkeypatch, capsys, [*TINY_GPT, *TE])
    assert [name for name, _ in run_refused.violations] == ["te-installed"]


@pytest.mark.parametrize(
    "local_rank, printed",
    [
        ("1", False),  # other ranks of a node stay silent, but stop too
        ("0", True),  # each node's first rank says why (files and environment differ between hosts)
    ],
)
def test_ranks_other_than_zero(monkeypatch, capsys, local_rank, printed):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    waits: list[float] = []
    monkeypatch.setattr(refusal.time, "sleep", waits.append)
    run_refused, err = refused(monkeypatch, capsys, [*WITH_FUSION, *TE])
    assert [name for name, _ in run_refused.violations] == ["gradient-accumulation-fusion"]
    assert ("[gradient-accumulation-fusion]" in err) is printed
    # torchrun stops every rank when the first exits: a silent rank waits for the one saying why
    assert waits == ([] if printed else [refusal.SILENT_RANK_GRACE_S])
    if not printed:
        assert err.strip() == ""


def test_bad_cg_value_is_the_cg_flags_rule(monkeypatch, capsys):
    run_refused, err = refused(monkeypatch, capsys, [*TINY_GPT, "--cg-thd-max-seqs", "0"])
    assert [name for name, _ in run_refused.violations] == ["cg-flags"]
    assert "--cg-thd-max-seqs 0 must be >= 1" in run_refused.violations[0][1]
    assert len(plugin_block(err)) == 2


def test_megatron_assertion_is_one_line_naming_megatron(monkeypatch, capsys):
    run_refused, err = refused(monkeypatch, capsys, [*TINY_GPT, "--data-path", "x"])  # with the preset's --mock-data
    assert [name for name, _ in run_refused.violations] == ["megatron"]
    message = run_refused.violations[0][1]
    assert message.startswith("A single data source must be provided")
    assert "megatron/training/arguments.py:" in message  # the failing check's line
    assert plugin_block(err)[0] == f"{PREFIX}[megatron] {message}"


def test_the_plugins_rules_come_first_when_megatron_refuses_the_flags_too(monkeypatch, capsys):
    """One rank with PP 2: Megatron's world-size assertion stops validate_args before the rules run."""
    run_refused, err = refused(
        monkeypatch, capsys, [*TINY_GPT, *TE, "--cg-slot-capture", "--pipeline-model-parallel-size", "2"]
    )
    assert [name for name, _ in run_refused.violations] == ["slot-capture-pipeline", "megatron"]
    block = plugin_block(err)
    assert len(block) == 3 and block[0].startswith(f"{PREFIX}[slot-capture-pipeline] ")
    assert block[1] == f"  [megatron] {run_refused.violations[1][1]}"
    assert "world size (1)" in block[1]


def test_megatron_assertion_without_a_message_names_the_check(monkeypatch, capsys):
    run_refused, _ = refused(monkeypatch, capsys, [*TINY_GPT, "--fp16"])  # beside the preset's --bf16
    [(name, message)] = run_refused.violations
    assert name == "megatron"
    assert message.startswith("(no message) [megatron/training/arguments.py:")
    assert "args.bf16" in message


def test_a_bare_assertion_the_plugin_names_first_stops_the_run_naming_the_flag(monkeypatch, capsys):
    """validate_args asserts hidden % heads without a message; the early rule names both flags first."""
    run_refused, _ = refused(monkeypatch, capsys, [*TINY_GPT, "--num-attention-heads", "3"])
    [(name, message)] = run_refused.violations
    assert name == "heads-divide-hidden" and "(--hidden-size 256, --num-attention-heads 3)" in message


@pytest.mark.parametrize(
    "flags",
    [
        ["--fp4-param-gather"],  # ValueError: must be used together with --fp4-format
        ["--no-position-embedding", "--position-embedding-type", "learned_absolute"],  # RuntimeError
    ],
)
def test_megatron_value_error_is_one_line_too(monkeypatch, capsys, flags):
    run_refused, err = refused(monkeypatch, capsys, [*TINY_GPT, *flags])
    assert [name for name, _ in run_refused.violations] == ["megatron"]
    assert len(plugin_block(err)) == 2


def test_valid_flags_pass_and_resolve_the_config_from_cg_flags(plugin, monkeypatch, capsys, tmp_path):
    report = tmp_path / "report.json"
    args = parse_and_validate(
        monkeypatch, [*TINY_GPT, *TE, "--cg-contract-check", "shapes", "--cg-no-report", "--cg-report-out", str(report)]
    )
    assert "megatron-cg-plugin" not in capsys.readouterr().err
    assert global_vars.get_args() is args  # parse_and_validate_args went on to set Megatron's globals
    assert plugin.config_resolved
    config = installation.active_session().config
    assert config.contract_check == "shapes"
    assert config.print_report is False
    assert config.report_out == report
    assert config.graph_banks is False


def test_explicit_config_wins_over_cg_flags(monkeypatch):
    from megatron_cg_plugin.config import PluginConfig

    installation.uninstall()
    explicit = PluginConfig(thd_max_seqs=4)  # not a graphs-only flag: TINY_GPT trains without graphs
    session = installation.install(explicit)
    parse_and_validate(monkeypatch, [*TINY_GPT, "--cg-thd-max-seqs", "2"])
    assert session.config is explicit


def test_uninstalled_validation_does_not_run_the_rules(monkeypatch):
    installation.uninstall()
    args = parse_and_validate(monkeypatch, [*WITH_FUSION, *TE])  # would break gradient-accumulation-fusion
    assert args.gradient_accumulation_fusion is True
    assert not hasattr(args, "cg_preset")  # nor add the --cg-* flags


@pytest.mark.parametrize("impl", ["none", "local"])
def test_graph_only_cg_flags_without_te_graphs_stop_the_run(monkeypatch, capsys, impl):
    """A launcher run or any script with install(): --cg-slot-capture would otherwise do nothing."""
    run_refused, err = refused(monkeypatch, capsys, [*TINY_GPT, "--cuda-graph-impl", impl, "--cg-slot-capture"])
    assert [name for name, _ in run_refused.violations] == ["cg-flags-need-te-graphs"]
    assert "--cg-slot-capture" in err and "add --cuda-graph-impl transformer_engine" in err


def test_an_explicit_graph_only_config_without_te_graphs_is_refused_too(monkeypatch, capsys):
    from megatron_cg_plugin.config import PluginConfig

    installation.uninstall()
    installation.install(PluginConfig(slot_capture=True))
    run_refused, err = refused(monkeypatch, capsys, TINY_GPT)
    assert [name for name, _ in run_refused.violations] == ["cg-flags-need-te-graphs"]
    assert "--cg-slot-capture (--cuda-graph-impl none)" in err


def test_a_flag_megatron_requires_is_named(monkeypatch, capsys):
    flags = list(TINY_GPT)
    index = flags.index("--micro-batch-size")
    del flags[index : index + 2]
    run_refused, err = refused(monkeypatch, capsys, flags)
    assert [name for name, _ in run_refused.violations] == ["megatron"]
    assert plugin_block(err)[0].startswith(f"{PREFIX}[megatron] --micro-batch-size is not given, and Megatron needs it")


OFFLOAD = [
    "--fine-grained-activation-offloading",
    "--offload-modules",
    "core_attn",
    "--min-offloaded-tensor-size",
    "1024",
]
STAGED = dict(slot_capture=True, offload_copies="between-replays", offload_window=2)


def test_the_graph_memory_prediction_follows_the_explicit_config_not_the_flags(monkeypatch):
    """An ``install(config)`` config, not the ``--cg-*`` flags' defaults, shapes the prediction: the
    staging ring of ``offload_window + 1`` buffers between replays, and no note about in-graph copies."""
    from megatron_cg_plugin.config import PluginConfig

    staged_flags = ["--cg-slot-capture", "--cg-offload-copies", "between-replays", "--cg-offload-window", "2"]
    parse_and_validate(monkeypatch, [*TINY_GPT, *TE, *OFFLOAD, *staged_flags])
    from_flags = installation.active_session().prediction.graph_memory
    installation.uninstall()
    reset_megatron_globals()
    session = installation.install(PluginConfig(**STAGED))
    parse_and_validate(monkeypatch, [*TINY_GPT, *TE, *OFFLOAD])  # the flags say in-graph, window 1
    predicted = session.prediction.graph_memory
    assert predicted.arena_bytes == from_flags.arena_bytes and predicted.host_arena_bytes > 0
    assert predicted.unpredicted == from_flags.unpredicted
    assert not any("in-graph offload" in what for what in predicted.unpredicted)
