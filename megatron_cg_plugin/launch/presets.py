"""Launcher presets: Megatron flag sets for a newcomer's first run, expanded before parsing.

A preset's flags come first and the user's flags after, so anything the user passes wins
(argparse keeps the last value). Presets only describe the model and the run; they never turn
graphs on: that stays the user's ``--cuda-graph-impl transformer_engine`` (a preset may say which
modules the graphs would cover, as ``tiny-moe`` does). With graphs on, ``tiny-gpt`` and ``tiny-moe`` pass
``megatron-cg check`` as given on one rank; ``tiny-gpt-hybrid-cp`` needs 2 or more ranks and
``--cg-graph-banks`` (a test holds each to it).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_cg_plugin.config import PLUGIN_FLAGS, PRESETS

__all__ = [
    "DROPLESS_MOE_SCOPE",
    "MOE_FLAGS",
    "PRESET_FLAGS",
    "expand_preset",
    "find_preset",
    "flag_value",
    "repeated_flags_note",
]

_COMMON = (
    "--num-layers 2 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 4 "
    "--seq-length 256 --max-position-embeddings 256 --position-embedding-type rope "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 30 "
    "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 "
    "--clip-grad 1.0 --bf16 --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --split 100,0,0 "
    "--eval-iters 0 --eval-interval 1000000 --log-interval 1 --log-num-zeros-in-grad "
    "--seed 1234 --transformer-impl transformer_engine --no-gradient-accumulation-fusion "
    "--num-workers 0"
).split()

# Dropless alltoall MoE of 4 experts (top 2).
MOE_FLAGS = tuple(
    "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
    "--moe-grouped-gemm --swiglu --disable-bias-linear --moe-ffn-hidden-size 512".split()
)

# The graph scope Megatron offers a dropless MoE: the token dispatcher's shapes change per step, so
# whole-layer capture needs drop-and-pad, which changes what the model trains.
DROPLESS_MOE_SCOPE = ("--cuda-graph-modules", "attn", "moe_router", "moe_preprocess")

PRESET_FLAGS: dict[str, tuple[str, ...]] = {
    "tiny-gpt": tuple(_COMMON),
    # A dropless MoE, graphed where its shapes are static, so the preset passes the rules as given.
    # For the whole MoE block: --moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity
    # --cuda-graph-modules attn moe.
    "tiny-moe": tuple(_COMMON) + MOE_FLAGS + DROPLESS_MOE_SCOPE,
    # Hybrid (dynamic) context parallelism on 2+ ranks: each document of a 512-token sample runs with
    # CP 1 or 2 (256 tokens per rank), RoPE with each microbatch's CP group. Add
    # --cuda-graph-impl transformer_engine --cg-graph-banks for one graph bank per CP size.
    "tiny-gpt-hybrid-cp": tuple(_COMMON)
    + tuple(
        "--seq-length 512 --max-position-embeddings 512 "
        "--micro-batch-size 1 --global-batch-size 4 --hybrid-context-parallel --max-seqlen-per-dp-cp-rank 256 "
        "--dataloader-type single --calculate-per-token-loss --rerun-mode disabled "
        "--dataloader-inter-document-masking".split()
    ),
}
assert set(PRESET_FLAGS) == set(PRESETS)


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value ``flag`` takes in ``argv`` (``FLAG X`` or ``FLAG=X``; the last one wins, as in
    argparse), None when absent. Raises ValueError for the flag at the end with no value."""
    found = None
    for index, token in enumerate(argv):
        if token == flag:
            if index + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value.")
            found = argv[index + 1]
        elif token.startswith(flag + "="):
            found = token.split("=", 1)[1]
    return found


def find_preset(argv: Sequence[str]) -> str | None:
    """The value of ``--cg-preset`` in ``argv`` (``--cg-preset X`` or ``--cg-preset=X``)."""
    try:
        found = flag_value(argv, "--cg-preset")
    except ValueError:
        raise ValueError(f"--cg-preset needs a value: one of {', '.join(PRESETS)}.") from None
    if found is not None and found not in PRESET_FLAGS:
        raise ValueError(f"--cg-preset {found!r} is unknown; use one of {', '.join(PRESETS)}.")
    return found


def repeated_flags_note(argv: Sequence[str]) -> str | None:
    """A note per ``--cg-*`` flag that ``argv`` gives more than once with different values: only the last
    applies (argparse takes the last value; of two presets, the others' flags do not apply either); None
    when there is none."""
    notes = []
    for flag in (flag.flag for flag in PLUGIN_FLAGS if not flag.switch):
        given = [
            token.split("=", 1)[1] if "=" in token else argv[index + 1]
            for index, token in enumerate(argv)
            if (token == flag and index + 1 < len(argv)) or token.startswith(f"{flag}=")
        ]
        if len(set(given)) > 1:
            notes.append(
                f"note: {flag} is given {len(given)} times ({', '.join(given)}); only the last, {given[-1]}, applies."
            )
    return "\n".join(notes) or None


# Megatron's data-source flags: any of them replaces the preset's mock data (Megatron refuses two sources).
_DATA_SOURCE_FLAGS = (
    "--data-path",
    "--train-data-path",
    "--valid-data-path",
    "--test-data-path",
    "--data-args-path",
    "--per-split-data-args-path",
)


# A preset flag (with its values) that a user's flag of these replaces rather than follows: a later flag
# could not unset --mock-data (Megatron refuses two data sources) or --split (Megatron's dataset config refuses
# it beside per-split data), and Megatron refuses the deprecated --cuda-graph-scope beside --cuda-graph-modules.
_REPLACED_BY = {
    "--mock-data": _DATA_SOURCE_FLAGS,
    "--split": ("--train-data-path", "--valid-data-path", "--test-data-path", "--per-split-data-args-path"),
    "--cuda-graph-modules": ("--cuda-graph-modules", "--cuda-graph-scope"),
}


def _names_any(argv: Sequence[str], flags: Sequence[str]) -> bool:
    return any(token.split("=", 1)[0] in flags for token in argv)


def expand_preset(argv: Sequence[str]) -> list[str]:
    """``argv`` with the preset's flags in front (the user's flags, coming later, override them),
    less the preset's flags that the user's replace (``_REPLACED_BY``)."""
    preset = find_preset(argv)
    if not preset:
        return list(argv)
    flags: list[str] = []
    dropping = False
    for token in PRESET_FLAGS[preset]:
        if token.startswith("--"):
            dropping = token in _REPLACED_BY and _names_any(argv, _REPLACED_BY[token])
        if not dropping:
            flags.append(token)
    return flags + list(argv)
