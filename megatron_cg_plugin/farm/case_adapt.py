"""A Megatron functional-test case made runnable here: flags that need infrastructure the farm does
not have (checkpoints, TensorBoard, W&B, the CI's data mounts) are mapped to what is at hand or
dropped, each with the reason, before ``--fit-gpus`` scales the parallel sizes (pure Python).

- Checkpoint flags: a ``ckpt-resume`` case keeps its format and options, but its folders and
  ``--save-interval`` are the farm's (each run saves into its own folder, at the step the second half
  resumes from), and what starts from another checkpoint (``--pretrained-checkpoint``,
  ``--finetune``, a conversion) goes; any other case keeps no checkpoint, so they all go.
- TensorBoard and W&B flags are dropped: the farm's metrics come from the plugin's
  ``--cg-metrics-out``, in the golden-values schema Megatron's CI reads from TensorBoard.
- Data: with ``data_path`` every ``${DATA_PATH}`` resolves to it (the files must exist: the
  ``data-files`` rule says which do not); without, the data and tokenizer flags make way for mock
  data and ``NullTokenizer`` with the case's vocabulary size.
- ``--train-iters`` (and the sample-based schedule flags), ``--exit-interval``,
  ``--exit-duration-in-mins`` and ``--cuda-graph-impl`` are the farm's: it sets the steps and runs
  the case once eager and once graphed.
- Without APEX's fused weight-gradient kernel on this host, ``--no-gradient-accumulation-fusion``
  is added (Megatron's default needs it; the ``gradient-accumulation-fusion`` rule says so).
- What ``--deterministic-mode`` refuses (fused cross-entropy, TP communication overlap, a
  non-deterministic ``NVTE_ALLOW_NONDETERMINISTIC_ALGO``) goes: eager and graphed are compared bit
  for bit.
Any other placeholder is left for ``render_flags`` to refuse by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_cg_plugin.inputs import expandable_segments

__all__ = ["DETERMINISTIC_ENV", "NONDETERMINISTIC_FLAGS", "adapt_case_args", "adapt_case_env"]

_CHECKPOINT_FLAGS = (
    "--save",
    "--load",
    "--save-interval",
    "--async-save",
    "--use-persistent-ckpt-worker",
    "--ckpt-format",
    "--ckpt-fully-parallel-load",
    "--ckpt-fully-parallel-save",
    "--ckpt-assume-constant-structure",
    "--use-checkpoint-opt_param-scheduler",
    "--dist-ckpt-optim-fully-reshardable",
    "--dist-ckpt-strictness",
    "--auto-detect-ckpt-format",
    "--pretrained-checkpoint",
    "--finetune",
    "--no-load-optim",
    "--no-load-rng",
    "--ckpt-convert-save",
    "--ckpt-convert-format",
    "--non-persistent-save-interval",
)
# What a resume case still drops: the farm's own folders and save step, and what starts from elsewhere.
_FARM_CHECKPOINT_FLAGS = ("--save", "--load", "--save-interval")
_FOREIGN_CHECKPOINT_FLAGS = ("--pretrained-checkpoint", "--finetune", "--ckpt-convert-save", "--ckpt-convert-format")
_LOGGER_FLAGS = (
    "--tensorboard-dir",
    "--tensorboard-log-interval",
    "--tensorboard-queue-size",
    "--wandb-project",
    "--wandb-exp-name",
    "--wandb-save-dir",
    "--wandb-entity",
)
_DATA_FLAGS = (
    "--data-path",
    "--data-cache-path",
    "--vocab-file",
    "--merge-file",
    "--tokenizer-type",
    "--tokenizer-model",
    "--data-args-path",
    "--per-split-data-args-path",
    "--train-data-path",
    "--valid-data-path",
    "--test-data-path",
    "--mock-data",
    "--object-storage-cache-path",
)
_FARM_OWNED_FLAGS = (
    "--train-iters",
    "--exit-interval",
    "--exit-duration-in-mins",
    "--cuda-graph-impl",
    "--train-samples",
    "--lr-decay-samples",
    "--lr-warmup-samples",
    "--lr-wsd-decay-samples",
)
# What the farm's --deterministic-mode refuses (megatron/training/determinism.py, core 0.19.2:
# ARG_VALUES_REQUIRED_FOR_DETERMINISM, ACCEPTED_ENV_VAR_VALUES; a unit test holds these to it).
NONDETERMINISTIC_FLAGS = {
    "--cross-entropy-loss-fusion": "cross_entropy_loss_fusion",
    "--tp-comm-overlap": "tp_comm_overlap",
}
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}
_MOCK_VOCAB_SIZE = 32768  # NullTokenizer's vocabulary when the case names none (GPT-2 BPE rounds to 50304)


def _is_logger_flag(flag: str) -> bool:
    return flag in _LOGGER_FLAGS or flag.endswith("-to-tensorboard") or flag.startswith("--wandb-")


def adapt_case_args(
    model_args: Mapping[str, Any], *, data_path: str | None, out_dir: Path, apex_wgrad: bool, resumes: bool = False
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The case's ``MODEL_ARGS`` for a farm run; returns them, the placeholders the farm resolves,
    and one line per flag changed or dropped. ``apex_wgrad``: APEX's fused weight-gradient kernel
    is installed where the case runs; ``resumes``: a ckpt-resume case, whose checkpoint options stay."""
    args: dict[str, Any] = {}
    changes: list[str] = []
    checkpoint_reasons = (
        [
            (lambda flag: flag in _FARM_CHECKPOINT_FLAGS, "the farm gives each run its folders and save step"),
            (lambda flag: flag in _FOREIGN_CHECKPOINT_FLAGS, "the farm starts from no other checkpoint"),
        ]
        if resumes
        else [(lambda flag: flag in _CHECKPOINT_FLAGS, "the farm keeps no checkpoint")]
    )
    reasons = [
        *checkpoint_reasons,
        (_is_logger_flag, "metrics come from --cg-metrics-out, not TensorBoard or W&B"),
        (lambda flag: flag in _FARM_OWNED_FLAGS, "the farm sets the steps and runs eager and graphed"),
        (
            lambda flag: flag in NONDETERMINISTIC_FLAGS,
            "--deterministic-mode refuses it (eager == graphed is compared bit for bit)",
        ),
        (lambda flag: data_path is None and flag in _DATA_FLAGS, "mock data (no --data-path given)"),
    ]
    for flag, value in model_args.items():
        reason = next((why for matches, why in reasons if matches(flag)), None)
        if reason is None or value is False:
            args[flag] = value
        else:
            changes.append(f"{flag} dropped: {reason}")
    if not apex_wgrad and args.get("--no-gradient-accumulation-fusion") is not True:
        args["--no-gradient-accumulation-fusion"] = True
        changes.append(
            "--no-gradient-accumulation-fusion added: APEX's fused weight-gradient kernel, which "
            "Megatron's default --gradient-accumulation-fusion needs, is not installed here"
        )
    placeholders = {"DATA_CACHE_PATH": str(out_dir / "data_cache")}
    if data_path is None:
        vocab = args.get("--vocab-size", _MOCK_VOCAB_SIZE)
        args.update({"--mock-data": True, "--tokenizer-type": "NullTokenizer", "--vocab-size": vocab})
        changes.append(
            f"--mock-data --tokenizer-type NullTokenizer --vocab-size {vocab} added (pass --data-path "
            "DIR for the case's own dataset, DIR standing for ${DATA_PATH})"
        )
    else:
        placeholders["DATA_PATH"] = data_path
    return args, placeholders, changes


def adapt_case_env(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The case's ``ENV_VARS`` with the values ``--deterministic-mode`` refuses set to its own, and
    ``NCCL_GRAPH_REGISTER=0`` beside ``expandable_segments:True`` (the graphed run needs it: rule
    ``expandable-segments``, and Megatron asserts it)."""
    env = dict(env)
    changes = []
    for name, accepted in DETERMINISTIC_ENV.items():
        if name in env and env[name] not in accepted:
            changes.append(f"{name}={env[name]} -> {accepted[0]}: --deterministic-mode refuses it")
            env[name] = accepted[0]
    if expandable_segments(env) and env.get("NCCL_GRAPH_REGISTER") != "0":
        env["NCCL_GRAPH_REGISTER"] = "0"
        changes.append(
            "NCCL_GRAPH_REGISTER=0 added: PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which "
            "corrupts memory under CUDA graphs otherwise (rule expandable-segments)"
        )
    return env, changes
