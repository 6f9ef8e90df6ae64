"""Tests for the data path on CPU: real indexed datasets written with megatron-core
(``data.synthetic``), the files a run's flags name (``data.sources.missing_files``), Megatron's
``GPTDataset`` with inter-document masking, its documents unpacked as Megatron's hybrid-CP loader
does and packed per CP rank (``banks.hybrid_cp_batch``), and the host-side THD split
(``packed.layout.partitioned_indices``)."""

from __future__ import annotations

import importlib
import itertools
import json
import os
from pathlib import Path

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin import cli, host_stand_ins
from megatron_cg_plugin.banks import hybrid_cp_batch
from megatron_cg_plugin.data import sources
from megatron_cg_plugin.data.synthetic import synthetic_documents, write_indexed_dataset
from megatron_cg_plugin.launch.pretrain_gpt import parse_megatron_args
from megatron_cg_plugin.packed.layout import ThdCapacityError, fixed_capacity_layout, partitioned_indices
from megatron_cg_plugin.settings import read_settings

IndexedDataset = importlib.import_module("megatron.core.datasets.indexed_dataset").IndexedDataset
global_vars = importlib.import_module("megatron.training.global_vars")
microbatches = importlib.import_module("megatron.core.num_microbatches_calculator")

VOCAB = 1024
EOD = VOCAB - 1  # NullTokenizer's EOD: the last id
GPT = ["--cg-preset", "tiny-gpt"]


@pytest.fixture(autouse=True)
def clean_process(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    global_vars.unset_global_variables()
    yield
    global_vars.unset_global_variables()
    microbatches.unset_num_microbatches_calculator()


@pytest.fixture(scope="module")
def documents() -> list[list[int]]:
    return synthetic_documents(60, vocab_size=VOCAB, seed=7, min_length=40, max_length=420)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory, documents) -> str:
    return str(write_indexed_dataset(tmp_path_factory.mktemp("data") / "text_document", documents, eod=EOD))


def parsed(*flags: str):
    return parse_megatron_args(list(flags), validate=False)


def missing_files(args, *, indexed_data: bool) -> list[str]:
    """``sources.missing_files`` on the settings read from ``args`` (the args for Megatron's blend parser)."""
    return sources.missing_files(read_settings(args)[0], args, indexed_data=indexed_data)


# -- data.synthetic --------------------------------------------------------------------------------


def test_written_dataset_reads_back_with_megatrons_indexed_dataset(prefix, documents):
    assert os.path.isfile(f"{prefix}.bin") and os.path.isfile(f"{prefix}.idx")
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(documents)
    for index, document in enumerate(documents):
        stored = dataset[index]
        assert stored.dtype == numpy.int32
        assert stored.tolist() == [*document, EOD]  # each document ends in the EOD id
    assert dataset.sequence_lengths.tolist() == [len(document) + 1 for document in documents]
    assert dataset.document_indices.tolist() == list(range(len(documents) + 1))


def test_written_dataset_other_dtype(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "small", [[1, 2, 3], [4]], eod=9, dtype="uint16")
    dataset = IndexedDataset(str(prefix))
    assert dataset[0].dtype == numpy.uint16
    assert [dataset[i].tolist() for i in range(2)] == [[1, 2, 3, 9], [4, 9]]


def test_write_indexed_dataset_refuses_no_documents(tmp_path):
    with pytest.raises(ValueError, match="at least one document"):
        write_indexed_dataset(tmp_path / "empty", [], eod=1)


def test_synthetic_documents_are_seeded_and_leave_the_eod_id_out():
    first = synthetic_documents(30, vocab_size=64, seed=11, min_length=3, max_length=9)
    assert first == synthetic_documents(30, vocab_size=64, seed=11, min_length=3, max_length=9)
    assert first != synthetic_documents(30, vocab_size=64, seed=12, min_length=3, max_length=9)
    assert all(3 <= len(document) <= 9 for document in first)
    tokens = {token for document in first for token in document}
    assert tokens <= set(range(63)) and 63 not in tokens


# -- sources.missing_files -------------------------------------------------------------------------


def test_mock_data_names_no_files():
    args = parsed(*GPT)
    assert args.mock_data
    assert missing_files(args, indexed_data=True) == []


def test_existing_prefix_is_not_missing(prefix):
    args = parsed(*GPT, "--data-path", prefix)
    assert not args.mock_data  # the user's data replaces the preset's mock data
    assert missing_files(args, indexed_data=True) == []


def test_missing_prefix_names_both_files(tmp_path):
    missing = tmp_path / "gone"
    assert missing_files(parsed(*GPT, "--data-path", str(missing)), indexed_data=True) == [
        f"{missing}.bin",
        f"{missing}.idx",
    ]


def test_blend_with_weights_names_only_the_missing_prefix(prefix, tmp_path):
    missing = str(tmp_path / "B")
    args = parsed(*GPT, "--data-path", "0.5", prefix, "0.5", missing)
    assert missing_files(args, indexed_data=True) == [f"{missing}.bin", f"{missing}.idx"]


def test_half_written_dataset_names_the_missing_half(prefix, tmp_path):
    half = tmp_path / "half"
    (tmp_path / "half.bin").write_bytes(Path(f"{prefix}.bin").read_bytes())
    assert missing_files(parsed(*GPT, "--data-path", str(half)), indexed_data=True) == [f"{half}.idx"]


def test_per_split_paths_are_each_checked(prefix, tmp_path):
    valid, test = str(tmp_path / "valid"), str(tmp_path / "test")
    args = parsed(*GPT, "--train-data-path", prefix, "--valid-data-path", valid, "--test-data-path", test)
    assert not args.mock_data
    assert missing_files(args, indexed_data=True) == [
        f"{valid}.bin",
        f"{valid}.idx",
        f"{test}.bin",
        f"{test}.idx",
    ]
    assert missing_files(parsed(*GPT, "--train-data-path", prefix), indexed_data=True) == []


def test_data_args_file_missing_is_named(tmp_path):
    args_file = str(tmp_path / "data_args.txt")
    assert missing_files(parsed(*GPT, "--data-args-path", args_file), indexed_data=True) == [args_file]


def test_data_args_file_is_read_for_its_prefixes(prefix, tmp_path):
    args_file = tmp_path / "data_args.txt"
    missing = str(tmp_path / "elsewhere")
    args_file.write_text(f"0.7 {prefix}\n0.3 {missing}\n")
    assert missing_files(parsed(*GPT, "--data-args-path", str(args_file)), indexed_data=True) == [
        f"{missing}.bin",
        f"{missing}.idx",
    ]


def test_per_split_data_args_file(prefix, tmp_path):
    args_file = tmp_path / "splits.json"
    missing = str(tmp_path / "valid_gone")
    args_file.write_text(json.dumps({"train": prefix, "valid": f"1.0 {missing}", "test": prefix}))
    assert missing_files(parsed(*GPT, "--per-split-data-args-path", str(args_file)), indexed_data=True) == [
        f"{missing}.bin",
        f"{missing}.idx",
    ]
    absent = str(tmp_path / "no_splits.json")
    assert missing_files(parsed(*GPT, "--per-split-data-args-path", absent), indexed_data=True) == [absent]


def test_sentencepiece_model_missing_is_named(prefix, tmp_path):
    model = str(tmp_path / "spm.model")
    args = parsed(*GPT, "--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model)
    assert missing_files(args, indexed_data=True) == [model]
    open(model, "wb").close()
    assert missing_files(args, indexed_data=True) == []


def test_vocab_and_merge_files_missing_are_named(prefix, tmp_path):
    vocab, merges = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    args = parsed(
        *GPT,
        "--data-path",
        prefix,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
    )
    assert missing_files(args, indexed_data=True) == [vocab, merges]


def test_huggingface_hub_name_is_not_a_file(prefix):
    args = parsed(*GPT, "--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2")
    assert missing_files(args, indexed_data=True) == []


def test_object_store_prefixes_are_skipped(tmp_path):
    missing = str(tmp_path / "local_gone")
    args = parsed(
        *GPT,
        "--data-path",
        "0.5",
        "msc://bucket/tokens",
        "0.5",
        missing,
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        "msc://bucket/spm.model",
    )
    assert missing_files(args, indexed_data=True) == [f"{missing}.bin", f"{missing}.idx"]


@pytest.mark.parametrize("flag", ["--data-args-path", "--per-split-data-args-path"])
def test_object_store_argument_files_are_skipped(flag):
    assert missing_files(parsed(*GPT, flag, "msc://bucket/args.txt"), indexed_data=True) == []


def test_mock_data_still_checks_the_tokenizer_model(tmp_path):
    model = str(tmp_path / "spm.model")
    args = parsed(*GPT, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model)
    assert args.mock_data
    assert missing_files(args, indexed_data=True) == [model]


def test_check_with_a_real_prefix_passes(prefix, capsys):
    code = cli.main(["check", *GPT, "--data-path", prefix])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("flags OK\n")


def test_check_with_a_missing_prefix_names_the_bin_file(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "tokens"
    code = cli.main(["check", *GPT, "--data-path", str(missing)])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert "[data-files]" in err
    assert f"{missing}.bin" in err and f"{missing}.idx" in err


# -- GPTDataset with inter-document masking, unpacked and packed for hybrid CP -----------------------

SEQ = 512
TOKENS_PER_RANK = 256
MAX_SEQS = 8


class StandInGroup:
    """A CP process group as far as the pack looks at it."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.fixture
def gpt_dataset(prefix, monkeypatch):
    """Megatron's GPTDataset over the written data, with the config the launcher builds."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with host_stand_ins.gpu_host_stand_ins():  # validate_args asks for the device; sets Megatron's global tokenizer
        args = parse_megatron_args(
            [
                *GPT,
                "--seq-length",
                str(SEQ),
                "--max-position-embeddings",
                str(SEQ),
                "--data-path",
                prefix,
                "--dataloader-inter-document-masking",
                "--data-cache-path",
                os.path.join(os.path.dirname(prefix), "cache"),
            ]
        )
    config = sources.dataset_config(read_settings(args)[0], args)
    assert config.inter_document_masking and config.sequence_length == SEQ
    assert config.tokenizer.eod == EOD
    train, _valid, _test = BlendedMegatronDatasetBuilder(GPTDataset, [12, 0, 0], lambda: True, config).build()
    assert isinstance(train, GPTDataset)
    return train


def unpack(sample):
    """Megatron's hybrid-CP loader splitting a sample into its documents (it does not touch self)."""
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper

    return HybridCPDataLoaderWrapper.unpack_batch(None, [sample])


def test_inter_document_masking_marks_eod_boundaries(gpt_dataset):
    for index in range(4):
        sample = gpt_dataset[index]
        assert sample["tokens"].shape == (SEQ,)
        cu = sample["cu_seqlens"].tolist()
        ends = sorted(set(cu))
        assert ends[0] == 0 and ends[-1] == SEQ
        eods = (sample["tokens"] == EOD).nonzero().flatten().tolist()
        assert eods, "every 512-token sample of <= 421-token documents holds an EOD"
        assert {eod + 1 for eod in eods} <= set(ends)  # a document ends right after each EOD
        for start, end in itertools.pairwise(ends):
            assert sample["position_ids"][start:end].tolist() == list(range(end - start))


def test_unpacked_documents_cover_the_sample(gpt_dataset):
    sample = gpt_dataset[0]
    documents = unpack(sample)
    assert len(documents) >= 2
    assert torch.equal(torch.cat([document["tokens"] for document in documents]), sample["tokens"])
    for document in documents:
        assert set(document) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert document["tokens"].dim() == 1
        assert (document["tokens"][:-1] != EOD).all()  # EOD only at a document's end


def hybrid_documents(gpt_dataset, samples: int = 6) -> list[dict]:
    return [document for index in range(samples) for document in unpack(gpt_dataset[index])]


def padded_pack(values: torch.Tensor, tokens: int) -> torch.Tensor:
    pack = torch.zeros(tokens, dtype=values.dtype)
    pack[: values.numel()] = values
    return pack


def te_share(pack: torch.Tensor, cu_padded: list[int], cp: int, rank: int) -> torch.Tensor:
    """TE's THD split of ``pack`` (written independently of packed.layout): each sequence in 2 x cp
    equal chunks, this rank keeps chunks ``rank`` and ``2 cp - 1 - rank``."""
    pieces = []
    for start, end in itertools.pairwise(cu_padded):
        if end > start:
            chunks = pack[start:end].chunk(2 * cp)
            assert len(chunks) == 2 * cp
            pieces += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(pieces)


def check_packed_seq_params(packed, length: int, cp: int, group) -> None:
    tokens = cp * TOKENS_PER_RANK
    padded = -(-length // (2 * cp)) * 2 * cp
    assert packed.qkv_format == "thd"
    assert packed.cu_seqlens_q.dtype == torch.int32
    assert packed.cu_seqlens_q.tolist() == [0, length] + [length] * MAX_SEQS
    assert packed.cu_seqlens_q_padded.tolist() == [0, padded] + [tokens] * MAX_SEQS
    assert torch.equal(packed.cu_seqlens_kv, packed.cu_seqlens_q)
    assert torch.equal(packed.cu_seqlens_kv_padded, packed.cu_seqlens_q_padded)
    assert packed.max_seqlen_q == packed.max_seqlen_kv == tokens
    assert packed.local_cp_size == cp
    assert packed.cp_group is (group if cp > 1 else None)


def test_documents_pack_whole_on_cp_1(gpt_dataset):
    group = StandInGroup(1)
    short = [document for document in hybrid_documents(gpt_dataset) if document["tokens"].numel() <= TOKENS_PER_RANK]
    assert len(short) >= 3
    for document in short:
        length = document["tokens"].numel()
        batch, packed = hybrid_cp_batch.pack_hybrid_cp_sample(
            {**document, "local_cp_size": 1},
            tokens_per_rank=TOKENS_PER_RANK,
            max_seqs=MAX_SEQS,
            group=group,
            rank=0,
            device="cpu",
        )
        assert batch["attention_mask"] is None
        for key in hybrid_cp_batch.SAMPLE_KEYS:
            assert batch[key].shape == (1, TOKENS_PER_RANK)
            assert batch[key].dtype == document[key].dtype
            assert torch.equal(batch[key][0], padded_pack(document[key], TOKENS_PER_RANK)), key
        assert batch["loss_mask"][0, length:].sum() == 0  # padding never trains
        check_packed_seq_params(packed, length, 1, group)


def test_documents_split_over_two_cp_ranks(gpt_dataset):
    cp, group = 2, StandInGroup(2)
    documents = hybrid_documents(gpt_dataset)
    assert any(document["tokens"].numel() > TOKENS_PER_RANK for document in documents)  # needs CP 2
    for document in documents:
        length = document["tokens"].numel()
        probe = {**document, "tokens": torch.arange(1, length + 1), "local_cp_size": cp}  # token = position + 1
        shares, probes = [], []
        for rank in range(cp):
            batch, packed = hybrid_cp_batch.pack_hybrid_cp_sample(
                {**document, "local_cp_size": cp},
                tokens_per_rank=TOKENS_PER_RANK,
                max_seqs=MAX_SEQS,
                group=group,
                rank=rank,
                device="cpu",
            )
            check_packed_seq_params(packed, length, cp, group)
            cu_padded = packed.cu_seqlens_q_padded.tolist()
            for key in hybrid_cp_batch.SAMPLE_KEYS:
                assert batch[key].shape == (1, TOKENS_PER_RANK)
                expected = te_share(padded_pack(document[key], cp * TOKENS_PER_RANK), cu_padded, cp, rank)
                assert torch.equal(batch[key][0], expected), (key, rank)
            shares.append(batch["tokens"][0])
            probe_batch, _ = hybrid_cp_batch.pack_hybrid_cp_sample(
                probe, tokens_per_rank=TOKENS_PER_RANK, max_seqs=MAX_SEQS, group=group, rank=rank, device="cpu"
            )
            probes.append(probe_batch["tokens"][0])
        # Together the two ranks hold exactly the padded pack: each of its positions once ...
        positions = torch.cat([te_share(torch.arange(cp * TOKENS_PER_RANK), cu_padded, cp, rank) for rank in range(cp)])
        assert sorted(positions.tolist()) == list(range(cp * TOKENS_PER_RANK))
        # ... every real token once, the rest padding.
        together = torch.cat(probes)
        assert together.numel() == cp * TOKENS_PER_RANK
        assert sorted(together[together > 0].tolist()) == list(range(1, length + 1))
        assert int((together == 0).sum()) == cp * TOKENS_PER_RANK - length
        assert torch.equal(
            torch.sort(torch.cat(shares)).values,
            torch.sort(padded_pack(document["tokens"], cp * TOKENS_PER_RANK)).values,
        )


def test_a_document_too_long_for_its_cp_size_names_the_flag(gpt_dataset):
    long = next(document for document in hybrid_documents(gpt_dataset) if document["tokens"].numel() > TOKENS_PER_RANK)
    with pytest.raises(ThdCapacityError, match="--max-seqlen-per-dp-cp-rank"):
        hybrid_cp_batch.pack_hybrid_cp_sample(
            {**long, "local_cp_size": 1}, tokens_per_rank=TOKENS_PER_RANK, max_seqs=MAX_SEQS, device="cpu"
        )


def test_a_sample_without_local_cp_size_names_what_is_missing():
    sample = {key: torch.zeros(4, dtype=torch.long) for key in hybrid_cp_batch.SAMPLE_KEYS}
    with pytest.raises(KeyError, match="local_cp_size") as info:
        hybrid_cp_batch.pack_hybrid_cp_sample(sample, tokens_per_rank=8, max_seqs=2, device="cpu")
    assert "--dataloader-inter-document-masking" in str(info.value)
    del sample["labels"]
    with pytest.raises(KeyError, match="'labels', 'local_cp_size'"):
        hybrid_cp_batch.pack_hybrid_cp_sample(sample, tokens_per_rank=8, max_seqs=2, device="cpu")


def test_pack_keeps_the_samples_device_when_none_is_given():
    sample = {key: torch.arange(1, 6) for key in hybrid_cp_batch.SAMPLE_KEYS} | {"local_cp_size": torch.tensor(1)}
    batch, packed = hybrid_cp_batch.pack_hybrid_cp_sample(sample, tokens_per_rank=8, max_seqs=2)
    assert batch["tokens"].device.type == "cpu"
    assert batch["tokens"][0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert packed.local_cp_size == 1


# -- packed.layout.partitioned_indices -------------------------------------------------------------


@pytest.mark.parametrize(
    "cu_padded, cp, rank, expected",
    [
        ((0, 8), 2, 0, [0, 1, 6, 7]),
        ((0, 8), 2, 1, [2, 3, 4, 5]),
        ((0, 4, 6), 1, 0, [0, 1, 2, 3, 4, 5]),
        ((0, 16), 4, 1, [2, 3, 12, 13]),
        ((0, 4, 12), 2, 1, [1, 2, 6, 7, 8, 9]),
        ((0, 8, 8, 8), 2, 0, [0, 1, 6, 7]),  # zero-length trailing sequences contribute nothing
        ((0,), 2, 1, []),
        ((), 1, 0, []),
    ],
)
def test_partitioned_indices_examples(cu_padded, cp, rank, expected):
    assert partitioned_indices(cu_padded, cp, rank) == expected


@pytest.mark.parametrize(
    "cu_padded, cp, rank, match",
    [
        ((0, 8), 3, 0, "power of two"),
        ((0, 8), 0, 0, "power of two"),
        ((0, 8), 2, 2, "0 <= rank < size"),
        ((0, 8), 2, -1, "0 <= rank < size"),
        ((0, 6), 2, 0, "multiple of 4"),
        ((0, 4, 7), 1, 0, "multiple of 2"),
    ],
)
def test_partitioned_indices_bad_inputs(cu_padded, cp, rank, match):
    with pytest.raises(ValueError, match=match):
        partitioned_indices(cu_padded, cp, rank)


def test_partitioned_indices_refuses_decreasing_offsets():
    with pytest.raises(ValueError):
        partitioned_indices((0, 8, 4), 2, 0)


def test_partitioned_indices_split_the_fixed_capacity_layout():
    layout = fixed_capacity_layout([5, 30, 1], 4, 32, 6)  # padded 8, 32, 8 and the dummy to 128
    shares = [partitioned_indices(layout.cu_seqlens_padded, 4, rank) for rank in range(4)]
    assert all(len(share) == 32 for share in shares)
    assert sorted(index for share in shares for index in share) == list(range(128))


@st.composite
def padded_packs(draw):
    cp = draw(st.sampled_from([1, 2, 4, 8]))
    lengths = draw(st.lists(st.integers(0, 6).map(lambda n: n * 2 * cp), max_size=8))
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return cp, lengths, offsets


@settings(max_examples=200, deadline=None)
@given(padded_packs())
def test_partitioned_indices_properties(case):
    cp, lengths, offsets = case
    total = offsets[-1]
    shares = [partitioned_indices(offsets, cp, rank) for rank in range(cp)]
    seen: set[int] = set()
    for rank, share in enumerate(shares):
        assert len(share) == total // cp
        assert seen.isdisjoint(share)
        seen.update(share)
        # Sequence by sequence: two contiguous chunks, at chunk positions rank and 2cp-1-rank.
        cursor = 0
        for start, length in zip(offsets, lengths):
            chunk = length // (2 * cp)
            mine = share[cursor : cursor + 2 * chunk]
            cursor += 2 * chunk
            first = list(range(start + rank * chunk, start + (rank + 1) * chunk))
            second = list(range(start + (2 * cp - 1 - rank) * chunk, start + (2 * cp - rank) * chunk))
            assert mine == first + second
        assert cursor == len(share)
    assert seen == set(range(total))


def test_a_scripts_own_data_path_is_not_held_to_indexed_files(tmp_path):
    # megatron-cg run / install(): a script's loader may read --data-path as jsonl (--sft) or anything
    # else; only its tokenizer files are checked. The launcher's GPTDataset needs .bin and .idx.
    args = parsed(
        *GPT,
        "--sft",
        "--data-path",
        str(tmp_path / "train.jsonl"),
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "no.model"),
    )
    assert missing_files(args, indexed_data=False) == [str(tmp_path / "no.model")]
    assert missing_files(args, indexed_data=True)[:2] == [
        f"{tmp_path / 'train.jsonl'}.bin",
        f"{tmp_path / 'train.jsonl'}.idx",
    ]


def test_malformed_data_arguments_are_named_not_raised(tmp_path):
    split_file = tmp_path / "split.json"
    split_file.write_text('{"train": "a", "valid": "b"}')  # no "test"
    (problem,) = missing_files(parsed(*GPT, "--per-split-data-args-path", str(split_file)), indexed_data=True)
    assert str(split_file) in problem and "KeyError" in problem


def test_the_sft_dataset_is_what_megatrons_sft_path_reads(tmp_path):
    """``SFTDataset`` reads one packed sample per jsonl line ("messages": conversations, each from a system
    message), ``SFTTokenizer`` a HuggingFace folder with the nemotron-h-aligned tokens; same seed, same bytes."""
    import json

    from megatron_cg_plugin.data import synthetic
    from megatron_cg_plugin.farm import runner

    dataset, tokenizer = synthetic.write_sft_dataset(
        tmp_path / "a", samples=5, seed=3, min_conversations=4, max_conversations=6
    )
    again, _ = synthetic.write_sft_dataset(tmp_path / "b", samples=5, seed=3, min_conversations=4, max_conversations=6)
    assert dataset.read_bytes() == again.read_bytes()
    lines = [json.loads(line) for line in dataset.read_text().splitlines()]
    assert len(lines) == 5
    for line in lines:
        roles = [message["role"] for message in line["messages"]]
        starts = [index for index, role in enumerate(roles) if role == "system"]
        assert starts[0] == 0 and 4 <= len(starts) <= 6  # conversations: Megatron splits them at system messages
        assert all(message["content"] for message in line["messages"])  # an empty assistant turn is refused there
    model = json.loads((tokenizer / "tokenizer.json").read_text())
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    assert {token["content"] for token in model["added_tokens"]} == set(synthetic.SFT_SPECIAL)
    assert {"<SPECIAL_10>", "<SPECIAL_11>", "System", "User", "Assistant"} <= set(model["model"]["vocab"])
    assert (config["eos_token"], config["pad_token"]) == ("<eos>", "<SPECIAL_233>")
    flags = runner.data_flags("sft", tmp_path / "farm")
    assert flags[flags.index("--tokenizer-type") + 1] == "SFTTokenizer"
    assert flags[flags.index("--sft-tokenizer-prompt-format") + 1] == synthetic.SFT_PROMPT_FORMAT
    assert runner.data_flags("sft", tmp_path / "farm") == flags  # built once


@pytest.mark.parametrize("masking", [False, True])
def test_the_launchers_batch_spec_comes_from_the_runs_settings(masking):
    """The launcher's data path reads the settings the rules passed, not Megatron's args again:
    --dataloader-inter-document-masking packs its microbatches (RunSettings.packed; --sft, which packs
    too, the launcher refuses: rule packed-launcher-sft)."""
    from megatron_cg_plugin.config import PluginConfig
    from megatron_cg_plugin.launch import pretrain_gpt
    from megatron_cg_plugin.rules import RULES
    from megatron_cg_plugin.session import RunSession
    from megatron_cg_plugin.settings import RunSettings

    session = RunSession(PluginConfig(thd_max_seqs=5))
    session.settings = RunSettings(
        micro_batch_size=2,
        seq_length=4096,
        context_parallel=2,
        pipeline_parallel=4,
        max_seqlen_per_dp_cp_rank=1024,
        inter_document_masking=masking,
        create_attention_mask_in_dataloader=not masking,
    )
    spec = pretrain_gpt._batch_spec(session)
    assert (spec.micro_batch_size, spec.seq_length, spec.context_parallel_size) == (2, 4096, 2)
    assert (spec.pipeline_model_parallel_size, spec.tokens_per_rank, spec.thd_max_seqs) == (4, 1024, 5)
    assert spec.create_attention_mask is not masking and not spec.hybrid_context_parallel
    assert spec.packed is masking
    (sft_rule,) = [rule for rule in RULES if rule.name == "packed-launcher-sft"]
    assert sft_rule.violated(RunSettings(launcher=True, sft=True))  # the one other way to pack never gets here
