"""Small real Megatron datasets, built on the spot: nothing is downloaded.

``write_indexed_dataset`` writes documents of token ids with megatron-core's own
``IndexedDatasetBuilder`` (the ``.bin``/``.idx`` pair ``--data-path PREFIX`` reads), each document
ending in the tokenizer's EOD id, as Megatron's ``preprocess_data.py --append-eod`` does.
``synthetic_documents`` makes seeded token documents for ``--tokenizer-type NullTokenizer``
(pre-tokenized data: the same bytes on every machine, so golden values hold);
``train_sentencepiece`` and ``tokenize_corpus`` give a ``--tokenizer-type SentencePieceTokenizer``
run real text. ``write_sft_dataset`` writes what Megatron's ``--sft`` path reads (``SFTDataset``: a
jsonl file, one packed sample per line, each a list of system/user/assistant messages, several
conversations per line; ``SFTTokenizer``: a HuggingFace tokenizer folder, here a word-level one
written as plain JSON, and the ``nemotron-h-aligned`` prompt format, whose special tokens it holds).
Reading them needs ``transformers`` and ``datasets`` (Megatron's imports), writing them nothing.
``python -m megatron_cg_plugin.data.synthetic OUT_DIR`` writes all three kinds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from megatron_cg_plugin import console

__all__ = [
    "SFT_PROMPT_FORMAT",
    "SFT_SPECIAL",
    "sft_flags",
    "synthetic_corpus",
    "synthetic_documents",
    "tokenize_corpus",
    "train_sentencepiece",
    "write_indexed_dataset",
    "write_sft_dataset",
]

_WORDS = (
    "graph",
    "replay",
    "capture",
    "memory",
    "pool",
    "layer",
    "token",
    "expert",
    "router",
    "stream",
    "kernel",
    "tensor",
    "gradient",
    "optimizer",
    "batch",
    "sequence",
    "attention",
    "rank",
    "bank",
    "arena",
    "offload",
    "scale",
    "the",
    "a",
    "of",
    "and",
    "in",
    "to",
    "is",
    "with",
    "each",
    "every",
)


def write_indexed_dataset(
    prefix: str | Path, documents: Iterable[Sequence[int]], *, eod: int, dtype: str = "int32"
) -> Path:
    """Writes ``PREFIX.bin`` and ``PREFIX.idx`` holding ``documents`` (each followed by ``eod``)."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=getattr(numpy, dtype))
    count = 0
    for document in documents:
        builder.add_document(torch.tensor([*document, eod], dtype=torch.int64), [len(document) + 1])
        count += 1
    if not count:
        raise ValueError("write_indexed_dataset needs at least one document.")
    builder.finalize(f"{prefix}.idx")
    return prefix


def synthetic_documents(
    count: int, *, vocab_size: int, seed: int, min_length: int = 16, max_length: int = 600
) -> list[list[int]]:
    """Seeded documents of token ids in ``[0, vocab_size - 1)`` (the last id is NullTokenizer's EOD)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size - 1) for _ in range(rng.randint(min_length, max_length))] for _ in range(count)]


def synthetic_corpus(count: int, *, seed: int, min_words: int = 8, max_words: int = 300) -> list[str]:
    """Seeded text documents of English-looking words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))) + "." for _ in range(count)]


def train_sentencepiece(corpus: Sequence[str], model_prefix: str | Path, *, vocab_size: int = 256) -> Path:
    """A SentencePiece model trained on ``corpus``: ``MODEL_PREFIX.model`` (one thread, reproducible)."""
    import sentencepiece

    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        num_threads=1,
        bos_id=-1,
        eos_id=1,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    return model_prefix.with_suffix(".model")


def tokenize_corpus(corpus: Iterable[str], model: str | Path) -> tuple[list[list[int]], int]:
    """The corpus as token ids, and the model's EOD (end of sentence) id."""
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    return [processor.encode(text) for text in corpus], processor.eos_id()


# What Megatron's nemotron-h-aligned chat template writes around the messages, and its pad token.
SFT_SPECIAL = ("<unk>", "<eos>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>")
_SFT_ROLE_WORDS = ("System", "User", "Assistant")
SFT_PROMPT_FORMAT = "nemotron-h-aligned"


def _sft_conversations(
    count: int, *, seed: int, min_turns: int = 1, max_turns: int = 3, max_words: int = 40
) -> list[list[dict[str, str]]]:
    """Seeded conversations (a system message, then user/assistant turns) of ``_WORDS``."""
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max_words)))

    conversations = []
    for _ in range(count):
        messages = [{"role": "system", "content": text()}]
        for _ in range(rng.randint(min_turns, max_turns)):
            messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        conversations.append(messages)
    return conversations


def _write_sft_tokenizer(folder: str | Path) -> Path:
    """A HuggingFace tokenizer folder for ``--tokenizer-type SFTTokenizer``: a word-level model over
    ``_WORDS``, the role words and ``SFT_SPECIAL`` (special tokens, split out before the words), end of
    document ``<eos>``. Written as JSON: nothing is trained or downloaded."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {token: index for index, token in enumerate((*SFT_SPECIAL, *_SFT_ROLE_WORDS, *_WORDS))}
    special = [
        {
            "id": vocab[token],
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token in SFT_SPECIAL
    ]
    model = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(model))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "unk_token": "<unk>",
                "pad_token": "<SPECIAL_233>",
                "model_max_length": 1 << 30,
            }
        )
    )
    return folder


def write_sft_dataset(
    folder: str | Path, *, samples: int, seed: int, min_conversations: int = 60, max_conversations: int = 80
) -> tuple[Path, Path]:
    """``FOLDER/sft.jsonl`` (``samples`` lines, each ``min_conversations`` to ``max_conversations``
    seeded conversations: Megatron packs one line into one sample) and the tokenizer folder
    ``FOLDER/sft_tokenizer``. The default lines hold more than a 4096-token sample (Megatron truncates
    the last conversation), so no sample ends in a padding segment as long as the sample: at
    seq 4096, at most 43 conversations a sample and none longer than 237 tokens."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    path = folder / "sft.jsonl"
    with path.open("w") as out:
        for index in range(samples):
            conversations = _sft_conversations(
                rng.randint(min_conversations, max_conversations), seed=seed * 7919 + index
            )
            out.write(json.dumps({"messages": [message for conversation in conversations for message in conversation]}))
            out.write("\n")
    return path, _write_sft_tokenizer(folder / "sft_tokenizer")


def sft_flags(dataset: Path, tokenizer: Path) -> tuple[str, ...]:
    """The data and tokenizer flags of a ``--sft`` run on ``write_sft_dataset``'s files."""
    return (
        "--data-path",
        str(dataset),
        "--tokenizer-type",
        "SFTTokenizer",
        "--tokenizer-model",
        str(tokenizer),
        "--sft-tokenizer-prompt-format",
        SFT_PROMPT_FORMAT,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_cg_plugin.data.synthetic",
        description="Write small real Megatron datasets (nothing is downloaded).",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--vocab-size", type=int, default=1024, help="NullTokenizer dataset: --vocab-size of the run")
    parser.add_argument(
        "--max-document-length",
        type=int,
        default=600,
        help="NullTokenizer dataset: the longest document in tokens (from 16; shorter: more per sample)",
    )
    parser.add_argument("--seed", type=int, default=1234)
    options = parser.parse_args(argv)
    tokens = write_indexed_dataset(
        options.out_dir / "synthetic_text_document",
        synthetic_documents(
            options.documents, vocab_size=options.vocab_size, seed=options.seed, max_length=options.max_document_length
        ),
        eod=options.vocab_size - 1,
    )
    print(f"NullTokenizer data: --data-path {tokens} --tokenizer-type NullTokenizer --vocab-size {options.vocab_size}")
    corpus = synthetic_corpus(options.documents, seed=options.seed)
    model = train_sentencepiece(corpus, options.out_dir / "spm")
    documents, eod = tokenize_corpus(corpus, model)
    text = write_indexed_dataset(options.out_dir / "spm_text_document", documents, eod=eod)
    print(f"SentencePiece data: --data-path {text} --tokenizer-type SentencePieceTokenizer --tokenizer-model {model}")
    dataset, tokenizer = write_sft_dataset(options.out_dir, samples=options.documents, seed=options.seed)
    print(f"SFT data: --sft --no-create-attention-mask-in-dataloader {' '.join(sft_flags(dataset, tokenizer))}")
    return 0


if __name__ == "__main__":
    console.hide_optional_package_warnings()
    sys.exit(main())
