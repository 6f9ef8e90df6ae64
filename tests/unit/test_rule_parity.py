"""The dry run and the run refuse the same flags: for each row of a table, the rules that
``megatron-cg check`` (``launch.dry_run.check``) reports broken are the ones the launcher's validation
(``install(launcher=True)`` + ``parse_megatron_args``, through Megatron's own ``validate_args``)
refuses, and both are what the row expects. Megatron's own rejections count as the rule
``megatron`` (``CheckError`` in the dry run, ``RunRefused`` naming ``megatron`` in the run)."""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

from megatron_cg_plugin import compat, host_stand_ins, installation, refusal, rules
from megatron_cg_plugin.data.synthetic import synthetic_documents, write_indexed_dataset
from megatron_cg_plugin.launch import dry_run, pretrain_gpt
from megatron_cg_plugin.launch.presets import MOE_FLAGS, PRESET_FLAGS

global_vars = importlib.import_module("megatron.training.global_vars")
microbatches = importlib.import_module("megatron.core.num_microbatches_calculator")

TE = ("--cuda-graph-impl", "transformer_engine")
GPT = ("--cg-preset", "tiny-gpt")
MOE = ("--cg-preset", "tiny-moe")
MOE_LAYERS = GPT + MOE_FLAGS  # tiny-moe's experts without its graph scope: whole layers
BANKS = ("--cg-graph-banks",)
DOCUMENTS = ("--dataloader-inter-document-masking",)  # packed (THD) microbatches without hybrid CP
# The farm's packed shape: 32 documents x 16 heads x 4096^2 = 2^33, past TE's deterministic THD limit (2^30).
LONG_PACKED = (
    GPT
    + DOCUMENTS
    + (
        "--seq-length",
        "4096",
        "--max-position-embeddings",
        "4096",
        "--num-attention-heads",
        "16",
        "--cg-thd-max-seqs",
        "32",
    )
)
DETERMINISTIC = ("--deterministic-mode",)
ENV_KEYS = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NCCL_GRAPH_REGISTER",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)
MEGATRON = "megatron"  # Megatron's own validate_args (or TransformerConfig) rejects the flags


def without(flags: tuple[str, ...], flag: str, values: int = 1) -> tuple[str, ...]:
    index = flags.index(flag)
    return flags[:index] + flags[index + 1 + values :]


HYBRID_CP = PRESET_FLAGS["tiny-gpt-hybrid-cp"]
assert "--rerun-mode" in HYBRID_CP and without(HYBRID_CP, "--rerun-mode") != HYBRID_CP


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    flags: tuple[str, ...]  # "{tmp}" is replaced by the test's tmp_path, "{data}" by a real dataset prefix
    expected: frozenset[str]
    nproc: int = 1
    environ: tuple[tuple[str, str], ...] = ()  # set for both paths (Megatron reads os.environ)


ROWS = (
    Row("tiny-gpt-graphed", GPT + TE, frozenset()),
    Row("tiny-gpt-eager", GPT, frozenset()),
    Row("tiny-moe-graphed", MOE + TE, frozenset()),  # the preset as given
    Row("tiny-moe-whole-layer-dropless", MOE_LAYERS + TE, frozenset({"whole-layer-moe-needs-drop-and-pad"})),
    Row(
        "tiny-moe-whole-layer-drop-and-pad",
        MOE_LAYERS + TE + ("--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"),
        frozenset(),
    ),
    Row(
        "hybrid-cp-without-rerun-mode-disabled",
        without(HYBRID_CP, "--rerun-mode"),
        frozenset({"hybrid-cp-rerun-mode"}),
        nproc=2,
    ),
    Row("hybrid-cp-banks", HYBRID_CP + TE + BANKS, frozenset(), nproc=2),
    Row("hybrid-cp-graphed-without-banks", HYBRID_CP + TE, frozenset({"hybrid-cp"}), nproc=2),
    Row("hybrid-cp-banks-fp8", HYBRID_CP + TE + BANKS + ("--fp8-format", "hybrid"), frozenset({"banks-fp8"}), nproc=2),
    # Slot capture refused FP8 MoE layers only at capture (their TE norm is a te.ops module); check says it first now.
    Row(
        "tiny-moe-slot-fp8",
        MOE + TE + ("--cuda-graph-modules", "attn", "--cg-slot-capture", "--fp8-format", "hybrid"),
        frozenset({"slot-capture-fp8-op-fuser"}),
    ),
    Row(
        "hybrid-cp-launcher-tp",
        (*HYBRID_CP, "--tensor-model-parallel-size", "2"),
        frozenset({"hybrid-cp-launcher-tp"}),
        nproc=4,
        environ=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),),
    ),
    Row(
        "offload-with-the-moe-block-graphed",
        MOE_LAYERS
        + TE
        + ("--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity")
        + (
            "--cuda-graph-modules",
            "attn",
            "moe",
            "--fine-grained-activation-offloading",
            "--offload-modules",
            "core_attn",
        ),
        frozenset({"offload-moe-scope"}),
        environ=(("NVTE_CPU_OFFLOAD_V1", "1"),),
    ),
    Row("thd-max-seqs-0", (*GPT, "--cg-thd-max-seqs", "0"), frozenset({"cg-flags"})),
    Row("packed-graphed-without-capacity", GPT + TE + DOCUMENTS, frozenset({"packed-sequences-te-graphs"})),
    Row("packed-graphed", GPT + TE + DOCUMENTS + ("--cg-thd-max-seqs", "16"), frozenset()),
    Row(
        "packed-graphed-attn-rope-unfused",
        GPT
        + TE
        + DOCUMENTS
        + (
            "--cg-thd-max-seqs",
            "16",
            "--cuda-graph-modules",
            "attn",
            "--position-embedding-type",
            "rope",
            "--no-rope-fusion",
        ),
        frozenset({"packed-graphs-rope"}),
    ),
    Row(
        "packed-graphed-slot-capture",
        GPT + TE + DOCUMENTS + ("--cg-thd-max-seqs", "16", "--cg-slot-capture"),
        frozenset({"packed-graphs-slot-capture"}),
    ),
    Row(
        "packed-graphed-deterministic-long",
        LONG_PACKED + TE + DETERMINISTIC,
        frozenset({"packed-graphs-deterministic-attention"}),
    ),
    Row(
        "packed-eager-deterministic-long",
        LONG_PACKED + DETERMINISTIC,  # the layout is the plugin's in eager steps too
        frozenset({"packed-graphs-deterministic-attention"}),
    ),
    Row(
        "packed-graphed-deterministic-bounded",
        LONG_PACKED + TE + DETERMINISTIC + ("--cg-thd-max-seqlen", "1448"),
        frozenset(),
    ),
    Row("packed-graphed-nondeterministic-long", LONG_PACKED + TE, frozenset()),
    Row(
        "packed-graphed-max-seqlen-above-seq-length",
        GPT + TE + DOCUMENTS + ("--cg-thd-max-seqs", "16", "--cg-thd-max-seqlen", "512"),
        frozenset({"thd-max-seqlen-bound"}),
    ),
    Row(
        "thd-max-seqlen-without-max-seqs",
        GPT + DOCUMENTS + ("--cg-thd-max-seqlen", "128"),
        frozenset({"thd-max-seqlen-without-packed-graphs"}),
    ),
    Row(
        "thd-max-seqlen-0",
        GPT + DOCUMENTS + ("--cg-thd-max-seqs", "16", "--cg-thd-max-seqlen", "0"),
        frozenset({"cg-flags"}),
    ),
    Row("packed-eager", GPT + DOCUMENTS, frozenset()),
    Row(
        "thd-max-seqs-unpacked-graphed",
        GPT + TE + ("--cg-thd-max-seqs", "4"),
        frozenset({"thd-max-seqs-without-packed-data"}),
    ),
    Row("sft-through-the-launcher", (*GPT, "--sft"), frozenset({"packed-launcher-sft"})),
    Row("report-out-directory", (*GPT, "--cg-report-out", "{tmp}"), frozenset({"cg-flags"})),
    Row("bank-min-cp-3", (*GPT, "--cg-bank-min-cp", "3"), frozenset({"cg-flags"})),
    Row("banks-without-hybrid-cp", GPT + TE + BANKS, frozenset({"banks-need-hybrid-cp"})),
    Row("missing-data-prefix", (*GPT, "--data-path", "{tmp}/no_such_prefix"), frozenset({"data-files"})),
    Row("real-data-prefix", GPT + TE + ("--data-path", "{data}"), frozenset()),
    Row("fp8-without-banks", GPT + TE + ("--fp8-format", "hybrid"), frozenset()),
    Row(
        "several-rules-at-once",
        MOE_LAYERS + TE + BANKS + ("--recompute-granularity", "full", "--recompute-method", "uniform"),
        frozenset({"whole-layer-moe-needs-drop-and-pad", "full-recompute", "banks-need-hybrid-cp"}),
    ),
    Row("slot-capture-without-te-graphs", (*GPT, "--cg-slot-capture"), frozenset({"cg-flags-need-te-graphs"})),
    Row("hybrid-cp-on-one-rank", HYBRID_CP, frozenset({"hybrid-cp-ranks"})),
    Row("num-layers-below-one", (*GPT, "--num-layers", "-2"), frozenset({"model-sizes"})),
    # Sizes are refused before Megatron computes from them: a 0 divides by zero, 1e20 layers exhaust the memory.
    Row("no-attention-heads", (*GPT, "--num-attention-heads", "0"), frozenset({"model-sizes"})),
    Row("absurd-layer-count", (*GPT, "--num-layers", "99999999999999999999"), frozenset({"model-sizes"})),
    Row("zero-hidden-size", (*GPT, "--hidden-size", "0"), frozenset({"model-sizes"})),
    Row(
        "topk-over-experts",
        (*GPT, "--num-experts", "4", "--moe-router-topk", "5", "--moe-token-dispatcher-type", "alltoall"),
        frozenset({"moe-topk-over-experts"}),
    ),
    Row("megatron-assertion", GPT + TE + ("--fp16",), frozenset({MEGATRON})),  # the preset's --bf16: a bare assert
    # Sizes and intervals validate_args asserts bare (or words for its evaluation batch): named before it runs.
    Row("hidden-not-split-by-heads", GPT + TE + ("--num-attention-heads", "3"), frozenset({"heads-divide-hidden"})),
    Row("global-batch-over-two-ranks", (*GPT, "--global-batch-size", "6"), frozenset({"global-batch-size"}), nproc=2),
    Row("log-interval-0", (*GPT, "--log-interval", "0"), frozenset({"loop-intervals"})),
    # What Megatron builds after validating the flags, built on CPU with its own code in both paths.
    Row(
        "sentencepiece-model-is-a-folder",
        (*GPT, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{tmp}"),
        frozenset({"tokenizer-build"}),
    ),
    Row("warmup-as-long-as-training", (*GPT, "--lr-warmup-iters", "30"), frozenset({"optimizer-setup"})),
    Row("split-all-zero", (*GPT, "--data-path", "{data}", "--split", "0,0,0"), frozenset({"data-blend-split"})),
    Row(
        "ffn-not-split-by-tp",
        (*GPT, "--ffn-hidden-size", "1023", "--tensor-model-parallel-size", "2"),
        frozenset({"tensor-parallel-split"}),
        nproc=2,
        environ=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),),
    ),
    Row("megatron-assertion-with-message", (*GPT, "--mock-data", "--data-path", "{tmp}/x"), frozenset({MEGATRON})),
    # Megatron stops first (world size 1 < PP 2), and the plugin's rule is named beside it in both.
    Row(
        "slot-capture-pp2-on-one-rank",
        GPT + TE + ("--cg-slot-capture", "--pipeline-model-parallel-size", "2"),
        frozenset({"slot-capture-pipeline", MEGATRON}),
    ),
)

# Rows that once disagreed: Megatron's ValueError in validate_args, and TransformerConfig's own
# checks (which the launcher's validation now runs as check does).
FORMER_MISMATCHES = (
    Row("megatron-value-error", (*GPT, "--fp4-param-gather"), frozenset({MEGATRON})),
    Row("transformer-config-only", (*GPT, "--fp8-param-gather", "--use-distributed-optimizer"), frozenset({MEGATRON})),
)


def reset_megatron_globals() -> None:
    global_vars.unset_global_variables()
    microbatches.unset_num_microbatches_calculator()


@pytest.fixture(autouse=True)
def clean_process(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    # The run's validate_args under --deterministic-mode sets these (and torch's switch) for the process.
    environ, deterministic = dict(os.environ), torch.are_deterministic_algorithms_enabled()
    installation.uninstall()
    reset_megatron_globals()
    yield
    installation.uninstall()
    reset_megatron_globals()
    os.environ.clear()
    os.environ.update(environ)
    torch.use_deterministic_algorithms(deterministic)
    assert installation.active_session() is None


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("parity_data") / "tokens"
    write_indexed_dataset(prefix, synthetic_documents(40, vocab_size=1024, seed=3, max_length=300), eod=1023)
    return str(prefix)


def dry_run_verdict(flags: list[str], nproc: int) -> tuple[frozenset[str], dict[str, str]]:
    """The rules ``megatron-cg check`` reports broken (and their messages)."""
    assert installation.active_session() is None  # check validates with Megatron's own validate_args
    try:
        plan = dry_run.check(flags, nproc=nproc, env={})
    except rules.RuleViolation as violation:
        return frozenset(name for name, _ in violation.violations), dict(violation.violations)
    except dry_run.CheckError as error:  # Megatron's refusal, after the plugin's rules the flags break too
        assert dict(error.violations)[MEGATRON] in str(error), error
        return frozenset(name for name, _ in error.violations), dict(error.violations)
    assert "scope:" in plan or "eager run" in plan, plan
    return frozenset(), {}


def run_verdict(flags: list[str], nproc: int, monkeypatch) -> tuple[frozenset[str], dict[str, str]]:
    """The rules the launcher's validation refuses the run for, on rank 0 of ``nproc``."""
    with monkeypatch.context() as patch:
        patch.setenv("WORLD_SIZE", str(nproc))  # as dry_run.check's _env sets them
        patch.setenv("RANK", "0")
        patch.setenv("LOCAL_RANK", "0")
        patch.setattr(compat, "te_available", lambda: True)  # check assumes TE on the GPU host
        installation.install(launcher=True)
        try:
            with host_stand_ins.gpu_host_stand_ins():
                args = pretrain_gpt.parse_megatron_args(flags)
        except refusal.RunRefused as refused:
            return frozenset(name for name, _ in refused.violations), dict(refused.violations)
        finally:
            installation.uninstall()
            reset_megatron_globals()
    assert args.world_size == nproc
    return frozenset(), {}


def _flags(row: Row, tmp_path, data_prefix) -> list[str]:
    return [flag.replace("{tmp}", str(tmp_path)).replace("{data}", data_prefix) for flag in row.flags]


@pytest.mark.parametrize("row", [pytest.param(row, id=row.id) for row in (*ROWS, *FORMER_MISMATCHES)])
def test_dry_run_and_run_refuse_the_same_rules(row, tmp_path, data_prefix, monkeypatch, capsys):
    flags = _flags(row, tmp_path, data_prefix)
    for key, value in row.environ:
        monkeypatch.setenv(key, value)
    dry, dry_messages = dry_run_verdict(flags, row.nproc)
    assert os.environ.get("WORLD_SIZE") is None  # check put the environment back
    run, run_messages = run_verdict(flags, row.nproc, monkeypatch)
    capsys.readouterr()
    assert dry == run, f"check: {sorted(dry)}, run: {sorted(run)}"
    assert dry == row.expected
    assert dry_messages == run_messages  # the same words for the same rule


def test_table_covers_every_kind_of_rule():
    names = set().union(*(row.expected for row in ROWS))
    assert {"cg-flags", "data-files", "banks-fp8", "hybrid-cp-rerun-mode", MEGATRON} <= names
    assert names - {MEGATRON} <= {rule.name for rule in rules.RULES}
    assert sum(not row.expected for row in ROWS) >= 4  # valid rows too
    assert len({row.id for row in ROWS}) == len(ROWS) >= 10
