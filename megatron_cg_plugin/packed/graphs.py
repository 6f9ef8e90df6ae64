"""Packed (THD) microbatches under TE graphs without hybrid CP: ``--dataloader-inter-document-masking``
and ``--sft`` through Megatron's own batch path (docs/packed-sequences.md).

Megatron hands the model a ``PackedSeqParams`` whose ``cu_seqlens`` length and ``max_seqlen`` change
from batch to batch; a graph replays fixed shapes and takes tensors only. With ``--cg-thd-max-seqs N``:

- ``fixed_params`` (patch ``packed-thd-layout``, at ``GPTModel.forward``, in training, eager and
  graphed steps alike): the offsets copied on the device into a new int32 tensor of ``N + 1``
  entries, the rest repeating the last offset (zero-length sequences, ``packed.layout.padded_offsets``),
  ``max_seqlen`` the bound ``--cg-thd-max-seqlen L`` (default ``--seq-length``); a batch of more than
  N documents, or with a document longer than L, is refused (``ThdCapacityError``, naming the flag);
- ``sample_inputs`` (the helper's ``_get_sample_arguments``): Megatron's sample arguments as a packed
  microbatch brings them, with the offsets as the graph input ``THD_KWARG``;
- ``build_capture`` / ``build_replay`` (patches ``packed-graph-capture`` and ``packed-graph-replay``
  of ``TransformerLayer``): the graph input turned back into the ``PackedSeqParams`` at capture,
  and a replay's ``PackedSeqParams`` into the graph input (checked against the layout on the host).

Hybrid CP's packs (``local_cp_size`` set) pass through untouched: graph banks carry them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_cg_plugin.packed.layout import PackedLayout, check_sequence_count, check_sequence_length
from megatron_cg_plugin.scopes import attention_in_graph

__all__ = [
    "PackedFormError",
    "THD_KWARG",
    "build_capture",
    "build_replay",
    "build_thd_layout",
    "capture_params",
    "fixed_offsets",
    "fixed_params",
    "graph_input",
    "helper_sample_inputs",
    "layout_of",
    "longest_sequence",
    "sample_inputs",
]

THD_KWARG = "thd_cu_seqlens"  # the graph input holding a packed microbatch's offsets


class PackedFormError(ValueError):
    """A packed microbatch the fixed layout cannot carry; the message names what to change."""


def layout_of(config: Any, seq_length: int) -> PackedLayout | None:
    """The fixed layout ``config`` asks for (None without ``--cg-thd-max-seqs``): its ``max_seqlen``
    ``--cg-thd-max-seqlen``, else ``seq_length`` (the job's ``--seq-length``)."""
    if config.thd_max_seqs is None:
        return None
    max_seqlen = seq_length if config.thd_max_seqlen is None else config.thd_max_seqlen
    return PackedLayout(config.thd_max_seqs, max_seqlen, seq_length=seq_length)


def fixed_offsets(offsets: torch.Tensor, entries: int) -> torch.Tensor:
    """``offsets`` (1-D, cumulative, from 0) in a new int32 tensor of ``entries`` values on their
    device, each added entry repeating the last offset. Only the shape is read on the host; raises
    ``ThdCapacityError`` naming ``--cg-thd-max-seqs`` when they hold more than ``entries - 1``
    sequences."""
    if offsets.dim() != 1 or not offsets.numel() or offsets.is_floating_point():
        raise PackedFormError(
            f"cu_seqlens must be a non-empty 1-D integer tensor, got {tuple(offsets.shape)} {offsets.dtype}."
        )
    count = offsets.numel()
    check_sequence_count(count - 1, entries - 1)
    fixed = torch.empty(entries, dtype=torch.int32, device=offsets.device)
    fixed[:count].copy_(offsets)
    if count < entries:
        fixed[count:].copy_(offsets[count - 1 :].expand(entries - count))
    return fixed


def _check_form(params: Any, layout: PackedLayout) -> None:
    """What the fixed layout carries: self-attention THD offsets without padding between sequences."""
    if params.cu_seqlens_kv is not params.cu_seqlens_q:
        raise PackedFormError(
            "packed graphs serve self-attention: cu_seqlens_kv must be the very tensor "
            "cu_seqlens_q is (Megatron's pretrain_gpt.py builds them so)."
        )
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(params, name)
        if padded is not None and padded is not params.cu_seqlens_q:
            raise PackedFormError(
                f"{name} differs from cu_seqlens_q (padding between sequences), which packed graphs do not carry: "
                "pass cu_seqlens_padded=None, or train this data with --cuda-graph-impl none."
            )
    if params.pad_between_seqs:
        raise PackedFormError("pad_between_seqs=True is not carried by packed graphs: leave it None.")
    # A document longer than the captured max_seqlen would be computed wrongly, so a missing bound is
    # read from the offsets (one host read) rather than trusted.
    values = [getattr(params, name) for name in ("max_seqlen_q", "max_seqlen_kv")]
    if None in values:
        values = [longest_sequence(params.cu_seqlens_q) if value is None else value for value in values]
    check_sequence_length(max(int(value) for value in values), layout.max_seqlen)


def longest_sequence(offsets: Any) -> int:
    """The longest sequence of cumulative ``offsets`` (one host read); 0 for offsets ``fixed_offsets``
    refuses (it names what is wrong with them)."""
    if (
        not isinstance(offsets, torch.Tensor)
        or offsets.dim() != 1
        or offsets.numel() < 2
        or offsets.is_floating_point()
    ):
        return 0
    return int((offsets[1:] - offsets[:-1]).max())


def fixed_params(params: Any, layout: PackedLayout) -> Any:
    """A packed microbatch's ``PackedSeqParams`` in the fixed layout (a new object; the offsets a new
    tensor, so a later microbatch never overwrites what an earlier one's backward reads)."""
    _check_form(params, layout)
    offsets = fixed_offsets(params.cu_seqlens_q, layout.entries)
    return dataclasses.replace(
        params,
        cu_seqlens_q=offsets,
        cu_seqlens_kv=offsets,
        cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=None,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
    )


def graph_input(params: Any, layout: PackedLayout, where: str) -> torch.Tensor:
    """The graph input of a replay's ``PackedSeqParams``, which must be in the fixed layout."""
    offsets = params.cu_seqlens_q
    tensor = isinstance(offsets, torch.Tensor)
    if (
        tensor
        and offsets.shape == (layout.entries,)
        and offsets.dtype == torch.int32  # every replay: no message built
        and params.max_seqlen_q == layout.max_seqlen
        and params.max_seqlen_kv == layout.max_seqlen
        and params.cu_seqlens_kv is offsets
        and params.cu_seqlens_q_padded is None
        and params.cu_seqlens_kv_padded is None
    ):
        return offsets
    found = {
        "cu_seqlens_q shape": tuple(offsets.shape) if tensor else type(offsets).__name__,
        "cu_seqlens_q dtype": str(offsets.dtype) if tensor else None,
        "max_seqlen_q": params.max_seqlen_q,
        "max_seqlen_kv": params.max_seqlen_kv,
        "cu_seqlens_kv is cu_seqlens_q": params.cu_seqlens_kv is offsets,
        "cu_seqlens_q_padded is None": params.cu_seqlens_q_padded is None,
        "cu_seqlens_kv_padded is None": params.cu_seqlens_kv_padded is None,
    }
    expected = {
        "cu_seqlens_q shape": (layout.entries,),
        "cu_seqlens_q dtype": str(torch.int32),
        "max_seqlen_q": layout.max_seqlen,
        "max_seqlen_kv": layout.max_seqlen,
        "cu_seqlens_kv is cu_seqlens_q": True,
        "cu_seqlens_q_padded is None": True,
        "cu_seqlens_kv_padded is None": True,
    }
    wrong = [
        f"{name} {found[name]!r} (captured: {value!r})" for name, value in expected.items() if found[name] != value
    ]
    if wrong:
        raise PackedFormError(
            f"{where}: a packed microbatch reached the graph outside the fixed layout it was captured for "
            f"({'; '.join(wrong)}). The plugin lays packed batches out at GPTModel's entry (patch packed-thd-layout); "
            "a model other than GPTModel, or a call outside its forward, must pass "
            "packed.graphs.fixed_params(params, layout) itself, or train with --cuda-graph-impl none."
        )
    return offsets


def capture_params(offsets: torch.Tensor, layout: PackedLayout) -> Any:
    """The ``PackedSeqParams`` a graph is captured with: what ``fixed_params`` makes of Megatron's."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=offsets,
        cu_seqlens_kv=offsets,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
    )


def _packed_rope_table(chunks: Sequence[Any], layout: PackedLayout) -> torch.Tensor | None:
    """The RoPE table GPTModel passes for a fixed-layout microbatch (its cached object: the same
    call), from the first model chunk with RoPE; None without RoPE."""
    for chunk in chunks:
        if chunk is not None and getattr(chunk, "position_embedding_type", None) == "rope":
            return chunk.rotary_pos_emb(layout.max_seqlen, packed_seq=True, cp_group=None)
    return None


def sample_inputs(
    sample_args: Sequence[tuple],
    sample_kwargs: Sequence[dict],
    layout: PackedLayout,
    *,
    micro_batch_size: int,
    rope: torch.Tensor | None,
) -> tuple[list, list]:
    """Megatron's sample arguments per (layer, microbatch), as a fixed-layout packed microbatch
    brings them: hidden states as the flattened stream ``[mbs x rows, 1, h]``; where attention is
    graphed (Megatron's sample has an ``attention_mask``, ``TransformerLayer.get_layer_static_inputs``)
    no mask, the packed RoPE table ``rope`` and the offsets ``THD_KWARG``. Entries Megatron shares
    (its buffer reuse) stay shared."""
    made: dict[tuple[int, int], tuple[tuple, dict]] = {}
    out_args, out_kwargs = [], []
    for args, kwargs in zip(sample_args, sample_kwargs, strict=True):
        key = (id(args), id(kwargs))
        if key not in made:
            made[key] = _packed_sample(tuple(args), dict(kwargs), layout, micro_batch_size, rope)
        out_args.append(made[key][0])
        out_kwargs.append(made[key][1])
    return out_args, out_kwargs


def _packed_sample(
    args: tuple, kwargs: dict, layout: PackedLayout, micro_batch_size: int, rope: torch.Tensor | None
) -> tuple[tuple, dict]:
    assert len(args) == 1, "Megatron's TE sample arguments are the hidden states alone (TE >= 1.10)"
    hidden = args[0]
    if hidden.shape[1] != 1:  # [rows, mbs, h] -> the packed stream [mbs x rows, 1, h]
        hidden = torch.ones(
            (hidden.shape[0] * hidden.shape[1], 1, hidden.shape[2]),
            dtype=hidden.dtype,
            device=hidden.device,
            requires_grad=hidden.requires_grad,
        )
    if "attention_mask" not in kwargs:  # attention is not graphed in this layer
        return (hidden,), kwargs
    del kwargs["attention_mask"]
    if "rotary_pos_emb" in kwargs:
        assert rope is not None, "Megatron sampled a RoPE table for a model without RoPE"
        kwargs["rotary_pos_emb"] = rope
    kwargs[THD_KWARG] = torch.tensor(layout.sample_offsets(micro_batch_size), dtype=torch.int32, device=hidden.device)
    return (hidden,), kwargs


def helper_sample_inputs(helper: Any, sample_args: Sequence[tuple], sample_kwargs: Sequence[dict]) -> tuple:
    """The plugin helper's sample arguments: Megatron's, packed where the run's config asks for it."""
    layout = layout_of(helper.session.config, seq_length=helper.seq_length)
    if layout is None:
        return sample_args, sample_kwargs
    return sample_inputs(
        sample_args,
        sample_kwargs,
        layout,
        micro_batch_size=helper.micro_batch_size,
        rope=_packed_rope_table(helper.chunks_with_decoder, layout),
    )


# -- what the three patches put in place (their entries in patching.ledger.PATCHES) ---------------


def _config_layout(session: Any) -> Callable[[], PackedLayout | None]:
    """The session's layout, made once its config is resolved and kept while that config holds; its
    ``--seq-length`` from the run's settings (``session.settings``: resolving the config runs the rules)."""
    held: dict[int, PackedLayout | None] = {}

    def layout() -> PackedLayout | None:
        config = session.config
        if id(config) not in held:
            held.clear()
            held[id(config)] = None if config.thd_max_seqs is None else layout_of(config, _seq_length(session))
        return held[id(config)]

    return layout


def _seq_length(session: Any) -> int:
    session.ensure_checked()  # a run whose flags Megatron's validate_args did not take: the rules take them now
    settings = session.settings
    if settings is None or settings.seq_length is None:
        raise RuntimeError(
            "--cg-thd-max-seqs lays packed sequences out from --seq-length, but this run's settings were never "
            "read: call megatron_cg_plugin.install() before Megatron parses its arguments (or after it parsed "
            "them), as megatron-cg run does."
        )
    return int(settings.seq_length)


def _carried(params: Any) -> bool:
    """A packed microbatch this module lays out: THD, not hybrid CP's (banks carry those)."""
    return params is not None and params.qkv_format == "thd" and params.local_cp_size is None


def build_thd_layout(original: Callable, session: Any) -> Callable:
    """``GPTModel.forward`` laying a training microbatch's packed params out at the fixed capacity."""
    position = list(inspect.signature(original).parameters).index("packed_seq_params") - 1  # after self
    layout = _config_layout(session)

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        positional = len(args) > position
        params = args[position] if positional else kwargs.get("packed_seq_params")
        if not (self.training and _carried(params)) or (current := layout()) is None:
            return original(self, *args, **kwargs)
        fixed = fixed_params(params, current)
        if positional:
            args = (*args[:position], fixed, *args[position + 1 :])
        else:
            kwargs["packed_seq_params"] = fixed
        return original(self, *args, **kwargs)

    return forward


def build_capture(original: Callable, session: Any) -> Callable:
    """``TransformerLayer._te_cuda_graph_capture`` taking the offsets as the graph input ``THD_KWARG``."""
    layout = _config_layout(session)

    @functools.wraps(original)
    def _te_cuda_graph_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        offsets = kwargs.pop(THD_KWARG, None)
        if offsets is not None:
            current = layout()
            assert current is not None, "packed sample inputs were made without --cg-thd-max-seqs"
            kwargs["packed_seq_params"] = capture_params(offsets, current)
        return original(self, *args, **kwargs)

    return _te_cuda_graph_capture


def build_replay(original: Callable, session: Any) -> Callable:
    """``TransformerLayer._te_cuda_graph_replay`` handing a packed microbatch's offsets to the graph
    where attention is graphed (elsewhere Megatron runs attention eagerly with the params)."""
    layout = _config_layout(session)

    @functools.wraps(original)
    def _te_cuda_graph_replay(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = kwargs.get("packed_seq_params")
        current = layout() if _carried(params) else None
        if current is None or not attention_in_graph(self.config.cuda_graph_modules):
            return original(self, *args, **kwargs)  # Megatron's own path (and its assert)
        kwargs = dict(kwargs)
        del kwargs["packed_seq_params"]
        if kwargs.pop("attention_mask", None) is not None:
            raise PackedFormError(
                f"layer {self.layer_number}: a packed microbatch also brings an attention mask, "
                "which packed graphs do not take (THD attention masks by cu_seqlens): pass None."
            )
        kwargs[THD_KWARG] = graph_input(params, current, f"layer {self.layer_number}")
        return original(self, *args, **kwargs)

    return _te_cuda_graph_replay
