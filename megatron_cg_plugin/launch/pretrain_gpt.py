"""GPT/MoE pretraining on megatron-core's own training loop, with the plugin installed.

``python -m megatron_cg_plugin.pretrain_gpt [--cg-preset tiny-gpt] <Megatron flags> <--cg-* flags>``

The megatron-core wheel ships ``megatron.training`` but no ``pretrain_gpt.py``; this is the plugin's
own equivalent for mock data: parse Megatron's flags plus the plugin's, check every graph rule
before any GPU work, then hand Megatron a forward step and a dataset provider.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys
from typing import Any, Iterator, Sequence

import torch

from megatron_cg_plugin import integration, rules
from megatron_cg_plugin.config import add_plugin_args, config_from_args
from megatron_cg_plugin.dynamic_cp import hybrid_cp_layer_spec
from megatron_cg_plugin.launch.presets import expand_preset

ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


@contextlib.contextmanager
def _argv(argv: Sequence[str]) -> Iterator[None]:
    """Megatron's parser reads ``sys.argv``; give it ``argv`` and put the real one back."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def apex_fused_wgrad_available() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def parse_megatron_args(argv: Sequence[str], *, validate: bool = True) -> Any:
    """Megatron's parser with the plugin's flags (and the preset expanded); ``validate`` also runs
    Megatron's ``validate_args`` and sets its global args, as ``parse_and_validate_args`` does."""
    from megatron.training.arguments import parse_and_validate_args, parse_args

    with _argv(expand_preset(argv)):
        if validate:
            return parse_and_validate_args(extra_args_provider=add_plugin_args, args_defaults=ARGS_DEFAULTS)
        return parse_args(extra_args_provider=add_plugin_args)


def check_plugin_rules(args: Any, env: dict[str, str], *, te_present: bool | None = None) -> rules.GraphFacts:
    """Runs every rule on the parsed flags; ``te_present`` overrides the probe (the CPU dry run
    checks flags for a GPU host it is not running on)."""
    facts = rules.facts_from_args(args, te_available=te_available() if te_present is None else te_present,
                                  apex_fused_wgrad=apex_fused_wgrad_available(), env=env)
    rules.validate(facts)
    return facts


# -- what Megatron's loop calls -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """The parsed flags the data path needs, read once at start-up (not per step)."""

    micro_batch_size: int
    seq_length: int
    context_parallel_size: int
    pipeline_model_parallel_size: int
    create_attention_mask: bool
    hybrid_context_parallel: bool = False
    tokens_per_rank: int | None = None  # --max-seqlen-per-dp-cp-rank (hybrid CP)
    thd_max_seqs: int = 1  # --cg-thd-max-seqs (hybrid CP)


def get_hybrid_cp_batch(data_iterator: Any, spec: BatchSpec) -> tuple[dict[str, Any], Any]:
    """One microbatch of Megatron's hybrid-CP schedule as a fixed-capacity THD pack on this rank.

    The schedule hands over one document (1-D tokens, labels, loss mask, positions) with its CP size
    (``local_cp_size``). Megatron 0.19.2's own path fails on these (``get_batch_on_this_tp_rank``
    reads a second dimension the 1-D sample lacks); here the document is padded to the pack of
    ``cp x --max-seqlen-per-dp-cp-rank`` tokens (``plan.thd``: the same layout graphed and eager),
    split per sequence across the CP group with TE's partitioned indices (as Megatron does), and
    described by a ``PackedSeqParams`` with the hybrid group of that size."""
    import torch.distributed as dist
    import transformer_engine_torch as tex
    from megatron.core import parallel_state

    from megatron_cg_plugin.capture.banked import ensure_dynamic_cp_stream, packed_seq_params
    from megatron_cg_plugin.plan.thd import fixed_capacity_layout

    ensure_dynamic_cp_stream()  # eager hybrid CP at static CP 1 needs it as much as graphs (here: device set)
    sample = next(data_iterator)
    size = int(sample["local_cp_size"])
    length = int(sample["tokens"].numel())
    layout = fixed_capacity_layout([length], size, spec.tokens_per_rank, spec.thd_max_seqs)
    batch = {}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        value = sample[key].reshape(-1).cuda(non_blocking=True)
        padded = torch.zeros(layout.tokens, dtype=value.dtype, device=value.device)
        padded[:length] = value
        batch[key] = padded
    cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32, device="cuda")
    cu_padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device="cuda")
    group = parallel_state.get_hybrid_data_context_parallel_groups(group_size=size) if size > 1 else None
    if size > 1:
        index = tex.thd_get_partitioned_indices(cu_padded, layout.tokens, size, dist.get_rank(group))
        batch = {key: value.index_select(0, index) for key, value in batch.items()}
    batch = {key: value.unsqueeze(0) for key, value in batch.items()}
    batch["attention_mask"] = None
    return batch, packed_seq_params(cu, cu_padded, size, group, layout.max_seqlen)


def get_batch(data_iterator: Any, spec: BatchSpec, vp_stage: int | None) -> dict[str, Any]:
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return {key: None for key in BATCH_KEYS}
    batch: dict[str, Any] = {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {key: (value.cuda(non_blocking=True) if torch.is_tensor(value) else value)
                 for key, value in batch.items()}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
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
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses and the token count: Megatron reduces both over DP and divides."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Any, model: Any, *, spec: BatchSpec, session: Any):
    from megatron.core.utils import get_attr_wrapped_model

    if getattr(model, "training", True):  # evaluation steps are not training iterations
        session.mark_iteration_start()
    if spec.hybrid_context_parallel:
        batch, packed = get_hybrid_cp_batch(data_iterator, spec)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"], packed_seq_params=packed)
        return output, functools.partial(loss_func, batch["loss_mask"])
    batch = get_batch(data_iterator, spec, get_attr_wrapped_model(model, "vp_stage"))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def datasets_provider(train_val_test_num_samples: Sequence[int], vp_stage: int | None = None, *,
                      args: Any):
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training.global_vars import get_tokenizer
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not args.mock_data:
        raise ValueError("this launcher trains on mock data only: add --mock-data.")
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        inter_document_masking=bool(getattr(args, "dataloader_inter_document_masking", False)),
    )

    def built_on_this_rank() -> bool:
        return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         built_on_this_rank, config).build()


def check_hybrid_cp_launch(args: Any) -> None:
    """What this launcher's hybrid-CP data path needs beyond Megatron's own checks (each of these
    otherwise fails later with an assertion or an IndexError deep inside Megatron)."""
    if not getattr(args, "hybrid_context_parallel", False):
        return
    needed = []
    if getattr(args, "rerun_mode", "disabled") != "disabled":
        needed.append("--rerun-mode disabled (Megatron's hybrid-CP loader is not a RerunDataIterator)")
    if not getattr(args, "dataloader_inter_document_masking", False):
        needed.append("--dataloader-inter-document-masking (the hybrid-CP scheduler splits samples into documents)")
    if not getattr(args, "max_seqlen_per_dp_cp_rank", None):
        needed.append("--max-seqlen-per-dp-cp-rank N (tokens per rank of a packed microbatch)")
    if args.tensor_model_parallel_size != 1:
        needed.append("--tensor-model-parallel-size 1 (this launcher's hybrid-CP data path does not broadcast over TP)")
    if needed:
        raise ValueError("--hybrid-context-parallel with this launcher needs: " + "; ".join(needed) + ".")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_megatron_args(argv)
    check_plugin_rules(args, dict(os.environ))
    check_hybrid_cp_launch(args)
    session = integration.install(config_from_args(args))
    try:
        from megatron.core.enums import ModelType
        from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
        from megatron.training.training import pretrain

        spec = BatchSpec(
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            context_parallel_size=args.context_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            create_attention_mask=args.create_attention_mask_in_dataloader,
            hybrid_context_parallel=bool(getattr(args, "hybrid_context_parallel", False)),
            tokens_per_rank=getattr(args, "max_seqlen_per_dp_cp_rank", None),
            thd_max_seqs=session.config.thd_max_seqs,
        )
        provider = functools.partial(datasets_provider, args=args)
        provider.is_distributed = True  # every rank builds (Megatron's own pretrain_gpt does the same)
        model_config = gpt_config_from_args(args)
        if spec.hybrid_context_parallel:
            # Eager and graphed runs alike: RoPE with each microbatch's CP group; banks when graphed.
            model_config.transformer_layer_spec = hybrid_cp_layer_spec(
                rope=args.position_embedding_type == "rope",
                banks=session.config.graph_banks and args.cuda_graph_impl == "transformer_engine")
        full_config = pretrain_cfg_container_from_args(args, model_config)
        pretrain(full_config, provider, ModelType.encoder_or_decoder,
                 functools.partial(forward_step, spec=spec, session=session))
        integration.finish()
    finally:
        integration.uninstall()
    return 0
