"""A user's own Megatron training script, as one is written against the megatron-core 0.19.2 wheel.

It knows nothing of megatron-cg-plugin: the farm runs it through ``megatron-cg run``, which must
make it accept the ``--cg-*`` flags, run the plugin's rules and print the report by itself.
Mock data or Megatron indexed datasets (``--data-path``), GPT models, PP = 1.
"""

from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split


def get_batch(data_iterator):
    args = get_args()
    batch = {}
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        batch = {
            key: value.cuda(non_blocking=True) if torch.is_tensor(value) else value
            for key, value in next(data_iterator).items()
        }
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=1,
        is_pipeline_first_stage=True,
        is_pipeline_last_stage=True,
    )
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = get_batch(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"])


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset,
        train_val_test_num_samples,
        lambda: parallel_state.get_tensor_model_parallel_rank() == 0,
        config,
    ).build()


if __name__ == "__main__":
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(
        pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
