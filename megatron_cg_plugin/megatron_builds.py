"""What Megatron builds from a run's flags between argument parsing and the first step, built here on CPU
with Megatron's own code: the tokenizer (``build_tokenizer``, which ``set_global_variables`` calls right
after ``validate_args``), the optimizer's configs and learning-rate schedule (``setup_model_and_optimizer``)
and the datasets' blend and split (``BlendedMegatronDatasetConfig``, which the dataset provider builds).

Each probe takes the run's settings (``settings.RunSettings``), read from Megatron's validated args, and the
args themselves, which it hands whole to Megatron's builders that take them (it reads no flag off them), and
returns the builder's error as one line (``failure_text``), or None where the build succeeds or where building
here would prove nothing: a library or file only the GPU host may have, a tokenizer the hub must send,
something another rule already names (a missing file, a flag not given). ``settings.read_run_settings`` runs
them for the rules ``tokenizer-build``, ``optimizer-setup`` and ``data-blend-split``. Nothing here reads a file
without bounding it or changes the args it is given.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import logging
import math
import os
import traceback
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from megatron_cg_plugin.data.sources import is_explicitly_local

if TYPE_CHECKING:
    from megatron_cg_plugin.settings import RunSettings

__all__ = ["dataset_problem", "failure_text", "optimizer_problem", "tokenizer_note", "tokenizer_problem"]

# The library each tokenizer type Megatron builds offline needs (None: none). The others are left to the run: the
# hub-config ones below, and the multimodal and SFT tokenizers, which take formats of their own.
_OFFLINE_TOKENIZERS = {
    "NullTokenizer": None,
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
    "HuggingFaceTokenizer": "transformers",
}
# Megatron's tokenizers that load a hub model's configuration with the vocabulary files the flags give
# (megatron_hf_tokenizer.MEGATRON_CONFIG_MAP): only the run, with the hub or its cache at hand, builds them.
_HUB_CONFIG_TOKENIZERS = {
    "GPT2BPETokenizer": "gpt2",
    "BertWordPieceLowerCase": "bert-large-uncased",
    "BertWordPieceCase": "bert-large-cased",
}
_SHOWN_WEIGHTS = 5  # bad dataset weights named in a refusal; more are counted
# Larger than any tokenizer model file; a larger one is left to the run rather than read into memory here.
_LARGEST_TOKENIZER_FILE = 1 << 30


def failure_text(error: BaseException) -> str:
    """An error a builder raised, as one line: its message (Megatron's asserts often have none) and the
    line that raised it."""
    message = str(error).strip() or "(no message)"
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return message
    frame = frames[-1]
    return f"{message} [{frame.filename.split('site-packages/')[-1]}:{frame.lineno}: {frame.line}]"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Megatron's builders warn about defaults they fill in and log what they built; a probe reports only what
    fails (the run logs them when it builds)."""
    disabled = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)


def _tokenizer_file_problem(path: str) -> str | None:
    """Why the file at ``path`` cannot be the tokenizer's model: only a special file (a pipe or a device, whose
    reading may never end) is refused here; what Megatron's loader makes of a regular file or a folder, it says."""
    if os.path.isdir(path) or os.path.isfile(path):
        return None
    return f"--tokenizer-model {path} is not a file or a folder (Megatron would read it as the tokenizer's model)"


@dataclasses.dataclass(frozen=True)
class _TokenizerVerdict:
    """Whether the run's tokenizer is built here; else the problem that refuses it unbuilt, or a note saying why
    check could not build it (none where another rule names the flags)."""

    build: bool
    problem: str | None = None
    note: str | None = None


def _tokenizer_verdict(settings: RunSettings) -> _TokenizerVerdict:
    kind = settings.tokenizer_type
    if kind in _HUB_CONFIG_TOKENIZERS:
        return _TokenizerVerdict(
            False,
            note=f"{kind} loads the configuration of the hub model {_HUB_CONFIG_TOKENIZERS[kind]!r} beside its "
            "files when the run starts, so check does not build it",
        )
    if kind not in _OFFLINE_TOKENIZERS:
        return _TokenizerVerdict(False, note=None if kind is None else f"check does not build a {kind}")
    library = _OFFLINE_TOKENIZERS[kind]
    if library is not None and importlib.util.find_spec(library) is None:
        return _TokenizerVerdict(
            False, note=f"{kind} needs the {library} package, which is not installed here, so check does not build it"
        )
    divisible_by = settings.make_vocab_size_divisible_by
    if not isinstance(divisible_by, int) or divisible_by < 1:
        return _TokenizerVerdict(False)  # rule model-sizes names it
    if kind == "NullTokenizer":
        return _TokenizerVerdict(bool(settings.vocab_size))  # without: rule tokenizer-files
    path = settings.tokenizer_model
    if not path:
        return _TokenizerVerdict(False)  # rule tokenizer-files
    if not os.path.exists(path):
        if kind == "HuggingFaceTokenizer" and not is_explicitly_local(path):
            return _TokenizerVerdict(
                False,
                note=f"--tokenizer-model {path} is no local path: the run loads it from the HuggingFace hub (or its "
                "cache), so check does not build it",
            )
        return _TokenizerVerdict(False)  # rule data-files names the missing file
    if kind == "HuggingFaceTokenizer" and settings.trust_remote_code:
        return _TokenizerVerdict(
            False, note="with --trust-remote-code building the tokenizer runs its own code, so check does not build it"
        )
    special = _tokenizer_file_problem(path)
    if special is not None:
        return _TokenizerVerdict(False, problem=special)
    if os.path.isfile(path) and os.path.getsize(path) > _LARGEST_TOKENIZER_FILE:
        return _TokenizerVerdict(False, note=f"--tokenizer-model {path} is over 1 GiB, so check does not load it")
    return _TokenizerVerdict(True)


def tokenizer_problem(settings: RunSettings, args: Any) -> str | None:
    """Megatron's ``build_tokenizer`` on a copy of ``args`` (it sets ``padded_vocab_size``), where it builds
    offline: the null tokenizer, and the ones loaded from a local file or folder whose library is installed.
    On flags Megatron's ``validate_args`` has not filled in (``settings.validated``) there is nothing to build
    from yet; the same holds for each probe."""
    if not settings.validated:
        return None
    verdict = _tokenizer_verdict(settings)
    if not verdict.build:
        return verdict.problem
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    try:
        with _quiet():
            build_tokenizer(copy.copy(args))
    except Exception as error:  # noqa: BLE001 - whatever the builder raises stops the run there
        return failure_text(error)
    return None


def tokenizer_note(settings: RunSettings) -> str | None:
    """Why check could not build the run's tokenizer (the run may still fail building it), for its output."""
    return _tokenizer_verdict(settings).note if settings.validated else None


class _NoParameters:
    """An optimizer without parameters, with one parameter group: what Megatron's schedule sets the
    learning rate and weight decay of."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = [{}]


def _schedule_steps(settings: RunSettings) -> tuple[Any, Any, Any, Any] | None:
    """(warmup, decay, weight-decay increment, WSD decay) steps, in samples, as Megatron's
    ``get_optimizer_param_scheduler`` (training.py) derives them; None where it raises "either train-iters or
    train-samples should be provided"."""
    schedule = settings.lr_schedule
    fraction = schedule.lr_warmup_fraction
    if settings.train_iters:
        batch: Any = settings.global_batch_size  # validate_args sets it
        decay = (schedule.lr_decay_iters if schedule.lr_decay_iters is not None else settings.train_iters) * batch
        wsd = None if schedule.lr_wsd_decay_iters is None else schedule.lr_wsd_decay_iters * batch
        warmup = fraction * decay if fraction is not None else schedule.lr_warmup_iters * batch
        return warmup, decay, settings.train_iters * batch, wsd
    if settings.train_samples:
        decay = schedule.lr_decay_samples if schedule.lr_decay_samples is not None else settings.train_samples
        warmup = fraction * decay if fraction is not None else schedule.lr_warmup_samples
        return warmup, decay, settings.train_samples, schedule.lr_wsd_decay_samples
    return None


def optimizer_problem(settings: RunSettings, args: Any) -> str | None:
    """Megatron's optimizer and DDP configs (its own ``get_megatron_optimizer_config`` and
    ``get_megatron_ddp_config`` on ``args``) and its learning-rate schedule (``OptimizerParamScheduler`` with
    the steps ``get_optimizer_param_scheduler`` derives, stepped to the run's end), as
    ``setup_model_and_optimizer`` builds them for a run that trains."""
    if not settings.validated:
        return None
    if settings.skip_train and not (settings.perform_rl_step and not settings.no_load_optim):
        return None  # no optimizer is built
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

    steps = _schedule_steps(settings)
    if steps is None:
        return (
            "either train-iters or train-samples should be provided [megatron/training/training.py: "
            "get_optimizer_param_scheduler]"
        )
    warmup, decay, weight_decay_steps, wsd = steps
    schedule = settings.lr_schedule
    values = (
        f"(schedule in samples: warmup {warmup:g}, decay {decay:g}; --lr {schedule.lr}, --min-lr {schedule.min_lr}, "
        f"--lr-warmup-init {schedule.lr_warmup_init}, --global-batch-size {settings.global_batch_size})"
    )
    try:
        with _quiet():
            get_megatron_optimizer_config(args)
            get_megatron_ddp_config(args)
            scheduler = OptimizerParamScheduler(
                _NoParameters(),
                init_lr=schedule.lr_warmup_init,
                max_lr=schedule.lr,
                min_lr=schedule.min_lr,
                lr_warmup_steps=warmup,
                lr_decay_steps=decay,
                lr_decay_style=schedule.lr_decay_style,
                start_wd=schedule.start_weight_decay,
                end_wd=schedule.end_weight_decay,
                wd_incr_steps=weight_decay_steps,
                wd_incr_style=schedule.weight_decay_incr_style,
                use_checkpoint_opt_param_scheduler=schedule.use_checkpoint_opt_param_scheduler,
                override_opt_param_scheduler=schedule.override_opt_param_scheduler,
                wsd_decay_steps=wsd,
                lr_wsd_decay_style=schedule.lr_wsd_decay_style,
            )
            scheduler.step(weight_decay_steps)  # the learning rate and weight decay of the run's last step
    except Exception as error:  # noqa: BLE001 - whatever the builders raise stops the run before its first step
        return f"{failure_text(error)} {values}"
    return None


def _argument_files(settings: RunSettings) -> list[str]:
    return [path for path in (settings.data_args_path, settings.per_split_data_args_path) if path]


def dataset_problem(settings: RunSettings, args: Any) -> str | None:
    """The datasets' blend (Megatron's ``get_blend_and_blend_per_split``) and Megatron's
    ``BlendedMegatronDatasetConfig`` of it, which parses ``--split``; then what those accept but the build
    refuses later: a weight that is not positive (``BlendedDataset`` asserts each is), a split whose weights
    sum to 0 (its shares are NaN), and training with no share of the split (the run would train nothing).
    Mock data takes no blend or split; an argument file that cannot be read is rule data-files'."""
    if not settings.validated:
        return None
    if settings.mock_data:
        return None
    if settings.data_path == ():
        return "--data-path is given without a dataset: give PREFIX, or WEIGHT PREFIX pairs"
    from megatron.core.datasets.blended_megatron_dataset_config import (
        BlendedMegatronDatasetConfig,
        parse_and_normalize_split,
    )
    from megatron.training.utils import get_blend_and_blend_per_split

    try:
        blend, blend_per_split = get_blend_and_blend_per_split(args)
    except Exception as error:  # noqa: BLE001 - the blend the flags give cannot be read, and the run reads it so
        return None if _argument_files(settings) else failure_text(error)
    blends = [blend] if blend is not None else [split for split in blend_per_split or () if split is not None]
    if not blends:
        return None  # no data source: rule data-source
    bad_weights = [weight for _prefixes, weights in blends for weight in weights or () if not 0 < weight < math.inf]
    if bad_weights:
        values = sorted(set(bad_weights), key=str)  # each value once: a blend may list thousands of datasets
        shown = ", ".join(f"{weight:g}" for weight in values[:_SHOWN_WEIGHTS]) + (
            ", ..." if len(values) > _SHOWN_WEIGHTS else ""
        )
        return (
            f"dataset weights {shown} ({len(bad_weights)} of {sum(len(prefixes) for prefixes, _ in blends)} "
            "datasets) are not positive numbers (Megatron's BlendedDataset asserts each weight > 0)"
        )
    try:
        with _quiet():
            BlendedMegatronDatasetConfig(
                random_seed=settings.seed,
                sequence_length=settings.seq_length,
                blend=blend,
                blend_per_split=blend_per_split,
                split=settings.split,
            )
    except Exception as error:  # noqa: BLE001 - whatever the config refuses stops the run when it builds datasets
        return failure_text(error)
    trains = bool(settings.train_iters or settings.train_samples) and not settings.skip_train
    if blend is None:  # per-split blends, which take no --split
        if trains and (blend_per_split is None or blend_per_split[0] is None):
            return "the per-split data names no training data (--train-data-path), so the run would train nothing"
        return None
    with _quiet():
        shares = parse_and_normalize_split(settings.split)
    if not all(math.isfinite(share) for share in shares):
        return f"--split {settings.split} gives every split a weight of 0, so no split has a share of the data"
    if shares[0] == 0 and trains:
        return f"--split {settings.split} gives training no share of the data, so the run would train nothing"
    return None
