"""GPT/MoE pretraining on megatron-core's own training loop, with the plugin installed.

``python -m megatron_cg_plugin.pretrain_gpt [--cg-preset tiny-gpt] <Megatron flags> <--cg-* flags>``

The megatron-core wheel ships ``megatron.training`` but no ``pretrain_gpt.py``; this is the plugin's
own equivalent: mock data or Megatron's indexed datasets (``--data-path`` with blends and
``--split``, or per-split paths) with Megatron's tokenizers, GPT and MoE, and hybrid CP with
fixed-capacity THD packs. It installs the plugin before Megatron parses the flags, so the rules run
inside Megatron's ``validate_args`` (a broken run stops there, before any GPU work), and hands
Megatron a forward step and a dataset provider. One process needs no torchrun.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from megatron_cg_plugin import console, helptext, installation, parse_errors
from megatron_cg_plugin.banks.dynamic_cp import hybrid_cp_layer_spec
from megatron_cg_plugin.banks.hybrid_cp_batch import get_hybrid_cp_batch
from megatron_cg_plugin.capture_lifecycle import refusals_reported
from megatron_cg_plugin.data.sources import build_datasets
from megatron_cg_plugin.launch.presets import expand_preset, find_preset
from megatron_cg_plugin.launch.rendezvous import argv_as, single_process_rendezvous
from megatron_cg_plugin.packed.batches import packed_batch_params, with_packed_keys
from megatron_cg_plugin.parse_errors import plugin_args_provider, printable_help
from megatron_cg_plugin.refusal import refuse_host

__all__ = ["ARGS_DEFAULTS", "main", "parse_megatron_args", "refuse_host_needs", "run"]

ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def parse_megatron_args(argv: Sequence[str], *, validate: bool = True) -> Any:
    """Megatron's parser with the plugin's flags (and the preset expanded); ``validate`` also runs
    Megatron's ``validate_args`` and sets its global args, as ``parse_and_validate_args`` does. Its
    printout of every argument is held back until the flags pass (``console.megatron_printout_held``):
    a refused run shows its cause, not 850 lines of arguments."""
    from megatron.training.arguments import parse_and_validate_args, parse_args

    with argv_as(["pretrain_gpt", *expand_preset(argv)]):
        if validate:
            with console.megatron_printout_held():
                return parse_and_validate_args(extra_args_provider=plugin_args_provider, args_defaults=ARGS_DEFAULTS)
        return parse_args(extra_args_provider=plugin_args_provider)


# -- what Megatron's loop calls -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BatchSpec:
    """The parsed flags the data path needs, read once at start-up (not per step)."""

    micro_batch_size: int
    seq_length: int
    context_parallel_size: int
    pipeline_model_parallel_size: int
    create_attention_mask: bool
    hybrid_context_parallel: bool = False
    tokens_per_rank: int | None = None  # --max-seqlen-per-dp-cp-rank (hybrid CP)
    thd_max_seqs: int = 1  # --cg-thd-max-seqs (hybrid CP)
    packed: bool = False  # --dataloader-inter-document-masking without hybrid CP: THD microbatches


def _get_batch(data_iterator: Any, spec: _BatchSpec, vp_stage: int | None) -> dict[str, Any]:
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import (
        flatten_batch_for_packed_sequences,
        get_batch_on_this_cp_rank,
        get_batch_on_this_tp_rank,
    )
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return dict.fromkeys(_BATCH_KEYS)
    batch: dict[str, Any] = {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {
            key: (value.cuda(non_blocking=True) if torch.is_tensor(value) else value)
            for key, value in (with_packed_keys(batch) if spec.packed else batch).items()
        }
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=spec.packed,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=spec.create_attention_mask,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=spec.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=spec.micro_batch_size,
        seq_length=spec.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=spec.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    if spec.packed:  # the microbatch's samples as one token stream, as Megatron's pretrain_gpt.py packs them
        batch = flatten_batch_for_packed_sequences(batch)
    return get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group(), use_per_sequence_balancing=spec.packed
    )


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses and the token count: Megatron reduces both over DP and divides."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def _forward_step(data_iterator: Any, model: Any, *, spec: _BatchSpec):
    from megatron.core.utils import get_attr_wrapped_model

    if spec.hybrid_context_parallel:
        assert spec.tokens_per_rank is not None  # Megatron requires --max-seqlen-per-dp-cp-rank with hybrid CP
        batch, packed = get_hybrid_cp_batch(
            data_iterator, tokens_per_rank=spec.tokens_per_rank, max_seqs=spec.thd_max_seqs
        )
        output = model(
            batch["tokens"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
            packed_seq_params=packed,
        )
        return output, functools.partial(_loss_func, batch["loss_mask"])
    batch = _get_batch(data_iterator, spec, get_attr_wrapped_model(model, "vp_stage"))
    packed = packed_batch_params(batch, tokens_per_sample=spec.seq_length) if spec.packed else None
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        packed_seq_params=packed,
    )
    return output, functools.partial(_loss_func, batch["loss_mask"])


_USAGE = (
    "usage: python -m megatron_cg_plugin.pretrain_gpt [--cg-preset NAME] <Megatron flags> <--cg-* flags>\n\n"
    "Trains a GPT or MoE through Megatron's own pretrain() with the plugin installed; megatron-cg check "
    "validates the same flags on CPU."
)


def _launcher_help() -> str:
    """The launcher's ``--help``: the plugin's flags first, then Megatron's (megatron-core 0.19.2's own
    ``--help`` fails on one help string, escaped here: ``parse_errors.printable_help``)."""
    from megatron.training.arguments import add_megatron_arguments

    megatron = argparse.ArgumentParser(prog="pretrain_gpt", usage=argparse.SUPPRESS, add_help=False)
    megatron_flags = printable_help(add_megatron_arguments(megatron)).format_help().strip()
    return (
        f"{_USAGE}\n\n{helptext.plugin_flags_help()}\n\nMegatron's flags (megatron-core's parser; its own --help "
        f"fails on a bare '%' in one help string in 0.19.2, escaped here):\n\n{megatron_flags}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(flag in ("-h", "--help") for flag in argv):
        print(_launcher_help())
        return 0
    try:
        find_preset(argv)  # a misspelt preset, named before Megatron starts
    except ValueError as error:
        print(f"megatron_cg_plugin.pretrain_gpt: {error}", file=sys.stderr)
        return 2
    with single_process_rendezvous(), parse_errors.reported_as("megatron_cg_plugin.pretrain_gpt"):
        session = installation.install(launcher=True)
        try:
            with console.megatron_printout_held():
                args = parse_megatron_args(argv)  # validate_args ran every rule: the flags can train
                refuse_host_needs(session)
            with refusals_reported("megatron_cg_plugin.pretrain_gpt"):
                run(args, session)
        finally:
            installation.uninstall()
    return 0


def refuse_host_needs(session: Any) -> None:
    """What the host lacks (``refusal.refuse_host``), asked once the flags passed every check (the validate-args
    hook checked them as on the GPU host): the launcher asks it after Megatron's validation, the bench after its
    own checks of the flags too."""
    refusal = refuse_host(session.settings, environ=os.environ)
    if refusal is not None:
        raise refusal


def _batch_spec(session: Any) -> _BatchSpec:
    """What the launcher's data path needs, from the run's settings (read once Megatron validated the flags,
    ``validate-args-rules``) and the plugin's config."""
    settings = session.settings
    return _BatchSpec(
        micro_batch_size=settings.micro_batch_size,
        seq_length=settings.seq_length,
        context_parallel_size=settings.context_parallel,
        pipeline_model_parallel_size=settings.pipeline_parallel,
        create_attention_mask=settings.create_attention_mask_in_dataloader,  # Megatron's dataloader's own flag
        hybrid_context_parallel=settings.hybrid_context_parallel,
        tokens_per_rank=settings.max_seqlen_per_dp_cp_rank,
        thd_max_seqs=session.config.thd_capacity,
        packed=settings.packed,  # with --sft too, which the launcher refuses (rule packed-launcher-sft)
    )


def run(args: Any, session: Any) -> None:
    """Megatron's ``pretrain()`` with this launcher's forward step and datasets; the plugin's
    report and files come when training ends (the ``train-end-report`` patch)."""
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    settings = session.settings
    spec = _batch_spec(session)
    # Megatron reads an attribute of the provider; the args go whole to its blend parser
    provider: Any = functools.partial(build_datasets, settings=settings, args=args)
    provider.is_distributed = True  # every rank builds (Megatron's own pretrain_gpt does the same)
    model_config = gpt_config_from_args(args)
    if spec.hybrid_context_parallel:
        # Eager and graphed runs alike: RoPE with each microbatch's CP group; banks when graphed.
        model_config.transformer_layer_spec = hybrid_cp_layer_spec(
            rope=settings.position_embedding_type == "rope", banks=session.config.graph_banks and settings.te_graphs
        )
    pretrain(
        pretrain_cfg_container_from_args(args, model_config),
        provider,
        ModelType.encoder_or_decoder,
        functools.partial(_forward_step, spec=spec),
    )
    installation.finish()  # already done when train() ran; a run that skipped training still reports
