"""Every rule a run must satisfy, Megatron's and the plugin's, as data plus one ``validate()``.

Megatron enforces many of these with ``assert`` deep inside ``TransformerConfig.__post_init__`` or
at model build time, and some only fail later still (a missing dataset file, an APEX kernel, a
hybrid-CP loader option); here each one is checked up front, on the parsed flags, with a message
that names the flag to change. The one list serves ``megatron-cg check``, the launcher and
``install()`` in any Megatron script (through ``validate_args``), so a dry run refuses exactly what
a run would refuse.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

from megatron_cg_plugin.config import (
    PluginConfig,
    has_plugin_flags,
    is_power_of_two,
    missing_plugin_flags,
    slot_debug_from_environment,
)
from megatron_cg_plugin.inputs import output_folder_problem
from megatron_cg_plugin.planner.capture_plan import plan_capture
from megatron_cg_plugin.scopes import MOE_SCOPES, PARTIAL_MOE_SCOPES
from megatron_cg_plugin.settings import (
    DETERMINISTIC_THD_LIMIT,
    RunSettings,
    environment_settings,
    read_run_settings,
    read_settings,
)

__all__ = [
    "HOST_RULES",
    "RULES",
    "RuleViolation",
    "check_run",
    "environment_violations",
    "markdown_rows",
    "early_violations",
    "refusal_lines",
    "unvalidated_plugin_violations",
    "validate",
    "violations",
]

_SLOT_FP8_RECIPES = ("delayed", "tensorwise")  # --fp8-recipe values slot-shared capture takes
DOCS = "see docs/troubleshooting.md"  # where every rule is explained, named at the end of each refusal


def refusal_lines(violations: Sequence[tuple[str, str]]) -> list[str]:
    """A refusal as printed: its cause first (the first broken rule, ``[name] message``, ``megatron`` for
    Megatron's own checks), the other broken rules indented a line each, then one line pointing to the rules'
    docs. Each entry point puts its name before the first line."""
    first, *others = [f"[{name}] {message}" for name, message in violations]
    count = len(violations)
    return [first, *(f"  {line}" for line in others), f"  ({count} rule{'s' if count > 1 else ''} broken: {DOCS})"]


class RuleViolation(ValueError):
    """Flags a run cannot train with; the message is ``refusal_lines``: the first broken rule and its fix
    first, the others a line each."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        self.violations = violations
        super().__init__("\n".join(refusal_lines(violations)))


@dataclasses.dataclass(frozen=True)
class _Rule:
    """``violated(facts)`` is True when the flags break the rule; ``fix`` says what to change."""

    name: str
    source: str  # "megatron" (mirrors a Megatron check) or "plugin"
    violated: Callable[[RunSettings], bool]
    fix: str
    # What the facts add to the fix (the files that are missing, the bad values), if anything.
    detail: Callable[[RunSettings], str] | None = None

    def message(self, facts: RunSettings) -> str:
        return self.fix if self.detail is None else f"{self.fix} {self.detail(facts)}"


def _graphs(check: Callable[[RunSettings], bool]) -> Callable[[RunSettings], bool]:
    return lambda f: f.te_graphs and check(f)


def _fitting_seqlen(f: RunSettings) -> str:
    """What --cg-thd-max-seqlen can be at the run's --cg-thd-max-seqs: under TE's deterministic limit, and
    long enough that a sample's documents fit the capacity (rule packed-graphs-capacity)."""
    largest = f.deterministic_thd_max_seqlen
    if f.thd_max_seqs is None:  # deterministic_thd_max_seqlen raised already: asked of packed layouts only
        raise TypeError("the fitting --cg-thd-max-seqlen needs --cg-thd-max-seqs")
    per_sample = f.thd_max_seqs // max(1, f.micro_batch_size)  # documents a sample may hold
    smallest = -(-f.seq_length // per_sample) if f.seq_length and per_sample else None
    if smallest is None or largest >= smallest:
        return f"the largest --cg-thd-max-seqlen that fits: {largest}" + (
            f", and the capacity needs at least {smallest}" if smallest is not None else ""
        )
    # TE's bound falls as 1/sqrt(N), the capacity's as 1/N: more, shorter documents meet both.
    return (
        f"no --cg-thd-max-seqlen fits at this --cg-thd-max-seqs: at most {largest} for TE, at least {smallest} "
        "for the capacity; raise --cg-thd-max-seqs"
    )


# Sizes Megatron takes as whole numbers of 1 or more, each with a bound no model reaches: a typo is refused before
# Megatron builds anything from it (a head count of 0 divides by zero in its validation, a layer count of 1e20
# exhausts the memory, a hidden size of 0 builds empty weights).
_MOST_LAYERS = 10_000
_SIZE_LIMITS = (
    ("num_layers", "--num-layers", _MOST_LAYERS),
    ("hidden_size", "--hidden-size", 1 << 20),
    ("ffn_hidden_size", "--ffn-hidden-size", 1 << 22),
    ("num_attention_heads", "--num-attention-heads", 1 << 16),
    ("num_query_groups", "--num-query-groups", 1 << 16),
    ("kv_channels", "--kv-channels", 1 << 16),
    ("seq_length", "--seq-length", 1 << 24),
    ("max_position_embeddings", "--max-position-embeddings", 1 << 24),
    ("micro_batch_size", "--micro-batch-size", 1 << 16),
    ("global_batch_size", "--global-batch-size", 1 << 30),
    ("num_experts", "--num-experts", 1 << 16),
    ("moe_topk", "--moe-router-topk", 1 << 16),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size", 1 << 22),
    ("vocab_size", "--vocab-size", 1 << 28),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", 1 << 16),
    ("tensor_parallel", "--tensor-model-parallel-size", 1 << 20),
    ("pipeline_parallel", "--pipeline-model-parallel-size", 1 << 20),
    ("context_parallel", "--context-parallel-size", 1 << 20),
    ("expert_parallel", "--expert-model-parallel-size", 1 << 20),
    ("expert_tensor_parallel", "--expert-tensor-parallel-size", 1 << 20),
)


def _bad_sizes(f: RunSettings) -> list[str]:
    return [
        f"{flag} {value} (1 to {most})"
        for field, flag, most in _SIZE_LIMITS
        if (value := getattr(f, field)) is not None
        and not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most)
    ]


# What Megatron's tokenizers are built from (megatron-core 0.19.2 tokenizers/utils/build_tokenizer.py): the flag
# each type reads its files from; without it the run fails while building the tokenizer, after the model flags
# passed.
_TOKENIZER_NEEDS = {
    **dict.fromkeys(
        (
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "TikTokenizer",
            "HuggingFaceTokenizer",
            "SFTTokenizer",
        ),
        ("--tokenizer-model",),
    ),
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    **dict.fromkeys(("BertWordPieceLowerCase", "BertWordPieceCase"), ("--vocab-file",)),
    "NullTokenizer": ("--vocab-size",),  # its vocabulary is the size it is given
}


def _missing_tokenizer_flags(f: RunSettings) -> list[str]:
    given = {
        "--tokenizer-model": f.tokenizer_model,
        "--vocab-file": f.vocab_file,
        "--merge-file": f.merge_file,
        "--vocab-size": f.vocab_size,
    }
    return [flag for flag in _TOKENIZER_NEEDS.get(f.tokenizer_type or "", ()) if not given[flag]]


def _unusable_folders(f: RunSettings) -> list[str]:
    """The folders the flags name that the run cannot use (``inputs.output_folder_problem``): Megatron writes
    checkpoints, TensorBoard events and dataset caches there only once training runs, and an empty one it
    reads as no folder at all; an empty --load it reads as the current folder."""
    problems = [
        problem
        for flag, path in (
            ("--save", f.save),
            ("--tensorboard-dir", f.tensorboard_dir),
            ("--data-cache-path", f.data_cache_path),
        )
        if (problem := output_folder_problem(flag, path)) is not None
    ]
    if f.load is not None and not str(f.load).strip():
        problems.append(
            "--load is empty, which Megatron reads as the current folder (it loads a checkpoint found there); "
            "give the checkpoint folder, or drop --load."
        )
    return problems


def _graphed_layers_per_rank(f: RunSettings) -> int:
    """The layers a first-stage rank graphs (what --cg-inject-capture-failure counts). Graph banks change how
    often a layer is captured, not which layers are: left out, so their own rules report their sizes."""
    plan = plan_capture(dataclasses.replace(f, graph_banks=False))
    first = set(plan.first_stage_layers)
    return sum(1 for layer in plan.graphed_layers if layer in first)


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _model_parallel(f: RunSettings) -> int | None:
    """TP x PP x CP, the ranks one model replica spans; None where a size is not a whole number (rule
    model-sizes)."""
    sizes = (f.tensor_parallel, f.pipeline_parallel, f.context_parallel)
    return math.prod(sizes) if all(_whole(size) for size in sizes) else None


def _data_parallel(f: RunSettings) -> int | None:
    """The run's data-parallel size: its ranks over TP x PP x CP; None where those do not divide the world size
    (rule parallel-sizes) or a size is not a whole number (rule model-sizes)."""
    replica = _model_parallel(f)
    return None if replica is None or f.world_size % replica else f.world_size // replica


def _global_batch_problem(f: RunSettings) -> str | None:
    """Megatron splits each global batch into micro-batches of --micro-batch-size on each of the run's
    data-parallel ranks (num_microbatches_calculator; validate_args asserts it first, worded for its evaluation
    batch): the global batch must be a multiple of micro-batch x data-parallel size."""
    data_parallel = _data_parallel(f)
    if f.batch_size_varies or data_parallel is None or not (_whole(f.micro_batch_size) and _whole(f.global_batch_size)):
        return None  # Megatron sets it (not given), ramps it, or other rules name the sizes
    if f.global_batch_size % (f.micro_batch_size * data_parallel) == 0:
        return None
    return (
        f"(--global-batch-size {f.global_batch_size}, --micro-batch-size {f.micro_batch_size}, data-parallel size "
        f"{data_parallel} = {f.world_size} ranks / (TP x PP x CP {_model_parallel(f)}): give a multiple of "
        f"{f.micro_batch_size * data_parallel})"
    )


def _interval_problems(f: RunSettings) -> list[str]:
    """The training loop's intervals Megatron divides by (iteration % interval, train-iters // eval-interval) or
    asserts, each with why."""
    problems = []
    if not _whole(f.log_interval):
        problems.append(f"--log-interval {f.log_interval} (the loop logs when iteration % it == 0)")
    # get_train_valid_test_num_samples divides --train-iters by it unless validation runs whole or training is skipped
    divides_by_eval_interval = not (f.skip_train or f.full_validation)
    if (
        divides_by_eval_interval
        and f.eval_interval is not None
        and not _whole(f.eval_interval)
        and (f.eval_interval == 0 or f.eval_iters > 0)  # a negative one only counts validation samples below 0
    ):
        problems.append(
            f"--eval-interval {f.eval_interval} (the number of validation samples is computed as --train-iters "
            f"// it x --eval-iters {f.eval_iters})"
        )
    if f.tensorboard_dir and not _whole(f.tensorboard_log_interval):
        problems.append(f"--tensorboard-log-interval {f.tensorboard_log_interval} (with --tensorboard-dir)")
    if f.save is not None and not _whole(f.save_interval):
        problems.append(f"--save-interval {f.save_interval} (with --save, validate_args asserts it is > 0)")
    if not (_whole(f.num_workers) or f.num_workers == 0):
        problems.append(f"--num-workers {f.num_workers} (torch's DataLoader takes 0 or more worker processes)")
    return problems


# More samples than any run trains on: Megatron's GPT dataset indexes each one (some 32 bytes of index a sample)
# before the first step, over 500 GB here.
_MOST_SAMPLES = 1 << 34


def _sample_counts(f: RunSettings) -> list[str]:
    """The train, validation and test samples Megatron's datasets are built to hold
    (training.get_train_valid_test_num_samples) that are beyond any run."""
    batch = f.global_batch_size
    if not _whole(batch):
        return []  # Megatron sets it from the micro-batch (or rule model-sizes names it)
    counts = []
    iterations = f.train_iters if _whole(f.train_iters) else None
    train = f.train_samples if _whole(f.train_samples) else (iterations * batch if iterations else None)
    counts.append(("--train-iters x --global-batch-size (or --train-samples)", train))
    if _whole(f.eval_iters):
        if iterations and _whole(f.eval_interval) and not (f.skip_train or f.full_validation):
            evaluations = iterations // f.eval_interval + 1
            counts.append(
                (
                    "(--train-iters // --eval-interval + 1) x --eval-iters x --global-batch-size",
                    evaluations * f.eval_iters * batch,
                )
            )
        counts.append(("--eval-iters x --global-batch-size (the test split)", f.eval_iters * batch))
    return [f"{what} = {count}" for what, count in counts if count is not None and count > _MOST_SAMPLES]


_SEEDS = 1 << 32  # numpy's random seeds are 0 to 2^32 - 1


def _seed_problem(f: RunSettings) -> str | None:
    """Megatron seeds each pipeline stage with --seed + 100 x its rank (+ 10 x the data-parallel rank with
    --data-parallel-random-init; initialize._set_random_seed), after refusing a seed that is not positive;
    numpy takes seeds below 2^32."""
    if not _whole(f.seed):
        return f'(Megatron: "Seed ({f.seed}) should be a positive integer.")'
    stages = f.pipeline_parallel if _whole(f.pipeline_parallel) else 1
    replicas = (_data_parallel(f) or 1) if f.data_parallel_random_init else 1
    largest = f.seed + 100 * (stages - 1) + 10 * (replicas - 1)
    if largest < _SEEDS:
        return None
    return f"(--seed {f.seed}: the last rank's seed is {largest}, and numpy takes seeds below 2^32 = {_SEEDS})"


def _tensor_parallel_splits(f: RunSettings) -> list[str]:
    """Sizes Megatron splits evenly over the tensor-parallel ranks as it builds the layers (attention heads and
    groups in Attention, the MLP's columns in its parallel linears; the experts' over --expert-tensor-parallel-size)
    that do not split."""
    tp, groups = f.tensor_parallel, f.num_query_groups  # Megatron reads the groups with --group-query-attention
    expert_tp = f.tensor_parallel if f.expert_tensor_parallel is None else f.expert_tensor_parallel
    if not (_whole(tp) and _whole(expert_tp)):
        return []  # rule model-sizes
    splits = []
    dense_mlp = not (f.has_moe_layers and _whole(f.num_layers) and f.num_layers <= _MOST_LAYERS and f.all_layers_moe)
    for size, flag, ranks, over in (
        (f.num_attention_heads, "--num-attention-heads", tp, "--tensor-model-parallel-size"),
        (f.ffn_hidden_size if dense_mlp else None, "--ffn-hidden-size", tp, "--tensor-model-parallel-size"),
        (
            f.moe_shared_expert_intermediate_size,
            "--moe-shared-expert-intermediate-size",
            tp,
            "--tensor-model-parallel-size",
        ),
        (
            f.moe_ffn_hidden_size if f.has_moe_layers else None,
            "--moe-ffn-hidden-size",
            expert_tp,
            "--expert-tensor-parallel-size (default: TP)",
        ),
    ):
        if _whole(size) and size % ranks:
            splits.append(f"{flag} {size} over {over} {ranks}")
    if f.group_query_attention and _whole(groups) and groups % tp and tp % groups:
        splits.append(
            f"--num-query-groups {groups}, neither a multiple nor a divisor of --tensor-model-parallel-size {tp}"
        )
    return splits


def _sequence_parallel_problem(f: RunSettings) -> str | None:
    """Sequence parallelism scatters each CP rank's --seq-length / --context-parallel-size positions over the
    tensor-parallel ranks (Megatron's scatter_to_sequence_parallel_region asserts "First dimension of the tensor
    should be divisible by tensor parallel size"). Packed and hybrid-CP microbatches lay tokens out otherwise."""
    if not (f.sequence_parallel and _whole(f.tensor_parallel) and f.tensor_parallel > 1 and _whole(f.seq_length)):
        return None
    if f.packed or f.hybrid_context_parallel or not _whole(f.context_parallel) or f.seq_length % f.context_parallel:
        return None
    positions = f.seq_length // f.context_parallel
    if positions % f.tensor_parallel == 0:
        return None
    return (
        f"(--seq-length {f.seq_length} / --context-parallel-size {f.context_parallel} = {positions} positions per "
        f"rank, --tensor-model-parallel-size {f.tensor_parallel})"
    )


def _expert_grid(f: RunSettings) -> int | None:
    """ETP x EP x PP, the ranks initialize_model_parallel lays the expert layers over."""
    expert_tp = f.tensor_parallel if f.expert_tensor_parallel is None else f.expert_tensor_parallel
    sizes = (expert_tp, f.expert_parallel, f.pipeline_parallel)
    return math.prod(sizes) if all(_whole(size) for size in sizes) else None


_QUERY_GROUPS_DIVIDE_HEADS = _Rule(
    "query-groups-divide-heads",
    "megatron",
    lambda f: (
        f.group_query_attention
        and _whole(f.num_query_groups)
        and _whole(f.num_attention_heads)
        and f.num_attention_heads % f.num_query_groups != 0
    ),
    "with --group-query-attention each of the --num-query-groups groups shares its key and value heads among "
    "the same number of query heads (Megatron's attention splits the heads by the groups as it builds): give "
    "--num-attention-heads a multiple of --num-query-groups.",
    detail=lambda f: f"(--num-attention-heads {f.num_attention_heads}, --num-query-groups {f.num_query_groups})",
)

_TENSOR_PARALLEL_SPLIT = _Rule(
    "tensor-parallel-split",
    "megatron",
    lambda f: bool(_tensor_parallel_splits(f)),
    "Megatron splits these sizes evenly over the tensor-parallel ranks as it builds the layers (divide() asserts "
    '"... is not divisible by ..."): change the size or the parallel size named:',
    detail=lambda f: "; ".join(_tensor_parallel_splits(f)),
)

_HEADS_DIVIDE_HIDDEN = _Rule(
    "heads-divide-hidden",
    "megatron",
    lambda f: (
        f.kv_channels is None
        and _whole(f.hidden_size)
        and _whole(f.num_attention_heads)
        and f.hidden_size % f.num_attention_heads != 0
    ),
    "without --kv-channels each attention head is --hidden-size / --num-attention-heads wide, and validate_args "
    "asserts that divides evenly: give --hidden-size a multiple of --num-attention-heads, or --kv-channels.",
    detail=lambda f: f"(--hidden-size {f.hidden_size}, --num-attention-heads {f.num_attention_heads})",
)

_GLOBAL_BATCH = _Rule(
    "global-batch-size",
    "megatron",
    lambda f: _global_batch_problem(f) is not None,
    "each global batch is split into micro-batches of --micro-batch-size on every data-parallel rank, and Megatron "
    "asserts it splits evenly: give --global-batch-size a multiple of --micro-batch-size x the data-parallel size, "
    "or change --micro-batch-size or the number of ranks.",
    detail=lambda f: _global_batch_problem(f) or "",
)

_SAMPLE_COUNTS = _Rule(
    "sample-counts",
    "megatron",
    lambda f: bool(_sample_counts(f)),
    "the flags ask for more samples than any run trains on (over 2^34), and Megatron's datasets index every one "
    "before the first step, which would not fit in memory: lower --train-iters (or --train-samples) or --eval-iters:",
    detail=lambda f: "; ".join(_sample_counts(f)),
)

_LOOP_INTERVALS = _Rule(
    "loop-intervals",
    "megatron",
    lambda f: bool(_interval_problems(f)),
    "the training loop divides by these intervals (a 0 ends in ZeroDivisionError after the model is built) or "
    "Megatron asserts them, and its data loader takes no negative worker count: give each a whole number of 1 or "
    "more (--num-workers: 0 or more):",
    detail=lambda f: "; ".join(_interval_problems(f)),
)

_MODEL_SIZES = _Rule(
    "model-sizes",
    "megatron",
    lambda f: bool(_bad_sizes(f)),
    "a size is 0, negative or beyond any model (Megatron would divide by zero, build empty weights or run out of "
    "memory on it): give a whole number in the range shown:",
    detail=lambda f: ", ".join(_bad_sizes(f)),
)

RULES: tuple[_Rule, ...] = (
    _MODEL_SIZES,
    _HEADS_DIVIDE_HIDDEN,
    _GLOBAL_BATCH,
    _LOOP_INTERVALS,
    _SAMPLE_COUNTS,
    _Rule(
        "environment-switches",
        "plugin",
        lambda f: bool(f.unreadable_switches),
        "an environment switch read as 0 or 1 has another value, which TE and the plugin do not take: export it "
        "as 0 or 1:",
        detail=lambda f: ", ".join(f.unreadable_switches),
    ),
    _Rule(
        "environment-values",
        "plugin",
        lambda f: bool(f.unusable_environment),
        "an environment variable torch, NCCL, CUDA or Megatron reads where the run starts has a value they refuse "
        "(the first CUDA allocation stops at a bad PYTORCH_CUDA_ALLOC_CONF) or misread: export what each "
        "says, or unset it:",
        detail=lambda f: "; ".join(f.unusable_environment),
    ),
    _Rule(
        "run-folders",
        "plugin",
        lambda f: bool(_unusable_folders(f)),
        "a folder the flags name cannot be used, and the run would find out only when it first writes there, "
        "after its model and data are built (or, given empty, would write nothing):",
        detail=lambda f: " ".join(_unusable_folders(f)),
    ),
    _Rule(
        "cuda-graph-modules-twice",
        "plugin",
        lambda f: len(set(f.modules)) < len(f.modules),
        "--cuda-graph-modules names a module more than once, and each is one graphed part of the layer: name each "
        "once.",
        detail=lambda f: f"(--cuda-graph-modules {' '.join(f.modules)})",
    ),
    _Rule(
        "tokenizer-files",
        "megatron",
        lambda f: bool(_missing_tokenizer_flags(f)),
        "--tokenizer-type names a tokenizer built from what the flags do not give (its files, or NullTokenizer's "
        "vocabulary size), so the run would fail building it: add",
        detail=lambda f: f"{' and '.join(_missing_tokenizer_flags(f))} (--tokenizer-type {f.tokenizer_type}).",
    ),
    _Rule(
        "tokenizer-build",
        "megatron",
        lambda f: f.tokenizer_problem is not None,
        "Megatron's build_tokenizer, which the run calls right after validating the flags, fails on them here "
        "(Megatron's error follows): give --tokenizer-model the model file (or folder) the --tokenizer-type reads, "
        "or the --tokenizer-type that file is for:",
        detail=lambda f: (
            f"{f.tokenizer_problem} (--tokenizer-type {f.tokenizer_type}"
            f"{f', --tokenizer-model {f.tokenizer_model}' if f.tokenizer_model else ''})"
        ),
    ),
    _QUERY_GROUPS_DIVIDE_HEADS,
    _TENSOR_PARALLEL_SPLIT,
    _Rule(
        "sequence-parallel-seq-length",
        "megatron",
        lambda f: _sequence_parallel_problem(f) is not None,
        "--sequence-parallel splits each context-parallel rank's positions over the tensor-parallel ranks, and "
        'Megatron asserts they split evenly ("First dimension of the tensor should be divisible by tensor parallel '
        'size") in the first forward: give --seq-length a multiple of --context-parallel-size x '
        "--tensor-model-parallel-size, or drop --sequence-parallel.",
        detail=lambda f: _sequence_parallel_problem(f) or "",
    ),
    _Rule(
        "expert-parallel-sizes",
        "megatron",
        lambda f: (
            f.has_moe_layers
            and _data_parallel(f) is not None  # else rule parallel-sizes names the world size
            and (grid := _expert_grid(f)) is not None
            and f.world_size % grid != 0
        ),
        "the expert layers lay out over --expert-tensor-parallel-size x --expert-model-parallel-size x "
        "--pipeline-model-parallel-size ranks, and initialize_model_parallel raises unless the world size is a "
        "multiple of that: change those sizes or the number of ranks.",
        detail=lambda f: f"(world size {f.world_size}, ETP x EP x PP = {_expert_grid(f)})",
    ),
    _Rule(
        "random-seed",
        "megatron",
        lambda f: _seed_problem(f) is not None,
        "Megatron seeds Python, numpy and torch from --seed when it initializes (before the model is built), and "
        "refuses a seed below 1; numpy refuses one of 2^32 or more, which --seed plus 100 per pipeline stage must "
        "stay below: give --seed a whole number from 1 up.",
        detail=lambda f: _seed_problem(f) or "",
    ),
    _Rule(
        "optimizer-setup",
        "megatron",
        lambda f: f.optimizer_problem is not None,
        "Megatron's optimizer setup (setup_model_and_optimizer, before the first step) fails on the flags here "
        "(Megatron's error follows): give --train-iters N (or --train-samples), --lr with --min-lr <= --lr, a "
        "warmup shorter than the decay (--lr-warmup-iters or --lr-warmup-fraction against --lr-decay-iters, "
        "default --train-iters), and --lr-wsd-decay-iters with --lr-decay-style WSD:",
        detail=lambda f: f.optimizer_problem or "",
    ),
    _Rule(
        "data-source",
        "plugin",
        lambda f: f.launcher and not f.data_sources,
        "the launcher trains on --mock-data or Megatron's indexed datasets, and the flags name neither (Megatron's "
        'GPTDataset "failed to build as a mock data generator" without one): add --mock-data, or --data-path '
        "PREFIX (or --train-data-path and friends).",
    ),
    _Rule(
        "data-blend-split",
        "megatron",
        lambda f: f.dataset_problem is not None,
        "Megatron's dataset config cannot be built from the data flags, or builds datasets the run cannot train "
        "on: fix --data-path or the per-split paths (or the --data-args-path file: PREFIX, or WEIGHT PREFIX pairs "
        "with positive weights) or --split (three weights, train,validation,test, not all 0):",
        detail=lambda f: f.dataset_problem or "",
    ),
    _Rule(
        "moe-topk-over-experts",
        "megatron",
        lambda f: f.num_experts is not None and f.moe_topk > f.num_experts,
        "--moe-router-topk exceeds --num-experts: each token is routed to top-k distinct experts, and the router's "
        "torch.topk fails in the first forward: give a top-k of at most the expert count.",
        detail=lambda f: f"(--moe-router-topk {f.moe_topk}, --num-experts {f.num_experts})",
    ),
    _Rule(
        "cg-flags-need-te-graphs",
        "plugin",
        lambda f: not f.te_graphs and bool(f.graph_only_flags),
        "these --cg-* flags shape the plugin's CUDA graphs, and without --cuda-graph-impl transformer_engine nothing "
        "is captured, so they would do nothing: add --cuda-graph-impl transformer_engine, or drop them:",
        detail=lambda f: f"{' '.join(f.graph_only_flags)} (--cuda-graph-impl {f.cuda_graph_impl})",
    ),
    _Rule(
        "te-installed",
        "plugin",
        _graphs(lambda f: not f.te_available),
        "--cuda-graph-impl transformer_engine needs Transformer Engine: pip install "
        "'megatron-cg-plugin[te]', or use --cuda-graph-impl none.",
    ),
    _Rule(
        "te-layers",
        "megatron",
        _graphs(lambda f: f.transformer_impl != "transformer_engine"),
        "TE CUDA graphs capture TE layers: use --transformer-impl transformer_engine.",
    ),
    _Rule(
        "moe-xor-router",
        "megatron",
        _graphs(lambda f: {"moe", "moe_router"} <= set(f.modules)),
        "--cuda-graph-modules lists both moe and moe_router: keep moe (whole MoE block, needs "
        "drop-and-pad) or moe_router [moe_preprocess], not both.",
    ),
    _Rule(
        "preprocess-needs-router",
        "megatron",
        _graphs(lambda f: "moe_preprocess" in f.modules and "moe_router" not in f.modules),
        "--cuda-graph-modules moe_preprocess needs moe_router too: add moe_router.",
    ),
    _Rule(
        "moe-scope-needs-moe",
        "megatron",
        _graphs(lambda f: bool(MOE_SCOPES & set(f.modules)) and not f.moe),
        "--cuda-graph-modules moe/moe_router/moe_preprocess need an MoE model: set --num-experts > 1 "
        "or drop those modules.",
    ),
    _Rule(
        "moe-layer-freq",
        "megatron",
        lambda f: f.has_moe_layers and not f.moe_layer_freq_fits,
        "--moe-layer-freq lists a pattern whose length differs from --num-layers: give one 0/1 entry "
        "per layer, or an integer frequency.",
    ),
    _Rule(
        "mlp-scope-needs-dense",
        "megatron",
        _graphs(lambda f: "mlp" in f.modules and f.moe and f.all_layers_moe),
        "--cuda-graph-modules mlp graphs dense MLPs, but every layer is MoE: use moe or moe_router "
        "instead of mlp, or make some layers dense with --moe-layer-freq.",
    ),
    _Rule(
        "moe-scope-needs-drop-and-pad",
        "megatron",
        _graphs(lambda f: "moe" in f.modules and not f.drop_and_pad),
        "--cuda-graph-modules moe needs static expert shapes: add --moe-expert-capacity-factor "
        "(e.g. 1.5) and --moe-pad-expert-input-to-capacity, or graph moe_router instead.",
    ),
    _Rule(
        "preprocess-no-host-sync",
        "megatron",
        _graphs(
            lambda f: (
                "moe_preprocess" in f.modules
                and not f.drop_and_pad
                and f.dispatcher == "alltoall"
                and (f.capacity_factor is not None or f.router_padding_for_fp8)
            )
        ),
        "moe_preprocess cannot be graphed when the alltoall preprocess copies to the host "
        "(--moe-expert-capacity-factor without --moe-pad-expert-input-to-capacity, or "
        "--moe-router-padding-for-fp8): remove moe_preprocess or pad to capacity.",
    ),
    _Rule(
        "moe-capacity-over-tokens",
        "megatron",
        lambda f: (
            f.has_moe_layers
            and f.drop_and_pad
            and f.dispatcher == "alltoall"
            and f.num_experts is not None
            and f.num_experts != 0
            and f.capacity_factor is not None  # drop_and_pad implies it
            and f.capacity_factor * f.moe_topk > f.num_experts
        ),
        "--moe-expert-capacity-factor x --moe-router-topk exceeds --num-experts, so each expert's capacity is larger "
        "than the rank's tokens, which Megatron's alltoall dispatcher cannot lay out (a view error in permute): use "
        "a capacity factor of at most num-experts / topk.",
    ),
    _Rule(
        "moe-tp-needs-sequence-parallel",
        "megatron",
        lambda f: f.has_moe_layers and f.tensor_parallel > 1 and not f.sequence_parallel,
        "Megatron trains MoE layers under tensor parallelism only with sequence parallelism (moe_layer.py raises "
        "otherwise): add --sequence-parallel.",
    ),
    _Rule(
        "whole-layer-moe-needs-drop-and-pad",
        "plugin",
        _graphs(lambda f: not f.modules and f.has_moe_layers and not f.drop_and_pad),
        "whole-layer capture (empty --cuda-graph-modules) of MoE layers graphs the token "
        "dispatcher, whose shapes change per step: add --moe-expert-capacity-factor and "
        "--moe-pad-expert-input-to-capacity, or list modules such as attn moe_router.",
    ),
    _Rule(
        "full-recompute",
        "megatron",
        _graphs(lambda f: f.recompute_granularity == "full"),
        "--recompute-granularity full is only supported with --cuda-graph-impl full_iteration: use "
        "--recompute-granularity selective or turn graphs off.",
    ),
    _Rule(
        "moe-recompute-vs-router",
        "megatron",
        _graphs(
            lambda f: (
                f.recompute_granularity == "selective" and "moe" in f.recompute_modules and "moe_router" in f.modules
            )
        ),
        "--recompute-modules moe cannot be combined with --cuda-graph-modules moe_router: drop one.",
    ),
    _Rule(
        "cpu-offloading",
        "megatron",
        _graphs(lambda f: f.cpu_offloading),
        "--cpu-offloading is not supported with CUDA graphs: use --fine-grained-activation-offloading "
        "or turn graphs off.",
    ),
    _Rule(
        "hybrid-cp",
        "plugin",
        _graphs(lambda f: f.hybrid_context_parallel and not f.graph_banks),
        "--hybrid-context-parallel with TE CUDA graphs needs one graph bank per CP size (Megatron's "
        "own replay refuses packed sequences): add --cg-graph-banks, or use --cuda-graph-impl none.",
    ),
    _Rule(
        "banks-need-hybrid-cp",
        "plugin",
        _graphs(lambda f: f.graph_banks and not f.hybrid_context_parallel),
        "--cg-graph-banks captures one bank per CP size of --hybrid-context-parallel: add "
        "--hybrid-context-parallel, or drop --cg-graph-banks.",
    ),
    _Rule(
        "banks-rope-type",
        "plugin",
        _graphs(lambda f: f.graph_banks and f.position_embedding_type in ("yarn", "mrope")),
        "graph banks bind one RoPE table per CP size for --position-embedding-type rope; yarn and mrope "
        "tables are not supported: use --position-embedding-type rope or learned_absolute.",
    ),
    _Rule(
        "banks-rope-fusion",
        "plugin",
        _graphs(lambda f: f.graph_banks and f.position_embedding_type == "rope" and not f.apply_rope_fusion),
        "Megatron's unfused THD RoPE reads sequence lengths on the host (.tolist()), which a graph cannot "
        "capture: drop --no-rope-fusion with --cg-graph-banks.",
    ),
    _Rule(
        "hybrid-cp-rope-static-cp",
        "plugin",
        lambda f: f.hybrid_context_parallel and f.position_embedding_type == "rope" and f.context_parallel > 1,
        "under --hybrid-context-parallel each microbatch applies RoPE with its own CP group, and CP-1 "
        "microbatches with the static one, which must then have one rank: use --context-parallel-size 1.",
    ),
    _Rule(
        "banks-scope",
        "plugin",
        _graphs(lambda f: f.graph_banks and f.has_moe_layers and bool(PARTIAL_MOE_SCOPES & set(f.modules))),
        "graph banks graph an MoE block whole (--cuda-graph-modules attn moe, or no modules, with drop-and-pad) "
        "or leave it eager (attn); moe_router/moe_preprocess end the graph inside the block and hand routing state "
        "to its eager rest, which is not verified with banks: use --cuda-graph-modules attn moe "
        "(--moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity) or attn with --cg-graph-banks.",
    ),
    _Rule(
        "offload-in-graph-warmup",
        "megatron",
        _graphs(lambda f: bool(f.offloaded_in_graphs) and f.warmup_steps < 1),
        "offloading modules inside the graphed scope needs eager steps before capture (Megatron asserts "
        "cuda_graph_warmup_steps > 0; the plugin's in-graph offload records its plan there): set "
        "--cuda-graph-warmup-steps 1 or more.",
    ),
    _Rule(
        "whole-layer-offload-unjoined",
        "megatron",
        _graphs(
            lambda f: (
                not f.modules and bool(f.unjoined_whole_layer_offloads) and not f.slot_capture and not f.graph_banks
            )
        ),
        "Megatron joins its offload stream into a layer's graph only when --cuda-graph-modules names attn (or mlp), "
        "so a whole-layer capture (no --cuda-graph-modules) with these saves offloaded fails in TE's capture with "
        "'capturing stream has unjoined work' (seen on megatron-core 0.19.2): pass --cuda-graph-modules attn mlp "
        "for dense layers (the same whole layer) or attn for MoE layers, or add --cg-slot-capture, whose graphs "
        "offload inside themselves.",
        detail=lambda f: f"(--offload-modules {' '.join(sorted(f.unjoined_whole_layer_offloads))})",
    ),
    _Rule(
        "offload-moe-scope",
        "megatron",
        _graphs(lambda f: f.activation_offloading and "moe" in f.modules),
        "Megatron 0.19.2's TransformerConfig refuses fine-grained activation offload with the MoE block graphed "
        "whole ('Token-drop MoE is temporarily not supported with activation offloading'): graph attn "
        "moe_router moe_preprocess (or attn) in place of --cuda-graph-modules ... moe, or drop "
        "--fine-grained-activation-offloading.",
    ),
    # Megatron-LM's MoE fine-grained-offloading case, attention graphed, trained differently from the
    # first step after a graphed backward; without the offload, or without the recompute, it was exact.
    _Rule(
        "offload-recompute-in-graphs",
        "plugin",
        _graphs(
            lambda f: (
                bool(f.offloaded_in_graphs) and f.recompute_granularity == "selective" and bool(f.recompute_modules)
            )
        ),
        "Megatron's fine-grained activation offload inside the graphed scope together with selective recompute "
        "trained differently from eager under TE graphs (Megatron-LM's moe fine_grained_offloading case on one GPU, "
        "attention graphed: the loss after the first graphed step's gradients was off by up to 0.4; without either "
        "one it was exact). Drop --recompute-granularity selective, or offload only modules outside "
        "--cuda-graph-modules, or drop --fine-grained-activation-offloading.",
        detail=lambda f: (
            f"(--offload-modules {' '.join(sorted(f.offloaded_in_graphs))} inside the graphs, "
            f"--recompute-modules {' '.join(f.recompute_modules)})"
        ),
    ),
    _Rule(
        "offload-learned-positions",
        "megatron",
        lambda f: f.activation_offloading and f.position_embedding_type == "learned_absolute",
        "Megatron 0.19.2's own fine-grained activation offload stopped with a CUDA illegal memory access in the "
        "first training step of a GPT with learned absolute position embeddings (4 x 2048, attention's groups "
        "offloaded), eager and graphed, with and without dropout, also in Megatron-LM's pretrain_gpt.py without "
        "the plugin; every offloading run with RoPE trained. Use --position-embedding-type rope, or "
        "drop --fine-grained-activation-offloading.",
    ),
    _Rule(
        "slot-capture-pipeline",
        "plugin",
        _graphs(
            lambda f: (
                f.slot_capture
                and (f.pipeline_parallel > 1 or bool(f.virtual_pipeline) or f.overlap_moe_expert_parallel_comm)
            )
        ),
        "--cg-slot-capture captures one graph per layer, for runs where each microbatch's backward follows its "
        "forward: use --pipeline-model-parallel-size 1 without virtual stages or "
        "--overlap-moe-expert-parallel-comm, or drop --cg-slot-capture.",
    ),
    _Rule(
        "slot-capture-fp8",
        "plugin",
        _graphs(
            lambda f: (
                f.slot_capture
                and (
                    f.fp4
                    or (
                        f.fp8
                        and (
                            f.fp8_recipe not in _SLOT_FP8_RECIPES
                            or f.fp8_multi_head_attention
                            or (f.fp8_attention and f.fp8_recipe != "delayed")
                        )
                    )
                )
            )
        ),
        "--cg-slot-capture takes FP8 with --fp8-recipe delayed or tensorwise, and FP8 dot-product attention "
        "(TransformerConfig fp8_dot_product_attention) with delayed scaling only, without "
        "fp8_multi_head_attention: under current scaling TE 2.20.2 with cuDNN 9.14 finds no FP8 attention backend "
        "on sm_90, the stack slot capture is verified on, so slot-shared replays of it are not verified. Use one "
        "of those recipes, --fp8-recipe delayed for FP8 attention, leave fp8_multi_head_attention off, or drop "
        "--cg-slot-capture (TE's graphs take every FP8 recipe).",
        detail=lambda f: (
            "(--fp4-format)"
            if f.fp4
            else f"(--fp8-recipe {f.fp8_recipe})"
            if f.fp8_recipe not in _SLOT_FP8_RECIPES
            else "(fp8_multi_head_attention)"
            if f.fp8_multi_head_attention
            else f"(FP8 attention with --fp8-recipe {f.fp8_recipe})"
        ),
    ),
    _Rule(
        "slot-capture-fp8-op-fuser",
        "plugin",
        _graphs(lambda f: f.slot_capture and f.fp8 and (f.te_op_fuser or f.te_op_norms)),
        "--cg-slot-capture with FP8 does not cover Transformer Engine's fused operations (te.ops), which TE 2.20 "
        "also builds its standalone norms from (Megatron's TENorm: an MoE layer's pre-MLP norm, --qk-layernorm, "
        "multi-latent attention's norms without --mla-down-proj-fusion): they run without module hooks, so "
        "slot-shared replays would not join their FP8 state to TE's amax reduction (delayed scaling), and their "
        "weight caching inside slot-shared graphs is not verified: drop --use-transformer-engine-op-fuser and "
        "those norms, train in bf16, or drop --cg-slot-capture (TE's graphs take them).",
        detail=lambda f: "(--use-transformer-engine-op-fuser)" if f.te_op_fuser else "(TE norm modules in the layers)",
    ),
    _Rule(
        "slot-capture-scope",
        "plugin",
        _graphs(lambda f: f.slot_capture and f.has_moe_layers and bool(PARTIAL_MOE_SCOPES & set(f.modules))),
        "--cg-slot-capture graphs an MoE block whole (attn moe with drop-and-pad, or the whole layer) or leaves it "
        "eager (attn); moe_router/moe_preprocess hand routing state to the eager rest, which slot capture does not "
        "verify: use --cuda-graph-modules attn moe or attn.",
    ),
    _Rule(
        "slot-capture-delayed-wgrad",
        "plugin",
        _graphs(lambda f: f.slot_capture and f.delay_wgrad_compute),
        "--delay-wgrad-compute keeps backward state until a deferred weight-gradient pass that slot-shared "
        "memory cannot protect: drop --delay-wgrad-compute with --cg-slot-capture.",
    ),
    _Rule(
        "banks-param-gather-overlap",
        "plugin",
        _graphs(lambda f: f.graph_banks and f.overlap_param_gather),
        "a bank replay bypasses the layer's forward pre-hooks that --overlap-param-gather relies on: drop "
        "--overlap-param-gather with --cg-graph-banks.",
    ),
    _Rule(
        "hybrid-cp-mamba-scope",
        "plugin",
        _graphs(lambda f: f.hybrid_context_parallel and "mamba" in f.modules),
        "graph banks under --hybrid-context-parallel capture TransformerLayers (attention, MLP); Mamba layers "
        "have no per-CP-size bank: drop mamba from --cuda-graph-modules.",
    ),
    _Rule(
        "hybrid-cp-pipeline",
        "megatron",
        _graphs(lambda f: f.hybrid_context_parallel and f.pipeline_parallel > 1),
        "--hybrid-context-parallel needs --pipeline-model-parallel-size 1.",
    ),
    _Rule(
        "hybrid-cp-power-of-two",
        "plugin",
        _graphs(lambda f: f.hybrid_context_parallel and not is_power_of_two(f.data_context_parallel)),
        "graph banks under --hybrid-context-parallel exist per power-of-two CP size, so DP x CP (ranks / "
        "(TP x PP)) must be a power of two: change the number of ranks or the TP/PP sizes.",
    ),
    _Rule(
        "hybrid-cp-delayed-wgrad",
        "plugin",
        _graphs(lambda f: f.hybrid_context_parallel and f.delay_wgrad_compute),
        "--delay-wgrad-compute keeps backward state until a deferred weight-gradient pass that slot-shared "
        "graph memory cannot protect: drop --delay-wgrad-compute with graph banks.",
    ),
    _Rule(
        "hybrid-cp-ep-overlap",
        "plugin",
        _graphs(lambda f: f.hybrid_context_parallel and f.overlap_moe_expert_parallel_comm),
        "--overlap-moe-expert-parallel-comm reorders graphs per layer, which graph banks do not support: "
        "drop it with --hybrid-context-parallel.",
    ),
    _Rule(
        "hybrid-cp-ranks",
        "plugin",
        lambda f: f.hybrid_context_parallel and f.data_context_parallel < 2,
        "--hybrid-context-parallel splits each sample's documents over the DP x CP ranks (ranks / (TP x PP)), and "
        "these flags leave one, so every document trains with CP 1: run on 2 or more ranks (python -m "
        "torch.distributed.run --nproc-per-node 2 ..., or torchrun; megatron-cg check --nproc 2).",
        detail=lambda f: (
            f"(DP x CP {f.data_context_parallel}: {f.world_size} rank(s), TP {f.tensor_parallel}, "
            f"PP {f.pipeline_parallel})"
        ),
    ),
    _Rule(
        "hybrid-cp-rerun-mode",
        "megatron",
        lambda f: f.hybrid_context_parallel and f.rerun_mode != "disabled",
        "--hybrid-context-parallel needs --rerun-mode disabled (Megatron's hybrid-CP loader is not a "
        "RerunDataIterator).",
    ),
    _Rule(
        "rerun-mode-report-stats",
        "megatron",
        lambda f: f.rerun_mode == "report_stats",
        "--rerun-mode report_stats cannot start on megatron-core 0.19.2: the flag's value is not one of its "
        "RerunMode's (which names the mode report_determinism_stats), so initialization fails with \"ValueError: "
        "'report_stats' is not a valid RerunMode\": use --rerun-mode validate_results (the default) or disabled.",
    ),
    _Rule(
        "fp8-delayed-resume-pickle",
        "megatron",
        lambda f: f.fp8 and f.fp8_recipe == "delayed" and f.resumes_checkpoint and not f.unsafe_pickle_allowed,
        "resuming FP8 delayed scaling from a checkpoint: TE 2.20 stores its scaling metadata there as a pickle and "
        'refuses to load it ("Refusing to load pickled Transformer Engine extra state") unless the environment '
        "says the checkpoint is trusted: export NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 for a checkpoint you wrote, "
        "or start without --load.",
        detail=lambda f: f"(--load {f.load})",
    ),
    _Rule(
        "tensorboard-needs-dir",
        "plugin",
        lambda f: f.log_to_tensorboard and not f.tensorboard_dir,
        "--cg-log-to-tensorboard writes into Megatron's TensorBoard writer, which exists only with "
        "--tensorboard-dir: add --tensorboard-dir DIR, or drop --cg-log-to-tensorboard.",
    ),
    _Rule(
        "hybrid-cp-document-masking",
        "megatron",
        lambda f: f.hybrid_context_parallel and not (f.inter_document_masking or f.sft),
        "--hybrid-context-parallel splits each sample into its documents: add "
        "--dataloader-inter-document-masking (or train --sft data, whose samples carry them).",
    ),
    # Stock Megatron and the plugin alike crash at the first graphed step (Megatron-LM #5619), whole layer and
    # attn; with --micro-batch-size > 1 the flattened stream also misses the graphs' static hidden states' shape.
    _Rule(
        "packed-sequences-te-graphs",
        "megatron",
        _graphs(lambda f: f.packed and f.thd_max_seqs is None and (f.attention_graphed or f.micro_batch_size > 1)),
        "--dataloader-inter-document-masking and --sft train packed (THD) batches whose cu_seqlens change from batch "
        "to batch, and megatron-core 0.19.2's TE graph replay refuses their packed_seq_params "
        "(TransformerLayer._te_cuda_graph_replay asserts at the first graphed step, Megatron-LM #5619): add "
        "--cg-thd-max-seqs N, the most documents one microbatch holds (the plugin then lays packed batches out at "
        "that capacity, eager and graphed alike, and refuses a batch with more), or use --cuda-graph-impl none.",
    ),
    _Rule(
        "thd-max-seqs-without-packed-data",
        "plugin",
        _graphs(lambda f: f.thd_max_seqs is not None and not f.packed and not f.hybrid_context_parallel),
        "--cg-thd-max-seqs captures the graphs for packed (THD) microbatches, and these flags train unpacked data, "
        "so no batch would bring the offsets the graphs take: drop --cg-thd-max-seqs, or train packed data "
        "(--dataloader-inter-document-masking, or --sft).",
    ),
    _Rule(
        "thd-max-seqlen-without-packed-graphs",
        "plugin",
        lambda f: f.thd_max_seqlen is not None and (f.thd_max_seqs is None or f.hybrid_context_parallel),
        "--cg-thd-max-seqlen bounds the documents of the fixed layout --cg-thd-max-seqs lays packed data out at "
        "(--dataloader-inter-document-masking or --sft, no hybrid CP) and does nothing without it: add "
        "--cg-thd-max-seqs N, the most documents one microbatch holds, or drop --cg-thd-max-seqlen (hybrid CP's packs "
        "are bounded by --max-seqlen-per-dp-cp-rank).",
        detail=lambda f: "(--hybrid-context-parallel)" if f.hybrid_context_parallel else "(no --cg-thd-max-seqs)",
    ),
    _Rule(
        "thd-max-seqlen-bound",
        "plugin",
        lambda f: f.thd_max_seqlen is not None and f.seq_length is not None and f.thd_max_seqlen > f.seq_length,
        "--cg-thd-max-seqlen is the longest document a packed microbatch holds, and no document is longer than a "
        "sample of --seq-length tokens: lower --cg-thd-max-seqlen to at most --seq-length, or drop it (--seq-length "
        "is its default).",
        detail=lambda f: f"(--cg-thd-max-seqlen {f.thd_max_seqlen}, --seq-length {f.seq_length})",
    ),
    _Rule(
        "packed-graphs-capacity",
        "plugin",
        lambda f: f.packed_graphs and f.thd_max_seqs is not None and f.thd_max_seqs < f.packed_min_seqs,
        "Megatron's offsets cover every token of a microbatch's samples, in documents of at most --cg-thd-max-seqlen "
        "tokens (default --seq-length), so each sample holds at least --seq-length / --cg-thd-max-seqlen (rounded up) "
        "documents and packed graphs need --cg-thd-max-seqs of at least --micro-batch-size times that: raise "
        "--cg-thd-max-seqs (or --cg-thd-max-seqlen).",
        detail=lambda f: (
            f"(--cg-thd-max-seqs {f.thd_max_seqs}, --micro-batch-size {f.micro_batch_size}"
            f"{f', --seq-length {f.seq_length}' if f.seq_length else ''}"
            f"{f', --cg-thd-max-seqlen {f.thd_max_seqlen}' if f.thd_max_seqlen else ''}: "
            f"at least {f.packed_min_seqs})"
        ),
    ),
    # On Hopper (TE 2.20.2, sm90) deterministic packed training at 32 x 16 heads x 4096^2 fell back to
    # unfused attention (16 GiB of scores per layer: the farm's packed cases OOMed) and gave other bits than
    # Megatron's own layout; with max_seqlen the batch's longest document the bits were Megatron's, and without
    # deterministic mode every max_seqlen (4096 too) gave Megatron's bits.
    _Rule(
        "packed-graphs-deterministic-attention",
        "plugin",
        lambda f: (
            f.packed_layout
            and f.deterministic
            and f.deterministic_thd_product is not None
            and f.deterministic_thd_product >= DETERMINISTIC_THD_LIMIT
            and (f.device_capability is None or f.device_capability[0] == 9)
        ),
        "TE 2.20.2 runs deterministic THD attention backward in cuDNN on Hopper only while N x heads-per-rank x L^2 < "
        "2^30 (N = --cg-thd-max-seqs, L = --cg-thd-max-seqlen, default --seq-length: the packed layout's cu_seqlens "
        "and max_seqlen, eager and graphed), and otherwise falls back to unfused attention, which holds N x heads x "
        "L x L scores per layer and computes other bits than Megatron's own layout: set --cg-thd-max-seqlen to the "
        "longest document the data holds (and --cg-thd-max-seqs to the most documents per microbatch) so the product "
        "stays under 2^30 (with --sft a sample's end padding belongs to its last conversation, so L covers it unless "
        "every sample is full), or train without --deterministic-mode (where the packed graphs keep TE's fused "
        "attention at any L); an eager run (--cuda-graph-impl none) can drop --cg-thd-max-seqs instead.",
        detail=lambda f: (
            f"(--cg-thd-max-seqs {f.thd_max_seqs} x {f.heads_per_rank} heads per rank x "
            f"{f.packed_max_seqlen}^2 = {f.deterministic_thd_product} >= 2^30; {_fitting_seqlen(f)})"
        ),
    ),
    _Rule(
        "packed-graphs-moe",
        "plugin",
        lambda f: f.packed_graphs and f.has_moe_layers,
        "packed graphs (--cg-thd-max-seqs without hybrid CP) are built for dense layers: Megatron un-flattens a "
        "packed microbatch for the MoE router from params its scoped replay does not pass on; train the MoE model "
        "with --cuda-graph-impl none on packed data.",
    ),
    _Rule(
        "packed-graphs-slot-capture",
        "plugin",
        lambda f: f.packed_graphs and f.slot_capture,
        "--cg-slot-capture does not carry packed microbatches' offsets (not built): drop --cg-slot-capture with "
        "--cg-thd-max-seqs (TE's capture takes them).",
    ),
    _Rule(
        "packed-graphs-offload",
        "plugin",
        lambda f: f.packed_graphs and bool(f.offloaded_in_graphs),
        "fine-grained activation offload inside the graphed scope is not built for packed graphs: offload only "
        "modules outside --cuda-graph-modules, or drop --fine-grained-activation-offloading.",
        detail=lambda f: f"(--offload-modules {' '.join(sorted(f.offloaded_in_graphs))} inside the graphs)",
    ),
    _Rule(
        "packed-graphs-rope",
        "plugin",
        lambda f: (
            f.packed_graphs
            and f.attention_graphed
            and (
                f.position_embedding_type in ("yarn", "mrope")
                or f.multi_latent_attention
                or (f.position_embedding_type == "rope" and not f.apply_rope_fusion)
            )
        ),
        "packed graphs take Megatron's fused THD RoPE (--position-embedding-type rope, the default --rope-fusion) or "
        "learned absolute positions; the unfused THD RoPE reads sequence lengths on the host (.tolist()), which a "
        "graph cannot capture, and yarn, mrope and multi-latent attention's RoPE are not built: change "
        "--position-embedding-type, drop --no-rope-fusion, or graph --cuda-graph-modules mlp only.",
        detail=lambda f: (
            "(--multi-latent-attention)"
            if f.multi_latent_attention
            else f"(--position-embedding-type {f.position_embedding_type}"
            f"{', --no-rope-fusion' if not f.apply_rope_fusion else ''})"
        ),
    ),
    _Rule(
        "packed-launcher-sft",
        "plugin",
        lambda f: f.launcher and f.sft,
        "the plugin's launcher builds GPT datasets (indexed or mock), not Megatron's SFT dataset: train --sft through "
        "Megatron-LM's pretrain_gpt.py (megatron-cg run PATH/pretrain_gpt.py ...).",
    ),
    _Rule(
        "packed-launcher-pipeline",
        "plugin",
        lambda f: f.launcher and f.inter_document_masking and not f.hybrid_context_parallel and f.pipeline_parallel > 1,
        "the launcher's packed data path feeds the first and last pipeline stages only: use "
        "--pipeline-model-parallel-size 1 with --dataloader-inter-document-masking, or Megatron-LM's pretrain_gpt.py "
        "through megatron-cg run.",
    ),
    _Rule(
        "hybrid-cp-seqlen-per-rank",
        "megatron",
        lambda f: f.hybrid_context_parallel and not f.max_seqlen_per_dp_cp_rank,
        "--hybrid-context-parallel needs --max-seqlen-per-dp-cp-rank N (tokens per rank of a packed microbatch).",
    ),
    _Rule(
        "hybrid-cp-launcher-tp",
        "plugin",
        lambda f: f.launcher and f.hybrid_context_parallel and f.tensor_parallel != 1,
        "the launcher's hybrid-CP data path does not broadcast over tensor parallelism: use "
        "--tensor-model-parallel-size 1 with --hybrid-context-parallel.",
    ),
    _Rule(
        "banks-fp8",
        "plugin",
        _graphs(lambda f: f.graph_banks and f.fp8),
        "graph banks capture through slot-shared memory, which does not protect FP8 quantizer state yet: drop "
        "--fp8-format with --cg-graph-banks.",
    ),
    _Rule(
        "fp8-recipe-device",
        "plugin",
        _graphs(
            lambda f: (
                f.fp8
                and f.device_capability is not None
                and (
                    (f.fp8_recipe == "mxfp8" and f.device_capability < (10, 0))
                    or (
                        f.fp8_recipe == "blockwise"
                        and (f.device_capability < (9, 0) or (f.cuda_version is not None and f.cuda_version < (12, 9)))
                    )
                )
            )
        ),
        "this GPU cannot run the --fp8-recipe asked for (TE 2.20: MXFP8 needs compute capability 10.0+, "
        "blockwise scaling 9.0+ with CUDA 12.9+): use --fp8-recipe tensorwise (current scaling) or delayed, or "
        "blockwise on sm_90 with a CUDA 12.9+ build of torch and TE.",
        detail=lambda f: (
            f"(--fp8-recipe {f.fp8_recipe}, compute capability "
            f"{'.'.join(map(str, f.device_capability or ()))}, CUDA "
            f"{'.'.join(map(str, f.cuda_version or ())) or 'unknown'})"
        ),
    ),
    _Rule(
        "fp4-device",
        "plugin",
        _graphs(lambda f: f.fp4 and f.device_capability is not None and f.device_capability < (10, 0)),
        "--fp4-format (NVFP4) needs compute capability 10.0+ (TE 2.20); on this GPU use --fp8-format with "
        "--fp8-recipe tensorwise or delayed.",
        detail=lambda f: f"(compute capability {'.'.join(map(str, f.device_capability or ()))})",
    ),
    _Rule(
        "cg-flags",
        "plugin",
        lambda f: bool(f.config_problems),
        "a --cg-* flag has a value the plugin cannot use:",
        detail=lambda f: " ".join(f.config_problems),
    ),
    _Rule(
        "data-files",
        "plugin",
        lambda f: bool(f.missing_files),
        "a dataset or tokenizer file named by the flags does not exist (--data-path PREFIX needs PREFIX.bin and "
        "PREFIX.idx); fix the path:",
        detail=lambda f: ", ".join(f.missing_files),
    ),
    _Rule(
        "gradient-accumulation-fusion",
        "megatron",
        lambda f: f.gradient_accumulation_fusion and not f.apex_fused_wgrad,
        "--gradient-accumulation-fusion (Megatron's default) needs APEX's fused_weight_gradient_mlp_cuda, "
        "which is not installed: add --no-gradient-accumulation-fusion.",
    ),
    _Rule(
        "expandable-segments",
        "megatron",
        _graphs(lambda f: f.expandable_segments and not f.nccl_graph_register_off),
        "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which corrupts memory under CUDA "
        "graphs unless NCCL_GRAPH_REGISTER=0: export NCCL_GRAPH_REGISTER=0.",
    ),
    _Rule(
        "inject-capture-failure-layer",
        "plugin",
        _graphs(
            lambda f: (
                f.inject_capture_failure is not None
                and f.num_layers is not None
                and f.inject_capture_failure > _graphed_layers_per_rank(f)
            )
        ),
        "--cg-inject-capture-failure N fails the capture of a rank's N-th graphed layer, and no rank graphs that "
        "many, so nothing would fail: give N from 1 to the graphed layers of a rank.",
        detail=lambda f: (
            f"(--cg-inject-capture-failure {f.inject_capture_failure}; a first-stage rank graphs "
            f"{_graphed_layers_per_rank(f)} layer(s))"
        ),
    ),
    _Rule("warmup-steps", "plugin", _graphs(lambda f: f.warmup_steps < 0), "--cuda-graph-warmup-steps must be >= 0."),
    _Rule(
        "parallel-sizes",
        "megatron",
        lambda f: f.world_size % (f.tensor_parallel * f.pipeline_parallel * f.context_parallel) != 0,
        "the world size must be a multiple of TP x PP x CP: change --tensor-model-parallel-size, "
        "--pipeline-model-parallel-size, --context-parallel-size or the number of ranks.",
    ),
)


def markdown_rows(rules: tuple[_Rule, ...] = RULES) -> str:
    """The rules table of docs/troubleshooting.md, one row per rule."""
    return "\n".join(f"| `{rule.name}` | {rule.source} | {rule.fix} |" for rule in rules)


# Rules about what this host lacks (Transformer Engine, APEX, a GPU able to run the recipe) rather than what the
# flags say: a run asks them once the flags' own rules passed (``check_run(host_rules=False)``, then ``HOST_RULES``),
# and a refusal lists them last, so its first line is a flag to change where there is one.
_HOST_RULE_NAMES = frozenset({"te-installed", "gradient-accumulation-fusion", "fp8-recipe-device", "fp4-device"})
HOST_RULES = tuple(rule for rule in RULES if rule.name in _HOST_RULE_NAMES)
_FLAG_RULES = tuple(rule for rule in RULES if rule.name not in _HOST_RULE_NAMES)


def violations(facts: RunSettings, rules: tuple[_Rule, ...] = RULES) -> list[tuple[str, str]]:
    broken = [rule for rule in rules if rule.violated(facts)]
    return [(rule.name, rule.message(facts)) for rule in sorted(broken, key=lambda rule: rule.name in _HOST_RULE_NAMES)]


def validate(facts: RunSettings, rules: tuple[_Rule, ...] = RULES) -> None:
    """Raises ``RuleViolation`` listing every broken rule (not just the first)."""
    broken = violations(facts, rules)
    if broken:
        raise RuleViolation(broken)


_PLUGIN_RULES = tuple(rule for rule in RULES if rule.source == "plugin")


# The rules on sizes and intervals that validate_args computes from or asserts without naming a flag: they read the
# flags as parsed (no value validate_args derives) and are checked before it runs, so no assertion of its hides them.
_EARLY_RULES = (
    _MODEL_SIZES,
    _HEADS_DIVIDE_HIDDEN,
    _QUERY_GROUPS_DIVIDE_HEADS,
    _TENSOR_PARALLEL_SPLIT,
    _GLOBAL_BATCH,
    _LOOP_INTERVALS,
    _SAMPLE_COUNTS,
)


def early_violations(args: Any) -> list[tuple[str, str]]:
    """The early rules (``model-sizes`` and the sizes and intervals validate_args asserts bare or words for
    another flag) on flags as parsed, before Megatron's ``validate_args`` computes anything from them (where a 0
    divides by zero and a huge count runs out of memory): the run stops here instead, naming the flag."""
    return _unvalidated_violations(args, {}, _EARLY_RULES)


def unvalidated_plugin_violations(args: Any, *, env: Mapping[str, str]) -> list[tuple[str, str]]:
    """The plugin's own rules on flags as parsed, before Megatron's ``validate_args``: it stops at its
    first assertion (often the world size) before the plugin's rules run, so a dry run reports these
    beside Megatron's refusal and neither hides the other. Read before Megatron normalizes the flags
    (TE assumed present, as on the GPU host), so this is a best effort: flags it cannot read give none."""
    if not has_plugin_flags(args) or missing_plugin_flags(args):
        return []
    try:
        slot_debug_from_environment(env)
    except ValueError:  # the run's own check reports it
        return []
    return _unvalidated_violations(args, env, _PLUGIN_RULES)


def _unvalidated_violations(args: Any, env: Mapping[str, str], rules: tuple[_Rule, ...]) -> list[tuple[str, str]]:
    """``rules`` on flags as parsed, before ``validate_args`` (TE assumed present, as on the GPU host); none
    where a value only ``validate_args`` would have normalized makes the flags unreadable."""
    try:
        settings, _config = read_settings(args, env=env, te_available=True, apex_fused_wgrad=True)
        return violations(settings, rules)
    except (TypeError, ValueError, AttributeError):
        return []


_ENVIRONMENT_RULES = tuple(rule for rule in RULES if rule.name in ("environment-switches", "environment-values"))


def environment_violations(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """The rules on the environment alone (``environment-switches``, ``environment-values``): ``install()``
    runs them before Megatron's parser, which reads WORLD_SIZE and RANK with int() and fails with a
    traceback on a bad one."""
    return violations(environment_settings(env), _ENVIRONMENT_RULES)


def check_run(
    args: Any,
    *,
    env: Mapping[str, str],
    launcher: bool = False,
    config: PluginConfig | None = None,
    te_present: bool | None = None,
    host_rules: bool = True,
) -> tuple[RunSettings, PluginConfig | None]:
    """The one check of a run's validated flags, shared by ``megatron-cg check``, the launcher and
    ``install()``: the run's settings as ``settings.read_run_settings`` reads them (the plugin's config from
    its ``--cg-*`` flags unless ``config`` is given, the files the flags name, what this host has and what
    Megatron's own builders make of the flags on CPU), then every rule on them (without ``HOST_RULES``
    unless ``host_rules``). Raises ``RuleViolation`` listing each broken rule; returns the run's settings
    (``settings.RunSettings``) and the config. ``te_present`` overrides the probe (the CPU dry run checks
    flags for a GPU host it is not running on)."""
    settings, config = read_run_settings(args, env=env, launcher=launcher, config=config, te_present=te_present)
    validate(settings, RULES if host_rules else _FLAG_RULES)
    return settings, config
