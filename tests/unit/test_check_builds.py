"""``megatron-cg check`` accepts nothing that Megatron's CPU-buildable steps refuse, and refuses nothing they build.

Between parsing the flags and the first step Megatron builds the tokenizer, the micro-batch calculator, the
model's configs, the optimizer's configs and learning-rate schedule and the datasets' configs, and its training
loop divides by its intervals. Three tables hold the check to that:

- bad inputs: each is refused by ``check`` with exit 2, naming the rule and the flag, without a traceback;
- Megatron's own code refuses them too (the ones whose failing step runs on CPU: the rules are not stricter);
- accepted inputs (every preset and realistic variations): what ``check`` passes, Megatron builds on CPU with its
  own code, from the same validated flags (the tokenizers a hub must send excepted).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import io
import json
import os

import pytest

from megatron_cg_plugin import cli, console, host_stand_ins, installation
from megatron_cg_plugin.data.synthetic import synthetic_documents, write_indexed_dataset
from megatron_cg_plugin.launch import dry_run, pretrain_gpt
from megatron_cg_plugin.launch.presets import PRESET_FLAGS

global_vars = importlib.import_module("megatron.training.global_vars")
microbatches = importlib.import_module("megatron.core.num_microbatches_calculator")

GPT = ("--cg-preset", "tiny-gpt")
MOE = ("--cg-preset", "tiny-moe")
# A model without a preset, as a newcomer types it: Megatron defaults neither a training length nor a learning rate.
MODEL = tuple(
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 --seq-length 64 "
    "--micro-batch-size 1 --no-gradient-accumulation-fusion".split()
)
BARE = (*MODEL, "--train-iters", "5", "--lr", "1e-4")
TENSOR_PARALLEL = (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)  # Megatron's validate_args asks for it with TP > 1


@dataclasses.dataclass(frozen=True)
class Bad:
    id: str
    flags: tuple[str, ...]  # "{tmp}" is the test's tmp_path (files made by the `files` fixture)
    rule: str
    named: str  # what stderr must say: the flag with its value, or Megatron's words
    nproc: int = 1
    environ: tuple[tuple[str, str], ...] = ()
    flag: str | None = None  # the flag to change, where ``named`` does not start with it

    @property
    def to_change(self) -> str:
        return self.flag or self.named


BAD = (
    # -- the training loop's intervals and length --
    Bad("log-interval-0", (*GPT, "--log-interval", "0"), "loop-intervals", "--log-interval 0"),
    Bad("eval-interval-0", (*GPT, "--eval-interval", "0"), "loop-intervals", "--eval-interval 0"),
    Bad(
        "eval-interval-negative-with-eval-iters",
        (*GPT, "--eval-interval", "-5", "--eval-iters", "2"),
        "loop-intervals",
        "--eval-interval -5",
    ),
    Bad(
        "tensorboard-log-interval-0",
        (*GPT, "--tensorboard-dir", "{tmp}/tb", "--tensorboard-log-interval", "0"),
        "loop-intervals",
        "--tensorboard-log-interval 0",
    ),
    Bad("save-interval-0", (*GPT, "--save", "{tmp}/ckpt", "--save-interval", "0"), "loop-intervals", "--save-interval"),
    Bad("save-without-interval", (*GPT, "--save", "{tmp}/ckpt"), "loop-intervals", "--save-interval None"),
    Bad(
        "train-iters-0",
        (*GPT, "--train-iters", "0"),
        "optimizer-setup",
        "either train-iters or train-samples",
        flag="--train-iters",
    ),
    Bad("train-iters-negative", (*GPT, "--train-iters", "-1"), "optimizer-setup", "decay -8", flag="--train-iters"),
    Bad(
        "no-train-iters",
        (*MODEL, "--lr", "1e-4", "--mock-data", "--vocab-size", "128"),
        "optimizer-setup",
        "either train-iters or train-samples should be provided",
        flag="--train-iters",
    ),
    Bad("no-lr", (*MODEL, "--train-iters", "5", "--mock-data", "--vocab-size", "128"), "optimizer-setup", "--lr None"),
    Bad(
        "warmup-as-long-as-training",
        (*GPT, "--lr-warmup-iters", "30"),
        "optimizer-setup",
        "warmup 240, decay 240",
        flag="--lr-warmup-iters",
    ),
    Bad(
        "warmup-fraction-1",
        (*GPT, "--lr-warmup-iters", "0", "--lr-warmup-fraction", "1.0"),
        "optimizer-setup",
        "assert self.lr_warmup_steps < self.lr_decay_steps",
        flag="--lr-warmup-fraction",
    ),
    Bad(
        "wsd-without-decay-iters",
        (*GPT, "--lr-decay-style", "WSD"),
        "optimizer-setup",
        "wsd_decay_steps",
        flag="--lr-wsd-decay-iters",
    ),
    # Megatron's datasets index every sample the flags ask for before the first step: beyond any run, nothing holds it.
    Bad(
        "train-iters-beyond-any-run",
        (*GPT, "--train-iters", str(10**30)),
        "sample-counts",
        "--train-iters x --global-batch-size (or --train-samples) = 8" + "0" * 30,
        flag="--train-iters",
    ),
    Bad(
        "eval-iters-beyond-any-run",
        (*GPT, "--eval-interval", "10", "--eval-iters", str(10**18)),
        "sample-counts",
        "--eval-iters x --global-batch-size (the test split)",
        flag="--eval-iters",
    ),
    Bad("num-workers-negative", (*GPT, "--num-workers", "-1"), "loop-intervals", "--num-workers -1"),
    Bad("seed-0", (*GPT, "--seed", "0"), "random-seed", "Seed (0) should be a positive integer.", flag="--seed"),
    Bad(
        "seed-past-numpys-range-on-the-last-stage",
        (*GPT, "--seed", "4294967290", "--pipeline-model-parallel-size", "2"),
        "random-seed",
        "--seed 4294967290",
        nproc=2,
    ),
    # -- the tokenizer --
    Bad("null-tokenizer-without-vocab-size", (*BARE, "--mock-data"), "tokenizer-files", "--vocab-size"),
    Bad(
        "vocab-divisible-by-0",
        (*GPT, "--make-vocab-size-divisible-by", "0"),
        "model-sizes",
        "--make-vocab-size-divisible-by 0",
    ),
    Bad(
        "vocab-divisible-by-negative",
        (*GPT, "--make-vocab-size-divisible-by", "-128"),
        "model-sizes",
        "--make-vocab-size-divisible-by -128",
    ),
    Bad(
        "gpt2-bpe-without-files",
        (*GPT, "--tokenizer-type", "GPT2BPETokenizer"),
        "tokenizer-files",
        "--vocab-file and --merge-file",
    ),
    Bad(
        "sentencepiece-model-is-a-folder",
        (*GPT, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{tmp}/folder"),
        "tokenizer-build",
        "Is a directory",
        flag="--tokenizer-model",
    ),
    Bad(
        "gpt-sentencepiece-model-is-text",
        (*GPT, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "{tmp}/vocab.json"),
        "tokenizer-build",
        "could not parse ModelProto",
        flag="--tokenizer-model",
    ),
    Bad(
        "llama2-model-is-a-pipe",
        (*GPT, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "{tmp}/pipe"),
        "tokenizer-build",
        "--tokenizer-model {tmp}/pipe is not a file or a folder",
    ),
    Bad(
        "sentencepiece-model-missing",
        (*GPT, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{tmp}/no.model"),
        "data-files",
        "{tmp}/no.model",
    ),
    Bad(
        "huggingface-absolute-path-missing",
        (*GPT, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{tmp}/no_such_tokenizer"),
        "data-files",
        "{tmp}/no_such_tokenizer",
    ),
    Bad(
        "huggingface-relative-path-missing",
        (*GPT, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "./no_such_tokenizer_here"),
        "data-files",
        "./no_such_tokenizer_here",
    ),
    # -- the model's shapes over the parallel ranks --
    Bad("hidden-not-split-by-heads", (*GPT, "--hidden-size", "250"), "heads-divide-hidden", "--hidden-size 250"),
    Bad(
        "heads-not-split-by-query-groups",
        (*GPT, "--group-query-attention", "--num-query-groups", "3"),
        "query-groups-divide-heads",
        "--num-query-groups 3",
    ),
    Bad(
        "heads-not-split-by-tp",
        (*GPT, "--num-attention-heads", "6", "--kv-channels", "64", "--tensor-model-parallel-size", "4"),
        "tensor-parallel-split",
        "--num-attention-heads 6",
        nproc=4,
        environ=TENSOR_PARALLEL,
    ),
    Bad(
        "query-groups-neither-multiple-nor-divisor-of-tp",
        (
            *GPT,
            "--hidden-size",
            "384",
            "--num-attention-heads",
            "12",
            "--group-query-attention",
            "--num-query-groups",
            "3",
            "--tensor-model-parallel-size",
            "2",
        ),
        "tensor-parallel-split",
        "--num-query-groups 3",
        nproc=2,
        environ=TENSOR_PARALLEL,
    ),
    Bad(
        "ffn-not-split-by-tp",
        (*GPT, "--ffn-hidden-size", "1022", "--tensor-model-parallel-size", "4"),
        "tensor-parallel-split",
        "--ffn-hidden-size 1022",
        nproc=4,
        environ=TENSOR_PARALLEL,
    ),
    Bad(
        "moe-ffn-not-split-by-expert-tp",
        (*MOE, "--moe-ffn-hidden-size", "511", "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        "tensor-parallel-split",
        "--moe-ffn-hidden-size 511",
        nproc=2,
        environ=TENSOR_PARALLEL,
    ),
    Bad(
        "sequence-parallel-odd-seq-length",
        (*GPT, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "255"),
        "sequence-parallel-seq-length",
        "--seq-length 255",
        nproc=2,
        environ=TENSOR_PARALLEL,
    ),
    Bad(
        "sequence-parallel-with-context-parallel",
        (
            *GPT,
            "--tensor-model-parallel-size",
            "4",
            "--context-parallel-size",
            "2",
            "--sequence-parallel",
            "--seq-length",
            "260",
            "--max-position-embeddings",
            "260",
        ),
        "sequence-parallel-seq-length",
        "--context-parallel-size 2",
        nproc=8,
        environ=TENSOR_PARALLEL,
    ),
    Bad(
        "expert-parallel-over-one-rank",
        (*MOE, "--expert-model-parallel-size", "2"),
        "expert-parallel-sizes",
        "--expert-model-parallel-size",
    ),
    Bad(
        "expert-parallel-over-two-ranks",
        (*MOE, "--expert-model-parallel-size", "4"),
        "expert-parallel-sizes",
        "world size 2",
        nproc=2,
        flag="--expert-model-parallel-size",
    ),
    Bad(
        "expert-parallel-0",
        (*MOE, "--expert-model-parallel-size", "0"),
        "model-sizes",
        "--expert-model-parallel-size 0",
    ),
    Bad(
        "tensor-parallel-negative",
        (*GPT, "--tensor-model-parallel-size", "-1"),
        "model-sizes",
        "--tensor-model-parallel-size -1",
    ),
    # -- the batch over the run's ranks --
    Bad(
        "global-batch-not-split-by-micro-batch",
        (*GPT, "--global-batch-size", "7"),
        "global-batch-size",
        "--global-batch-size 7",
    ),
    Bad(
        "global-batch-not-split-over-the-ranks",
        GPT,
        "global-batch-size",
        "data-parallel size 3",
        nproc=3,
        flag="--global-batch-size",
    ),
    # -- the datasets --
    Bad("no-data-source", (*BARE, "--vocab-size", "128"), "data-source", "--mock-data"),
    Bad("split-not-numbers", (*GPT, "--data-path", "{tmp}/a", "--split", "abc"), "data-blend-split", "--split abc"),
    Bad("split-all-zero", (*GPT, "--data-path", "{tmp}/a", "--split", "0,0,0"), "data-blend-split", "--split 0,0,0"),
    Bad(
        "split-four-weights",
        (*GPT, "--data-path", "{tmp}/a", "--split", "1,2,3,4"),
        "data-blend-split",
        "assert len(split) == len(Split)",
        flag="--split",
    ),
    Bad(
        "split-does-not-parse",
        (*GPT, "--data-path", "{tmp}/a", "--split", "1..2"),
        "data-blend-split",
        "'1..2'",
        flag="--split",
    ),
    Bad(
        "split-without-training",
        (*GPT, "--data-path", "{tmp}/a", "--split", "0,1,0"),
        "data-blend-split",
        "gives training no share",
        flag="--split",
    ),
    Bad(
        "negative-weight",
        (*GPT, "--data-path", "-1", "{tmp}/a", "2", "{tmp}/b"),
        "data-blend-split",
        "dataset weights -1",
        flag="--data-path",
    ),
    Bad(
        "zero-weights",
        (*GPT, "--data-path", "0", "{tmp}/a", "0", "{tmp}/b"),
        "data-blend-split",
        "dataset weights 0 (2 of 2 datasets)",
        flag="--data-path",
    ),
    Bad(
        "blend-file-with-zero-weights",
        (*GPT, "--data-args-path", "{tmp}/blend.txt"),
        "data-blend-split",
        "dataset weights 0 (2 of 2 datasets)",
        flag="--data-args-path",
    ),
    # A blend of thousands of datasets is named in one short line.
    Bad(
        "a-thousand-zero-weights",
        (*GPT, "--data-path", *("0", "{tmp}/a") * 1000),
        "data-blend-split",
        "dataset weights 0 (1000 of 1000 datasets)",
        flag="--data-path",
    ),
    # Weights and prefixes mixed: Megatron's own blend parser asserts (this was a traceback of check's).
    Bad(
        "weights-and-prefixes-mixed",
        (*GPT, "--data-path", "0.3", "{tmp}/a", "{tmp}/b", "{tmp}/a", "0.2", "{tmp}/b"),
        "data-blend-split",
        "--data-path",
    ),
    Bad(
        "data-path-without-a-dataset",
        (*GPT, "--data-path", "--split", "1,0,0"),
        "data-blend-split",
        "--data-path is given without a dataset",
    ),
    Bad(
        "per-split-data-without-training-data",
        (*GPT, "--valid-data-path", "{tmp}/a"),
        "data-blend-split",
        "names no training data (--train-data-path)",
        flag="--train-data-path",
    ),
    Bad(
        "split-beside-per-split-data",
        (*GPT, "--train-data-path", "{tmp}/a", "--split", "99,1,0"),
        "data-blend-split",
        "split and blend_per_split are incompatible",
        flag="--split",
    ),
)


@pytest.fixture
def files(tmp_path):
    """What the bad inputs name: a folder, a text file, a pipe, two dataset prefixes (only their names are read by
    these rules) and a blend file."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe")
    for prefix in ("a", "b"):
        (tmp_path / f"{prefix}.bin").write_bytes(b"")
        (tmp_path / f"{prefix}.idx").write_bytes(b"")
    (tmp_path / "blend.txt").write_text(f"0 {tmp_path}/a 0 {tmp_path}/b\n")  # --data-args-path: WEIGHT PREFIX pairs
    return tmp_path


@pytest.fixture(autouse=True)
def clean_process(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.delenv(key, raising=False)
    installation.uninstall()
    global_vars.unset_global_variables()
    yield
    global_vars.unset_global_variables()
    microbatches.unset_num_microbatches_calculator()


def _filled(flags, tmp_path) -> list[str]:
    return [flag.replace("{tmp}", str(tmp_path)) for flag in flags]


@pytest.mark.parametrize("bad", [pytest.param(bad, id=bad.id) for bad in BAD])
def test_check_refuses_what_megatron_refuses_before_the_first_step(bad, files, monkeypatch, capsys):
    if bad.id == "llama2-model-is-a-pipe" and not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes on this platform")
    for key, value in bad.environ:
        monkeypatch.setenv(key, value)
    code = cli.main(["check", "--nproc", str(bad.nproc), *_filled(bad.flags, files)])
    out, err = capsys.readouterr()
    assert code == console.EXIT_BAD_INPUT, (out, err)
    assert f"[{bad.rule}]" in err, err
    assert bad.named.replace("{tmp}", str(files)) in err, err
    assert bad.to_change.replace("{tmp}", str(files)) in err, err
    assert "Traceback" not in err + out
    assert len(err) < 2000  # one line per broken rule, however many values the flags hold


def test_the_table_covers_the_class():
    """Each new rule of the class has a bad input (and the table is not a handful)."""
    covered = {bad.rule for bad in BAD}
    assert {
        "loop-intervals",
        "optimizer-setup",
        "tokenizer-files",
        "tokenizer-build",
        "heads-divide-hidden",
        "query-groups-divide-heads",
        "tensor-parallel-split",
        "sequence-parallel-seq-length",
        "expert-parallel-sizes",
        "global-batch-size",
        "random-seed",
        "sample-counts",
        "data-source",
        "data-blend-split",
    } <= covered
    assert len(BAD) >= 40 and len({bad.id for bad in BAD}) == len(BAD)
    # Each row says what to change: a flag, or the path of a missing file (rule data-files names the path).
    assert all(bad.to_change.startswith(("--", "{tmp}/", "./")) for bad in BAD), [
        bad.id for bad in BAD if not bad.to_change.startswith(("--", "{tmp}/", "./"))
    ]


# -- Megatron's own code refuses the same flags --------------------------------------------------------------


def megatron_validated(flags: list[str], nproc: int = 1):
    """The flags as Megatron's own ``validate_args`` leaves them, without the plugin (no rule runs)."""
    from megatron.training.arguments import validate_args

    with (
        dry_run.scoped_environ(WORLD_SIZE=str(nproc), RANK="0", LOCAL_RANK="0"),
        host_stand_ins.gpu_host_stand_ins(),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        args = pretrain_gpt.parse_megatron_args(flags, validate=False)
        validate_args(args, pretrain_gpt.ARGS_DEFAULTS)
    return args


class _NoParameters:
    """An optimizer without parameters: what Megatron's schedule sets the learning rate of."""

    def __init__(self) -> None:
        self.param_groups = [{}]


def _megatron_tokenizer(args):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    return build_tokenizer(copy.copy(args))


def _megatron_schedule(args):
    from megatron.training.training import get_optimizer_param_scheduler

    global_vars.set_args(copy.copy(args))
    try:
        return get_optimizer_param_scheduler(_NoParameters())
    finally:
        global_vars.unset_global_variables()


def _megatron_sample_counts(args):
    from megatron.training.training import get_train_valid_test_num_samples

    global_vars.set_args(args)
    try:
        return get_train_valid_test_num_samples()
    finally:
        global_vars.unset_global_variables()


def _megatron_seed(args):
    from megatron.training.initialize import _set_random_seed

    return _set_random_seed(args.seed)


def _megatron_data_loader(args):
    import torch

    return torch.utils.data.DataLoader([0], num_workers=args.num_workers)  # as build_pretraining_data_loader


def _megatron_dataset_config(args):
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return BlendedMegatronDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
    )


# Bad inputs whose failing step Megatron runs on CPU, and that step.
MEGATRON_STEP = {
    "sentencepiece-model-is-a-folder": _megatron_tokenizer,
    "gpt-sentencepiece-model-is-text": _megatron_tokenizer,
    "train-iters-0": _megatron_schedule,
    "train-iters-negative": _megatron_schedule,
    "no-lr": _megatron_schedule,
    "warmup-as-long-as-training": _megatron_schedule,
    "warmup-fraction-1": _megatron_schedule,
    "wsd-without-decay-iters": _megatron_schedule,
    "eval-interval-0": _megatron_sample_counts,
    "seed-0": _megatron_seed,
    "num-workers-negative": _megatron_data_loader,
    "split-four-weights": _megatron_dataset_config,
    "split-does-not-parse": _megatron_dataset_config,
    "weights-and-prefixes-mixed": _megatron_dataset_config,
    "split-beside-per-split-data": _megatron_dataset_config,
}


@pytest.mark.parametrize("bad", [pytest.param(bad, id=bad.id) for bad in BAD if bad.id in MEGATRON_STEP])
def test_megatron_itself_fails_on_the_refused_flags(bad, files):
    """The rules mirror Megatron: its own step (on flags its validate_args passed) raises on each of these."""
    args = megatron_validated(_filled(bad.flags, files), bad.nproc)
    with pytest.raises(Exception):  # noqa: B017 - whatever Megatron raises stops the run
        MEGATRON_STEP[bad.id](args)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(bad, id=bad.id)
        for bad in BAD
        if bad.rule in ("global-batch-size", "heads-divide-hidden") or bad.id.startswith("save-")
    ],
)
def test_megatron_rejects_in_its_own_validation_what_the_plugin_names_first(bad, files):
    """Rows the plugin refuses before validate_args runs, so that the refusal names the flag, are ones
    validate_args asserts (without the flag's name, or worded for its evaluation batch)."""
    with pytest.raises(AssertionError):
        megatron_validated(_filled(bad.flags, files), bad.nproc)


# -- what check accepts, Megatron builds -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Accepted:
    id: str
    flags: tuple[str, ...]  # "{sp}": a SentencePiece model trained here; "{data}": a real indexed dataset
    nproc: int = 1
    environ: tuple[tuple[str, str], ...] = ()
    downloads_tokenizer: bool = False  # Megatron's builder fetches the tokenizer's hub config: not built here


TE = ("--cuda-graph-impl", "transformer_engine")
ACCEPTED = (
    Accepted("tiny-gpt", GPT + TE),
    Accepted("tiny-moe", MOE + TE),
    Accepted("tiny-gpt-hybrid-cp", ("--cg-preset", "tiny-gpt-hybrid-cp", *TE, "--cg-graph-banks"), nproc=2),
    Accepted("gqa", (*GPT, "--group-query-attention", "--num-query-groups", "2")),
    Accepted(
        "tp2-sequence-parallel",
        (*GPT, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        nproc=2,
        environ=TENSOR_PARALLEL,
    ),
    Accepted(
        "gqa-fewer-groups-than-tp",
        (*GPT, "--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"),
        nproc=2,
        environ=TENSOR_PARALLEL,
    ),
    Accepted("moe-expert-parallel", (*MOE, "--expert-model-parallel-size", "2"), nproc=2),
    Accepted(
        "moe-tp2", (*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel"), nproc=2, environ=TENSOR_PARALLEL
    ),
    Accepted("data-parallel-4", (*GPT, "--global-batch-size", "16"), nproc=4),
    Accepted("sentencepiece", (*GPT, "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "{sp}")),
    Accepted(
        "gpt2-bpe",
        (
            *GPT,
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "{tmp}/vocab.json",
            "--merge-file",
            "{tmp}/merges.txt",
        ),
        downloads_tokenizer=True,
    ),
    Accepted("null-tokenizer-padded", (*GPT, "--vocab-size", "1000", "--make-vocab-size-divisible-by", "64")),
    Accepted("blended-data", (*GPT, "--data-path", "1", "{data}", "3", "{data}", "--split", "90,10,0")),
    Accepted("per-split-data", (*GPT, "--train-data-path", "{data}", "--valid-data-path", "{data}")),
    Accepted("warmup-fraction", (*GPT, "--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.1")),
    Accepted("wsd-schedule", (*GPT, "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5")),
    Accepted(
        "sample-based",
        (
            *MODEL,
            "--mock-data",
            "--vocab-size",
            "128",
            "--lr",
            "1e-4",
            "--train-samples",
            "240",
            "--lr-warmup-samples",
            "16",
        ),
    ),
    Accepted(
        "evaluation-and-saves",
        (
            *GPT,
            "--eval-interval",
            "10",
            "--eval-iters",
            "2",
            "--save",
            "{tmp}/ckpt",
            "--save-interval",
            "10",
            "--tensorboard-dir",
            "{tmp}/tb",
        ),
    ),
)


@pytest.fixture(scope="module")
def accepted_files(tmp_path_factory):
    """A SentencePiece model trained here (if sentencepiece is installed), GPT-2 BPE vocabulary and merges, and a
    small real indexed dataset."""
    root = tmp_path_factory.mktemp("accepted")
    sentencepiece = None
    with contextlib.suppress(ImportError):
        import sentencepiece
    if sentencepiece is not None:
        words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")
        lines = [" ".join(words[(i * j) % len(words)] for j in range(12)) for i in range(200)]
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_prefix=str(root / "spm"), vocab_size=24, minloglevel=2
        )
    (root / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    (root / "merges.txt").write_text("#version: 0.2\na b\n")
    write_indexed_dataset(root / "tokens", synthetic_documents(40, vocab_size=1024, seed=3, max_length=300), eod=1023)
    return root, sentencepiece is not None


@pytest.mark.parametrize("row", [pytest.param(row, id=row.id) for row in ACCEPTED])
def test_what_check_accepts_megatron_builds_on_cpu(row, accepted_files, monkeypatch, capsys):
    """check passes the flags; then, from the same validated flags, Megatron's own code builds on CPU what the run
    builds before its first step: the global state of set_global_variables (the micro-batch calculator, the
    tokenizer), the launcher's model config and config container, the optimizer schedule and the dataset config."""
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args

    from megatron_cg_plugin.data.sources import dataset_config

    root, have_sentencepiece = accepted_files
    if "{sp}" in row.flags and not have_sentencepiece:
        pytest.skip("sentencepiece is not installed (the test extra has it)")
    for key, value in row.environ:
        monkeypatch.setenv(key, value)
    flags = [
        flag.replace("{sp}", str(root / "spm.model"))
        .replace("{data}", str(root / "tokens"))
        .replace("{tmp}", str(root))
        for flag in row.flags
    ]
    assert cli.main(["check", "--nproc", str(row.nproc), *flags]) == console.EXIT_OK, capsys.readouterr().err
    capsys.readouterr()
    args, settings, _config = dry_run.validated_args(flags, nproc=row.nproc, env=dict(os.environ))
    from megatron.training.training import get_optimizer_param_scheduler

    with contextlib.redirect_stdout(io.StringIO()):  # what parse_and_validate_args does after validate_args
        global_vars.set_global_variables(args, build_tokenizer=not row.downloads_tokenizer)
    with host_stand_ins.gpu_host_stand_ins():  # TransformerConfig asks for TE's kernels, which the GPU host has
        model_config = gpt_config_from_args(args)  # the launcher's, with the TransformerConfig's own checks
    pretrain_cfg_container_from_args(args, model_config)
    if not row.downloads_tokenizer:
        dataset_config(settings, args)  # the launcher's GPTDatasetConfig, with the tokenizer just built
        assert args.padded_vocab_size % (args.make_vocab_size_divisible_by * args.tensor_model_parallel_size) == 0
    scheduler = get_optimizer_param_scheduler(_NoParameters())  # sets --train-iters of a sample-based run
    scheduler.step(args.train_iters * args.global_batch_size)


def test_megatrons_schedule_agrees_with_the_probe_on_the_accepted_rows(accepted_files, monkeypatch):
    """The optimizer probe derives the schedule's steps as Megatron's get_optimizer_param_scheduler does."""
    from megatron_cg_plugin.megatron_builds import _schedule_steps

    root, _ = accepted_files
    for row in ACCEPTED:
        if any("{" in flag for flag in row.flags):
            continue
        for key, value in row.environ:
            monkeypatch.setenv(key, value)
        args, settings, _config = dry_run.validated_args(list(row.flags), nproc=row.nproc, env=dict(os.environ))
        megatron = _megatron_schedule(args)
        assert _schedule_steps(settings) == (
            megatron.lr_warmup_steps,
            megatron.lr_decay_steps,
            megatron.wd_incr_steps,
            megatron.wsd_decay_steps,
        ), row.id


@pytest.mark.parametrize(
    "flags, note",
    [
        (
            (
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                "{tmp}/vocab.json",
                "--merge-file",
                "{tmp}/vocab.json",
            ),
            "note: GPT2BPETokenizer loads the configuration of the hub model 'gpt2'",
        ),
        (
            ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "meta-llama/Llama-2-7b-hf"),
            "so check does not build it.",
        ),
    ],
)
def test_check_says_which_tokenizer_it_could_not_build(files, capsys, flags, note):
    """A tokenizer the hub must send (or whose library is not here) passes, with a note: the run may still fail."""
    assert cli.main(["check", *GPT, *_filled(flags, files)]) == console.EXIT_OK
    assert note in capsys.readouterr().out
    assert cli.main(["check", *GPT]) == console.EXIT_OK
    assert "note:" not in capsys.readouterr().out  # the preset's NullTokenizer was built


def test_a_preset_with_per_split_data_drops_its_split():
    """The presets' --split would sit beside per-split data, which Megatron's dataset config refuses."""
    expanded = pretrain_gpt.expand_preset([*GPT, "--train-data-path", "x"])
    assert "--split" not in expanded and "--mock-data" not in expanded
    assert "--split" in pretrain_gpt.expand_preset(list(GPT))


def test_every_preset_is_an_accepted_row():
    assert {row.flags[1] for row in ACCEPTED if row.flags[0] == "--cg-preset" and row.id == row.flags[1]} == set(
        PRESET_FLAGS
    )
