"""The run's settings, read once: ``read_settings`` turns Megatron's parsed args, the plugin's config
and the environment into one frozen ``RunSettings`` that the rules, the planners, the refusal, the
session, the launcher's data path and the bench take; ``read_run_settings`` adds what this host and
Megatron's own builders make of the flags (``megatron_builds``, ``data.sources.missing_files``), the
settings ``rules.check_run`` evaluates the rules on.

No other module reads a value off Megatron's args (``tests/unit/test_purity.py`` scans for one): the
``--cg-*`` values only through ``config.config_from_args``, which ``read_settings`` alone calls. Other
modules hold the args only to pass them on, to ``read_settings`` (the session, through
``rules.check_run``) or whole to Megatron's own functions that take them (its tokenizer, optimizer and
blend readers in ``megatron_builds`` and ``data.sources``, its model config in the launcher and
``refusal``), and the bench sets Megatron's loop counters on them. The validate-args hook also reads
the flags as parsed, through the same function, for the early rules only (sizes Megatron would divide
by or allocate from before its own checks name them); the run keeps the settings read once Megatron
validated the flags.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from megatron_cg_plugin import compat, megatron_builds
from megatron_cg_plugin.config import (
    ConfigError,
    PluginConfig,
    config_from_args,
    graph_only_flags,
    has_plugin_flags,
)
from megatron_cg_plugin.data.sources import missing_files as missing_data_files
from megatron_cg_plugin.inputs import environment_problems, expandable_segments
from megatron_cg_plugin.scopes import module_names

__all__ = [
    "DETERMINISTIC_THD_LIMIT",
    "LearningRateSchedule",
    "RunSettings",
    "environment_settings",
    "read_run_settings",
    "read_settings",
]

# Which --offload-modules run inside which --cuda-graph-modules scope (Megatron's layer layout).
_OFFLOAD_INSIDE_SCOPE = {
    "attn": frozenset({"attn_norm", "qkv_linear", "core_attn", "attn_proj"}),
    "mlp": frozenset({"mlp_norm"}),
    "moe": frozenset({"mlp_norm", "expert_fc1", "moe_act", "fused_group_mlp"}),
}


# TE 2.20.2 (dot_product_attention/utils.py) disables FusedAttention for deterministic F16/BF16 THD training on
# sm90 once batch (cu_seqlens entries - 1) x heads per rank x max_seqlen_q x max_seqlen_kv reaches this.
DETERMINISTIC_THD_LIMIT = 1 << 30

# Environment switches read as 0 or 1 where a run is set up (TE parses them as integers, so another value fails
# late, or reads as off): the plugin's rules, the farm and the planner read them too.
_ZERO_OR_ONE_SWITCHES = (
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
    "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE",
    "NVTE_CPU_OFFLOAD_V1",
    "NCCL_GRAPH_REGISTER",
)

# Where a run's tokens come from: Megatron's data-source flags, each with its args name.
_DATA_SOURCE_FLAGS = (
    ("--mock-data", "mock_data"),
    ("--data-path", "data_path"),
    ("--data-args-path", "data_args_path"),
    ("--train-data-path", "train_data_path"),
    ("--valid-data-path", "valid_data_path"),
    ("--test-data-path", "test_data_path"),
    ("--per-split-data-args-path", "per_split_data_args_path"),
)

# Flags megatron-core 0.19.2's validate_args asserts are given (one at a time, some without a message), each a
# RunSettings field under its args name.
_REQUIRED_FLAGS = (
    "--micro-batch-size",
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--max-position-embeddings",
)

_WHOLE_LAYER_OFFLOADS = frozenset({"qkv_linear", "core_attn", "attn_proj"})
_MOE_BLOCK_OFFLOADS = _OFFLOAD_INSIDE_SCOPE["moe"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearningRateSchedule:
    """Megatron's learning-rate and weight-decay schedule flags, under their args names and with their
    defaults: what ``megatron_builds.optimizer_problem`` builds Megatron's ``OptimizerParamScheduler`` from."""

    lr: float | None = None
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    lr_warmup_fraction: float | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_decay_style: str = "linear"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    lr_wsd_decay_style: str = "exponential"
    start_weight_decay: float | None = None  # validate_args sets both from --weight-decay where not given
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    use_checkpoint_opt_param_scheduler: bool = False
    override_opt_param_scheduler: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
    """One run's settings as plain values: Megatron's flags, the plugin's (from the ``PluginConfig`` in
    force, or the ``--cg-*`` values as given when that config was refused), and the environment and
    host facts. ``read_settings`` builds it from Megatron's parsed args, the one place that reads them;
    the rules, the planners, the refusal, the session and the launcher's data path take it."""

    cuda_graph_impl: str = "none"
    modules: tuple[str, ...] = ()  # empty = whole layer
    warmup_steps: int = 3
    transformer_impl: str = "transformer_engine"
    num_layers: int | None = 2
    num_experts: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    dispatcher: str = "allgather"
    router_padding_for_fp8: bool = False
    recompute_granularity: str | None = None
    recompute_modules: tuple[str, ...] = ()
    cpu_offloading: bool = False
    gradient_accumulation_fusion: bool = False
    apex_fused_wgrad: bool = False
    hybrid_context_parallel: bool = False
    graph_banks: bool = False  # --cg-graph-banks
    slot_capture: bool = False  # --cg-slot-capture
    bank_min_cp: int = 1  # --cg-bank-min-cp
    position_embedding_type: str = "learned_absolute"
    apply_rope_fusion: bool = True  # --no-rope-fusion clears it
    overlap_param_gather: bool = False
    distributed_optimizer: bool = False  # --use-distributed-optimizer
    activation_offloading: bool = False  # --fine-grained-activation-offloading
    offload_modules: tuple[str, ...] = ()
    delay_wgrad_compute: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int | None = None
    context_parallel: int = 1
    world_size: int = 1
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    te_available: bool = True
    expandable_segments: bool = False
    nccl_graph_register_off: bool = False
    fp8: bool = False  # --fp8-format
    fp8_recipe: str = "delayed"  # --fp8-recipe
    # TransformerConfig's fp8_dot_product_attention / fp8_multi_head_attention (0.19.2 has no flag for
    # them): seen here only where a script sets them on args; one that sets them on the model config is
    # refused at capture (slot_sharing.megatron_backend.check_slot_capture_call) by the same rule
    fp8_attention: bool = False  # either of them
    fp8_multi_head_attention: bool = False
    te_op_fuser: bool = False  # --use-transformer-engine-op-fuser: the layers' MLP as te.ops fused operations
    te_op_norms: bool = False  # the layers hold TE's standalone (te.ops) norms: MoE pre-MLP norm, q/k or MLA norms
    # Megatron's TE layer fuses the input norm into the QKV linear, except multi-latent attention
    # without --mla-down-proj-fusion (gpt_layer_specs.py): there attn_norm offloads a real norm's saves.
    input_norm_fused: bool = True
    fp4: bool = False  # --fp4-format
    device_capability: tuple[int, int] | None = None  # of the GPU the run trains on (None: unknown here)
    cuda_version: tuple[int, int] | None = None  # torch's CUDA build
    sft: bool = False  # --sft: the dataset marks document boundaries itself
    moe_topk: int = 2
    sequence_parallel: bool = False
    launcher: bool = False  # the plugin's launcher, whose own data path has needs of its own
    rerun_mode: str = "disabled"
    log_to_tensorboard: bool = False  # --cg-log-to-tensorboard
    tensorboard_dir: str | None = None  # --tensorboard-dir
    save: str | None = None  # --save
    data_cache_path: str | None = None  # --data-cache-path
    inject_capture_failure: int | None = None  # --cg-inject-capture-failure
    inter_document_masking: bool = False  # --dataloader-inter-document-masking
    thd_max_seqs: int | None = None  # --cg-thd-max-seqs (None: not given)
    thd_max_seqlen: int | None = None  # --cg-thd-max-seqlen (None: not given, --seq-length)
    seq_length: int | None = None  # --seq-length
    max_position_embeddings: int | None = None
    vocab_size: int | None = None  # --vocab-size (None: the tokenizer's)
    tokenizer_type: str | None = None
    # The tokenizer's files the flags give: --tokenizer-model, --vocab-file, --merge-file (None: not given)
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    trust_remote_code: bool = False  # --trust-remote-code: building a HuggingFace tokenizer runs its own code
    num_attention_heads: int | None = None
    # --deterministic-mode, or NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (which TE reads): deterministic attention backward
    deterministic: bool = False
    multi_latent_attention: bool = False
    max_seqlen_per_dp_cp_rank: int | None = None
    # -- the model's shapes and layout, for the planners (planner.graph_memory, moe.capacity) --
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    group_query_attention: bool = False
    num_query_groups: int | None = None
    swiglu: bool = False
    quick_geglu: bool = False
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"
    rotary_percent: float = 1.0
    hidden_dropout: float = 0.0
    attention_backend: str | None = None  # --attention-backend by name (None: not given)
    mtp_num_layers: int | None = None
    fp8_dot_product_attention: bool = False  # MODEL_CONFIG_ONLY_FIELDS: a script may set it on the model config
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    expert_parallel: int = 1  # --expert-model-parallel-size
    expert_tensor_parallel: int | None = None  # --expert-tensor-parallel-size
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False  # the shared experts run in the dispatcher, not before the router
    moe_router_dtype: str | None = None
    min_offloaded_tensor_size: int | None = None  # None: Megatron's default (slot_sharing.offload_plan)
    activation_offload_fraction: float = 1.0
    graph_only_flags: tuple[str, ...] = ()  # --cg-* flags set that shape TE graphs only (config.graph_only_flags)
    config_problems: tuple[str, ...] = ()  # bad --cg-* values (config._config_problems)
    # Switches of the environment the plugin, Megatron or TE read as 0 or 1, set to anything else (NAME=value)
    unreadable_switches: tuple[str, ...] = ()
    # Variables torch, NCCL, CUDA or Megatron read where a run starts, with values they refuse or misread
    # (inputs.environment_problems): NAME=value and what to give
    unusable_environment: tuple[str, ...] = ()
    missing_files: tuple[str, ...] = ()  # dataset and tokenizer files the flags name but that do not exist
    load: str | None = None  # --load
    resumes_checkpoint: bool = False  # --load holds Megatron's tracker file: the run resumes from a checkpoint
    unsafe_pickle_allowed: bool = False  # NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1: TE loads pickled extra state
    # -- the training loop's counts and intervals (Megatron's defaults) --
    make_vocab_size_divisible_by: int = 128
    weight_shards: int | None = None  # --tensor-parallel-num-weight-shards (None: the tensor-parallel size)
    # The global batch changes during the run (--rampup-batch-size, --step-batch-size-schedule) or is rounded
    # down to fit (--decrease-batch-size-if-needed)
    batch_size_varies: bool = False
    train_iters: int | None = None
    train_samples: int | None = None
    log_interval: int = 100
    tensorboard_log_interval: int = 1
    eval_interval: int | None = 1000
    eval_iters: int = 100
    save_interval: int | None = None
    num_workers: int = 2  # --num-workers, the data loader's worker processes
    seed: int = 1234
    data_parallel_random_init: bool = False  # --data-parallel-random-init: each data-parallel rank offsets the seed
    skip_train: bool = False
    full_validation: bool = False
    # The data flags given (--mock-data, --data-path, ...): the launcher's datasets need one
    data_sources: tuple[str, ...] = ("--mock-data",)
    # -- the datasets' flags, as Megatron's dataset configs take them (data.sources, megatron_builds) --
    data_path: tuple[str, ...] | None = None  # --data-path (None: not given; empty: given without a dataset)
    data_args_path: str | None = None  # --data-args-path
    per_split_data_args_path: str | None = None  # --per-split-data-args-path
    split: str | None = None  # --split (validate_args fills it in)
    mmap_bin_files: bool = True  # --no-mmap-bin-files clears it
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask_in_dataloader: bool = True  # --no-create-attention-mask-in-dataloader clears it
    mid_level_dataset_surplus: float = 0.005
    # -- the optimizer Megatron builds (megatron_builds.optimizer_problem) --
    perform_rl_step: bool = False  # --perform-rl-step
    no_load_optim: bool = False  # --no-load-optim
    lr_schedule: LearningRateSchedule = LearningRateSchedule()
    # Megatron's validate_args ran on the flags read (it sets the data-parallel size): its builders can run on them
    validated: bool = False
    # -- what Megatron's own builders, run on CPU on the validated flags, raise (megatron_builds; None: built) --
    tokenizer_problem: str | None = None
    optimizer_problem: str | None = None
    dataset_problem: str | None = None

    @property
    def te_graphs(self) -> bool:
        return self.cuda_graph_impl == "transformer_engine"

    @property
    def mock_data(self) -> bool:
        return "--mock-data" in self.data_sources

    @property
    def missing_required_flags(self) -> list[str]:
        """The flags Megatron's ``validate_args`` asserts are given that these settings lack (all of them at
        once, where Megatron names one); each is the field of its args name."""
        return [flag for flag in _REQUIRED_FLAGS if getattr(self, flag[2:].replace("-", "_")) is None]

    @property
    def packed(self) -> bool:
        """Packed (THD) microbatches through Megatron's own batch path, without hybrid CP."""
        return (self.inter_document_masking or self.sft) and not self.hybrid_context_parallel

    @property
    def packed_graphs(self) -> bool:
        """Packed microbatches laid out at a fixed capacity for TE graphs (``packed.graphs``)."""
        return self.te_graphs and self.packed and self.thd_max_seqs is not None

    @property
    def packed_layout(self) -> bool:
        """Packed microbatches the plugin lays out at the fixed capacity: eager and graphed steps alike."""
        return self.packed and self.thd_max_seqs is not None

    @property
    def packed_max_seqlen(self) -> int | None:
        """The layout's ``max_seqlen``: ``--cg-thd-max-seqlen``, else ``--seq-length`` (None: unknown)."""
        return self.seq_length if self.thd_max_seqlen is None else self.thd_max_seqlen

    @property
    def packed_min_seqs(self) -> int:
        """The fewest documents a packed microbatch holds: Megatron's offsets cover every token of each
        sample, in documents of at most ``packed_max_seqlen`` tokens."""
        if self.seq_length is None or self.packed_max_seqlen is None or self.packed_max_seqlen < 1:
            return self.micro_batch_size  # a bad --cg-thd-max-seqlen is rule cg-flags'
        return self.micro_batch_size * -(-self.seq_length // self.packed_max_seqlen)

    @property
    def deterministic_thd_product(self) -> int | None:
        """TE's deterministic THD bound for the packed layout: ``--cg-thd-max-seqs`` x query heads per
        tensor-parallel rank x ``packed_max_seqlen``^2 (None where a factor is unknown)."""
        if not (self.thd_max_seqs and self.num_attention_heads and self.packed_max_seqlen):
            return None
        return self.thd_max_seqs * self.heads_per_rank * self.packed_max_seqlen**2

    @property
    def heads_per_rank(self) -> int:
        return -(-(self.num_attention_heads or 0) // max(1, self.tensor_parallel))

    @property
    def deterministic_thd_max_seqlen(self) -> int:
        """The largest ``--cg-thd-max-seqlen`` that keeps ``deterministic_thd_product`` under the limit."""
        if self.thd_max_seqs is None:  # asked only of packed layouts, which have --cg-thd-max-seqs
            raise TypeError("deterministic_thd_max_seqlen needs --cg-thd-max-seqs")
        return math.isqrt((DETERMINISTIC_THD_LIMIT - 1) // (self.thd_max_seqs * self.heads_per_rank))

    @property
    def attention_graphed(self) -> bool:
        return not self.modules or "attn" in self.modules

    @property
    def moe(self) -> bool:
        """Megatron allows the MoE graph scopes only with more than one expert."""
        return self.num_experts is not None and self.num_experts > 1

    @property
    def has_moe_layers(self) -> bool:
        """Megatron builds MoE layers whenever --num-experts is set, even to 1."""
        return self.num_experts is not None

    @property
    def moe_layer_freq_fits(self) -> bool:
        return isinstance(self.moe_layer_freq, int) or len(self.moe_layer_freq) == self.num_layers

    @property
    def data_context_parallel(self) -> int:
        """DP x CP: the ranks hybrid context parallelism splits into power-of-two CP groups."""
        return max(1, self.world_size // (self.tensor_parallel * self.pipeline_parallel))

    @property
    def data_parallel(self) -> int:
        return max(1, self.data_context_parallel // self.context_parallel)

    @property
    def drop_and_pad(self) -> bool:
        return self.capacity_factor is not None and self.pad_to_capacity

    @property
    def offloaded_in_graphs(self) -> frozenset[str]:
        """The offloaded modules that would run inside the graphed scope (every one for whole layers)."""
        if not self.activation_offloading:
            return frozenset()
        scopes = self.modules or tuple(_OFFLOAD_INSIDE_SCOPE)
        inside = frozenset().union(*(_OFFLOAD_INSIDE_SCOPE.get(scope, frozenset()) for scope in scopes))
        return inside & frozenset(self.offload_modules)

    @property
    def unjoined_whole_layer_offloads(self) -> frozenset[str]:
        """Offloaded groups Megatron 0.19.2 runs inside a whole-layer graph (transformer_layer.py
        _set_offload_modules): attention's always; the pre-MLP norm and the experts' only on MoE layers;
        the input norm's only where it is not fused (a dense TE layer fuses its norms into the linears,
        so attn_norm and mlp_norm offload nothing there)."""
        inside = (
            _WHOLE_LAYER_OFFLOADS
            | (_MOE_BLOCK_OFFLOADS if self.has_moe_layers else frozenset())
            | (frozenset() if self.input_norm_fused else frozenset({"attn_norm"}))
        )
        return self.offloaded_in_graphs & inside

    def is_moe_layer(self, index: int) -> bool:
        """``index`` is 0-based, as in Megatron's ``moe_layer_freq``; a layer the pattern does not
        cover counts as dense (the ``moe-layer-freq`` rule reports the short pattern)."""
        if not self.has_moe_layers:
            return False
        if isinstance(self.moe_layer_freq, int):
            return index % self.moe_layer_freq == 0
        return index < len(self.moe_layer_freq) and bool(self.moe_layer_freq[index])

    @property
    def all_layers_moe(self) -> bool:
        if self.num_layers is None:  # read_settings reads --num-layers, which Megatron requires
            raise TypeError("all_layers_moe needs --num-layers")
        return all(self.is_moe_layer(i) for i in range(self.num_layers))


# The plugin's own settings the rules read, with the values they take when the run has no config.
_PLUGIN_FIELDS = (
    "graph_banks",
    "slot_capture",
    "bank_min_cp",
    "thd_max_seqs",
    "thd_max_seqlen",
    "log_to_tensorboard",
    "inject_capture_failure",
)


def _plugin_config(
    args: Any, *, env: Mapping[str, str], config: PluginConfig | None = None
) -> tuple[PluginConfig | None, tuple[str, ...], Mapping[str, Any]]:
    """The plugin config in force: ``config`` when given (``install(config)``), defaults for a parser
    without the ``--cg-*`` flags, else the flags' (``config.config_from_args``). Returns it (None when
    the flags are refused), the problems that refused it, and the plugin values the rules read: the
    config's, or the flags as given when it was refused (so that the other rules still report)."""
    if config is None and not has_plugin_flags(args):
        config = PluginConfig()
    if config is not None:
        return config, (), {name: getattr(config, name) for name in _PLUGIN_FIELDS}
    try:
        config = config_from_args(args, environ=env)
    except ConfigError as error:
        given = {name: error.given[name] for name in _PLUGIN_FIELDS if name in error.given}
        return None, tuple(error.problems), given
    except ValueError as error:  # a parser with part of the --cg-* flags
        return None, (str(error),), {}
    return config, (), {name: getattr(config, name) for name in _PLUGIN_FIELDS}


def _value(option: Any) -> Any:
    """An enum-valued flag (``--fp8-recipe``, ``--attention-backend``) as its plain value."""
    return getattr(option, "value", option)


def _learning_rate_schedule(args: Any) -> LearningRateSchedule:
    """The schedule's flags, each under its args name (its default where the args lack it)."""
    given: dict[str, Any] = {
        field.name: getattr(args, field.name, field.default) for field in dataclasses.fields(LearningRateSchedule)
    }
    return LearningRateSchedule(**given)


def environment_settings(env: Mapping[str, str]) -> RunSettings:
    """The settings the environment alone decides (a run's defaults otherwise): what the rules on the
    environment read, which ``install()`` runs before Megatron's parser reads the same variables."""
    return RunSettings(
        unreadable_switches=tuple(
            f"{name}={env[name]}" for name in _ZERO_OR_ONE_SWITCHES if env.get(name, "0") not in ("0", "1")
        ),
        unusable_environment=environment_problems(env),
    )


def read_settings(
    args: Any,
    *,
    env: Mapping[str, str] | None = None,
    config: PluginConfig | None = None,
    te_available: bool = True,
    apex_fused_wgrad: bool = False,
    launcher: bool = False,
    device_capability: tuple[int, int] | None = None,
    cuda_version: tuple[int, int] | None = None,
) -> tuple[RunSettings, PluginConfig | None]:
    """Reads the run's settings from a parsed Megatron namespace (before or after ``validate_args``)
    under ``config`` (``_plugin_config``: an explicit config wins over the ``--cg-*`` flags); returns
    them and the plugin config in force (None: the flags were refused, and ``config_problems`` says
    why). ``te_available``, ``apex_fused_wgrad``, ``device_capability`` and ``cuda_version`` are what the caller
    probed on this host; ``read_run_settings`` probes them and adds the files, the checkpoint and what Megatron's
    builders make of the flags."""
    env = env or {}
    resolved, problems, plugin = _plugin_config(args, env=env, config=config)
    environment = environment_settings(env)
    freq = getattr(args, "moe_layer_freq", 1)
    mla_unfused = bool(
        getattr(args, "multi_latent_attention", False) and not getattr(args, "mla_down_proj_fusion", False)
    )
    attention_backend = getattr(args, "attention_backend", None)
    expert_parallel = getattr(args, "expert_model_parallel_size", None)  # 0 is kept: rule model-sizes refuses it
    data_path = getattr(args, "data_path", None)
    return RunSettings(
        cuda_graph_impl=getattr(args, "cuda_graph_impl", "none") or "none",
        modules=module_names(getattr(args, "cuda_graph_modules", None)),
        warmup_steps=getattr(args, "cuda_graph_warmup_steps", 3),
        transformer_impl=getattr(args, "transformer_impl", "transformer_engine"),
        num_layers=args.num_layers,
        num_experts=getattr(args, "num_experts", None),
        moe_layer_freq=freq if isinstance(freq, int) else tuple(freq),
        capacity_factor=getattr(args, "moe_expert_capacity_factor", None),
        pad_to_capacity=bool(getattr(args, "moe_pad_expert_input_to_capacity", False)),
        dispatcher=getattr(args, "moe_token_dispatcher_type", "allgather"),
        router_padding_for_fp8=bool(getattr(args, "moe_router_padding_for_fp8", False)),
        recompute_granularity=getattr(args, "recompute_granularity", None),
        recompute_modules=tuple(getattr(args, "recompute_modules", None) or ()),
        cpu_offloading=bool(getattr(args, "cpu_offloading", False)),
        gradient_accumulation_fusion=bool(getattr(args, "gradient_accumulation_fusion", False)),
        apex_fused_wgrad=apex_fused_wgrad,
        hybrid_context_parallel=bool(getattr(args, "hybrid_context_parallel", False)),
        graph_banks=bool(plugin.get("graph_banks", False)),
        slot_capture=bool(plugin.get("slot_capture", False)),
        log_to_tensorboard=bool(plugin.get("log_to_tensorboard", False)),
        tensorboard_dir=getattr(args, "tensorboard_dir", None),
        save=getattr(args, "save", None),
        data_cache_path=getattr(args, "data_cache_path", None),
        inject_capture_failure=plugin.get("inject_capture_failure"),
        bank_min_cp=plugin.get("bank_min_cp", 1) or 1,
        position_embedding_type=getattr(args, "position_embedding_type", "learned_absolute"),
        apply_rope_fusion=bool(getattr(args, "apply_rope_fusion", True)),
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        activation_offloading=bool(getattr(args, "fine_grained_activation_offloading", False)),
        offload_modules=tuple(getattr(args, "offload_modules", None) or ()),
        delay_wgrad_compute=bool(getattr(args, "delay_wgrad_compute", False)),
        overlap_moe_expert_parallel_comm=bool(getattr(args, "overlap_moe_expert_parallel_comm", False)),
        tensor_parallel=getattr(args, "tensor_model_parallel_size", 1),
        pipeline_parallel=getattr(args, "pipeline_model_parallel_size", 1),
        virtual_pipeline=getattr(args, "virtual_pipeline_model_parallel_size", None),
        context_parallel=getattr(args, "context_parallel_size", 1),
        world_size=getattr(args, "world_size", 1) or 1,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=getattr(args, "global_batch_size", None),
        te_available=te_available,
        expandable_segments=expandable_segments(env),
        nccl_graph_register_off=env.get("NCCL_GRAPH_REGISTER", "") == "0",
        fp8=getattr(args, "fp8", None) is not None,
        fp8_recipe=str(_value(getattr(args, "fp8_recipe", None)) or "delayed"),
        input_norm_fused=not mla_unfused,
        fp8_attention=bool(
            getattr(args, "fp8_dot_product_attention", False) or getattr(args, "fp8_multi_head_attention", False)
        ),
        te_op_fuser=bool(getattr(args, "use_transformer_engine_op_fuser", False)),
        te_op_norms=bool(getattr(args, "num_experts", None))
        or bool(getattr(args, "qk_layernorm", False))
        or mla_unfused,
        fp8_multi_head_attention=bool(getattr(args, "fp8_multi_head_attention", False)),
        fp4=getattr(args, "fp4", None) is not None,
        device_capability=device_capability,
        cuda_version=cuda_version,
        sft=bool(getattr(args, "sft", False)),
        moe_topk=2 if getattr(args, "moe_router_topk", None) is None else args.moe_router_topk,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        launcher=launcher,
        rerun_mode=getattr(args, "rerun_mode", "disabled") or "disabled",
        inter_document_masking=bool(getattr(args, "dataloader_inter_document_masking", False)),
        thd_max_seqs=plugin.get("thd_max_seqs"),
        thd_max_seqlen=plugin.get("thd_max_seqlen"),
        seq_length=getattr(args, "seq_length", None),
        max_position_embeddings=getattr(args, "max_position_embeddings", None),
        vocab_size=getattr(args, "vocab_size", None),
        tokenizer_type=getattr(args, "tokenizer_type", None),
        tokenizer_model=getattr(args, "tokenizer_model", None),
        vocab_file=getattr(args, "vocab_file", None),
        merge_file=getattr(args, "merge_file", None),
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
        num_attention_heads=getattr(args, "num_attention_heads", None),
        deterministic=bool(getattr(args, "deterministic_mode", False))
        or env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0",
        multi_latent_attention=bool(getattr(args, "multi_latent_attention", False)),
        max_seqlen_per_dp_cp_rank=getattr(args, "max_seqlen_per_dp_cp_rank", None),
        hidden_size=getattr(args, "hidden_size", None),
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        kv_channels=getattr(args, "kv_channels", None),
        group_query_attention=bool(getattr(args, "group_query_attention", False)),
        num_query_groups=getattr(args, "num_query_groups", None),
        swiglu=bool(getattr(args, "swiglu", False)),
        quick_geglu=bool(getattr(args, "quick_geglu", False)),
        add_bias_linear=bool(getattr(args, "add_bias_linear", True)),
        normalization=getattr(args, "normalization", "LayerNorm"),
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        hidden_dropout=getattr(args, "hidden_dropout", 0.0),
        attention_backend=None
        if attention_backend is None
        else str(getattr(attention_backend, "name", attention_backend)),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        fp8_dot_product_attention=bool(getattr(args, "fp8_dot_product_attention", False)),
        first_last_layers_bf16=bool(getattr(args, "first_last_layers_bf16", False)),
        num_layers_at_start_in_bf16=getattr(args, "num_layers_at_start_in_bf16", 1),
        num_layers_at_end_in_bf16=getattr(args, "num_layers_at_end_in_bf16", 1),
        expert_parallel=1 if expert_parallel is None else expert_parallel,
        expert_tensor_parallel=getattr(args, "expert_tensor_parallel_size", None),
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        moe_shared_expert_overlap=bool(getattr(args, "moe_shared_expert_overlap", False)),
        moe_router_dtype=getattr(args, "moe_router_dtype", None),
        min_offloaded_tensor_size=getattr(args, "min_offloaded_tensor_size", None),
        activation_offload_fraction=getattr(args, "activation_offload_fraction", 1.0),
        graph_only_flags=graph_only_flags(resolved) if resolved is not None else (),
        config_problems=problems,
        unreadable_switches=environment.unreadable_switches,
        unusable_environment=environment.unusable_environment,
        load=getattr(args, "load", None),
        unsafe_pickle_allowed=env.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE") == "1",
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128),
        weight_shards=getattr(args, "tensor_parallel_num_weight_shards", None),
        batch_size_varies=bool(
            getattr(args, "rampup_batch_size", None)
            or getattr(args, "step_batch_size_schedule", None)
            or getattr(args, "decrease_batch_size_if_needed", False)
        ),
        train_iters=getattr(args, "train_iters", None),
        train_samples=getattr(args, "train_samples", None),
        log_interval=getattr(args, "log_interval", 100),
        tensorboard_log_interval=getattr(args, "tensorboard_log_interval", 1),
        eval_interval=getattr(args, "eval_interval", 1000),
        eval_iters=getattr(args, "eval_iters", 100),
        save_interval=getattr(args, "save_interval", None),
        num_workers=getattr(args, "num_workers", 2),
        seed=getattr(args, "seed", 1234),
        data_parallel_random_init=bool(getattr(args, "data_parallel_random_init", False)),
        skip_train=bool(getattr(args, "skip_train", False)),
        full_validation=bool(getattr(args, "full_validation", False)),
        data_sources=tuple(
            flag
            for flag, name in _DATA_SOURCE_FLAGS
            if (value := getattr(args, name, None)) is not None and value is not False
        ),
        data_path=None if data_path is None else tuple(data_path),
        data_args_path=getattr(args, "data_args_path", None),
        per_split_data_args_path=getattr(args, "per_split_data_args_path", None),
        split=getattr(args, "split", None),
        mmap_bin_files=bool(getattr(args, "mmap_bin_files", True)),
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        create_attention_mask_in_dataloader=bool(getattr(args, "create_attention_mask_in_dataloader", True)),
        mid_level_dataset_surplus=getattr(args, "mid_level_dataset_surplus", 0.005),
        perform_rl_step=bool(getattr(args, "perform_rl_step", False)),
        no_load_optim=bool(getattr(args, "no_load_optim", False)),
        lr_schedule=_learning_rate_schedule(args),
        validated=hasattr(args, "data_parallel_size"),
    ), resolved


def _resumes_checkpoint(load: str | None) -> bool:
    """--load names a folder holding Megatron's tracker file (``latest_checkpointed_iteration.txt``): the run
    loads a checkpoint from it (without one Megatron starts from scratch)."""
    return load is not None and os.path.isfile(os.path.join(str(load), "latest_checkpointed_iteration.txt"))


def read_run_settings(
    args: Any,
    *,
    env: Mapping[str, str],
    launcher: bool = False,
    config: PluginConfig | None = None,
    te_present: bool | None = None,
) -> tuple[RunSettings, PluginConfig | None]:
    """The settings a run's validated flags are checked on (``rules.check_run``): ``read_settings`` with what
    this host has (TE, APEX's fused wgrad, the GPU, torch's CUDA), whether ``--load`` resumes a checkpoint, the
    files the flags name that do not exist (``data.sources.missing_files``) and what Megatron's own builders
    make of the flags on CPU (the tokenizer, the optimizer setup and, for the launcher's datasets, the blend
    and split: ``megatron_builds``). ``te_present`` overrides the probe (the CPU dry run checks flags for a GPU
    host it is not running on)."""
    settings, resolved = read_settings(
        args,
        env=env,
        config=config,
        te_available=compat.te_available() if te_present is None else te_present,
        apex_fused_wgrad=compat.apex_fused_wgrad_available(),
        launcher=launcher,
        device_capability=compat.device_capability(),
        cuda_version=compat.torch_cuda_version(),
    )
    return dataclasses.replace(
        settings,
        missing_files=tuple(missing_data_files(settings, args, indexed_data=launcher)),
        resumes_checkpoint=_resumes_checkpoint(settings.load),
        tokenizer_problem=megatron_builds.tokenizer_problem(settings, args),
        optimizer_problem=megatron_builds.optimizer_problem(settings, args),
        # A script's own loader may read other data (as rule data-files reads only the launcher's prefixes)
        dataset_problem=megatron_builds.dataset_problem(settings, args) if launcher else None,
    ), resolved
