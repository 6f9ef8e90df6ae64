"""Where a run's tokens come from: Megatron's mock data or its indexed datasets (``--data-path``
with blends and ``--split``, or per-split paths), with Megatron's own tokenizers.

``missing_files`` is what ``megatron-cg check`` and every run check before any GPU work (the
``data-files`` rule); ``build_datasets`` is the launcher's dataset provider. Both take the run's
settings (``settings.RunSettings``) and read the blend with Megatron's own parser
(``get_blend_and_blend_per_split``, handed Megatron's args whole), so they agree with Megatron's
loader on what a flag names.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_cg_plugin.settings import RunSettings

__all__ = ["build_datasets", "dataset_config", "is_explicitly_local", "missing_files"]

# Megatron's tokenizers that load a model file named by --tokenizer-model (HuggingFace takes hub
# names there too, so only a path that can only be local is checked: is_explicitly_local).
_TOKENIZER_MODEL_FILES = frozenset(
    {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer"}
)


def _is_local(path: str) -> bool:
    return "://" not in path  # msc:// and other object-store prefixes are not files here


def is_explicitly_local(path: str) -> bool:
    """A path no hub name looks like (absolute, or from . or ..): a HuggingFace tokenizer loads it from disk."""
    return os.path.isabs(path) or path.startswith(("./", "../"))


def _blend_prefixes(settings: RunSettings, args: Any) -> tuple[list[str], list[str]]:
    """The dataset prefixes the flags name, and the argument files that could not be read."""
    from megatron.training.utils import get_blend_and_blend_per_split

    argument_files = [path for path in (settings.data_args_path, settings.per_split_data_args_path) if path is not None]
    if any(not _is_local(path) for path in argument_files):
        return [], []  # an object store's listing is read by the run, not checked here
    unreadable = [path for path in argument_files if not os.path.isfile(path)]
    if unreadable:
        return [], unreadable
    try:
        blend, blend_per_split = get_blend_and_blend_per_split(args)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as error:
        if not argument_files:  # the flags' own blend: rule data-blend-split quotes Megatron's error
            return [], []
        return [], [
            f"{' '.join(argument_files)} (cannot be read as Megatron's data arguments: {type(error).__name__}: {error})"
        ]
    blends = [blend] if blend is not None else [split for split in blend_per_split or () if split is not None]
    return [prefix for prefixes, _weights in blends for prefix in prefixes], []


def missing_files(settings: RunSettings, args: Any, *, indexed_data: bool) -> list[str]:
    """Every tokenizer file the run's settings name that does not exist here, and with
    ``indexed_data`` (the launcher's data path: Megatron's ``GPTDataset``) every dataset prefix's
    ``.bin``/``.idx``; a script's own loader may read other formats from ``--data-path``. ``args``
    are Megatron's parsed args the settings were read from, for its blend parser."""
    no_prefixes = settings.mock_data or not indexed_data
    prefixes, missing = ([], []) if no_prefixes else _blend_prefixes(settings, args)
    for prefix in prefixes:
        if _is_local(prefix):
            missing += [path for path in (f"{prefix}.bin", f"{prefix}.idx") if not os.path.isfile(path)]
    tokenizer_files = [settings.vocab_file, settings.merge_file]
    tokenizer_type, tokenizer_model = settings.tokenizer_type, settings.tokenizer_model
    if tokenizer_type in _TOKENIZER_MODEL_FILES or (
        tokenizer_type == "HuggingFaceTokenizer" and tokenizer_model and is_explicitly_local(tokenizer_model)
    ):
        tokenizer_files.append(tokenizer_model)
    missing += [path for path in tokenizer_files if path and _is_local(path) and not os.path.exists(path)]
    return missing


def dataset_config(settings: RunSettings, args: Any) -> Any:
    """Megatron's ``GPTDatasetConfig`` from the run's settings, mock or real (the blend read from ``args``,
    Megatron's parsed args the settings were read from)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.global_vars import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = (None, None) if settings.mock_data else get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=settings.seed,
        sequence_length=settings.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=settings.split,
        path_to_cache=settings.data_cache_path,
        mmap_bin_files=settings.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=settings.reset_position_ids,
        reset_attention_mask=settings.reset_attention_mask,
        eod_mask_loss=settings.eod_mask_loss,
        create_attention_mask=settings.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=settings.mid_level_dataset_surplus,
        inter_document_masking=settings.inter_document_masking,
    )


def build_datasets(
    train_val_test_num_samples: Sequence[int], vp_stage: int | None = None, *, settings: RunSettings, args: Any
):
    """Megatron's dataset provider: train, validation and test datasets from mock or indexed data."""
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training.utils import is_first_or_last_pipeline_stage

    def built_on_this_rank() -> bool:
        return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0

    dataset_type = MockGPTDataset if settings.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, built_on_this_rank, dataset_config(settings, args)
    ).build()
