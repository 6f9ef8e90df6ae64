"""Every farm case that trains on an indexed dataset the farm builds has the samples its run asks for: Megatron's
own dataset builder (BlendedMegatronDatasetBuilder with a GPTDatasetConfig of the case's flags) on the farm's
files. A split Megatron builds with no sample stops the run before its first step (seen on the GPU: the document-masking
cases at seq 4096 got a 2% validation split of ~2,600 tokens, 'no sample to consume: 0' in
MegatronPretrainingSampler for the validation loader, although --eval-iters 0 never reads it)."""

from __future__ import annotations

import pytest

from megatron_cg_plugin.farm import runner
from megatron_cg_plugin.launch.presets import expand_preset, flag_value

INDEXED = ("synthetic", "sentencepiece")  # the data kinds written as Megatron indexed datasets
CASES = [case for case in runner.CASES if case.data in INDEXED]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("farm")  # one folder: each data kind is built once, as in a farm run


def _megatron_datasets(flags: list[str], num_samples: list[int], cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = GPTDatasetConfig(
        random_seed=int(flag_value(flags, "--seed")),
        sequence_length=int(flag_value(flags, "--seq-length")),
        blend=([flag_value(flags, "--data-path")], None),
        split=flag_value(flags, "--split"),
        # Sample counts come from the index alone; the tokenizer only names EOD and pad.
        tokenizer=NullTokenizer(1024),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache),
        inter_document_masking="--dataloader-inter-document-masking" in flags,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, num_samples, lambda: True, config).build()


def test_the_packed_cases_are_among_those_checked():
    names = {case.name for case in CASES}
    assert {
        "gpt_4x2048_docmask_layer_megatron_lm",
        "gpt_4x2048_docmask_attn_megatron_lm",
        "gpt_4x2048_docmask_cp2_layer_megatron_lm",
    } <= names


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_megatron_builds_enough_samples_for_the_farm_run(case, out_dir):
    if case.data == "sentencepiece":
        pytest.importorskip("sentencepiece")
    flags = expand_preset(case.run_flags(graphed=False, out_dir=out_dir))  # builds the data as the farm run does
    steps, batch = case.steps, int(flag_value(flags, "--global-batch-size"))
    eval_iters, eval_interval = int(flag_value(flags, "--eval-iters")), int(flag_value(flags, "--eval-interval"))
    # Megatron's get_train_valid_test_num_samples for an iteration-based run.
    wanted = [steps * batch, (steps // eval_interval + 1) * eval_iters * batch, eval_iters * batch]
    built = _megatron_datasets(flags, wanted, out_dir / "cache" / case.name)
    for name, dataset, samples in zip(("train", "valid", "test"), built, wanted):
        # A split Megatron builds gets a loader, whose sampler asserts it has a sample (even with --eval-iters 0).
        assert dataset is None or len(dataset) >= max(samples, 1), (
            f"{case.name}: Megatron's {name} split has {len(dataset)} samples of {flag_value(flags, '--seq-length')} "
            f"tokens, the run needs {max(samples, 1)} (split {flag_value(flags, '--split')})"
        )
