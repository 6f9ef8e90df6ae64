"""A user's own script that turns on FP8 dot-product attention, which megatron-core 0.19.2 offers as
a TransformerConfig field only (no flag): the model config is built from the flags, the field set,
and the rest is ``user_pretrain_gpt.py``. It knows nothing of megatron-cg-plugin."""

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args
from user_pretrain_gpt import datasets_provider, forward_step

if __name__ == "__main__":
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    config = core_transformer_config_from_args(args)
    config.fp8_dot_product_attention = True
    pretrain(
        pretrain_cfg_container_from_args(args, gpt_config_from_args(args, config)),
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
