"""Farm cases as data, in Megatron's functional-test format (first part: load, validate, render).

A case is a folder holding Megatron's ``model_config.yaml`` (``ENV_VARS``, ``MODEL_ARGS`` in
Megatron's flag spellings, optional ``METRICS``, ``TEST_TYPE``, ``MODE``) beside its
``golden_values_*.json``. The plugin's own additions are ``--cg-*`` flags in ``MODEL_ARGS`` and one
``CG_FARM`` block (ranks, comparison, expected refusals). Files are read with ``yaml.safe_load``;
nothing in a case file executes: Megatron's ``BEFORE_SCRIPT``/``AFTER_SCRIPT`` hooks are refused,
as are unknown keys and placeholders (``${DATA_PATH}``) that nothing resolves.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megatron_cg_plugin.inputs import input_path_problem

__all__ = [
    "CASE_FILE",
    "CaseError",
    "FarmSettings",
    "MEGATRON_CI_GPUS",
    "SIZE_NEEDS",
    "fit_gpus",
    "load_case",
    "render_flags",
]

CASE_FILE = "model_config.yaml"
# Megatron's model_config.yaml keys (core_r0.19.0's test cases), and what the farm does with each.
_KNOWN_KEYS = frozenset(
    {
        "ENV_VARS",
        "MODEL_ARGS",
        "METRICS",
        "TEST_TYPE",
        "MODE",
        "LAUNCHER",
        "BEFORE_SCRIPT",
        "AFTER_SCRIPT",
        "THROUGHPUT_TEST_PARAMS",
        "TEST_EVALUATION",
        "MODEL_ENV_VARS",
        "CG_FARM",
    }
)
_NEVER_RUN = {
    "BEFORE_SCRIPT": "the farm runs no script from a case file",
    "AFTER_SCRIPT": "the farm runs no script from a case file",
}
_SUPPORTED_MODES = ("pretraining",)
# ckpt-resume as Megatron's CI runs it: a first half that saves, and a second that resumes in a new process.
RESUME_TEST_TYPE = "ckpt-resume"
_SUPPORTED_TEST_TYPES = ("regular", "release", RESUME_TEST_TYPE)
_FARM_KEYS = frozenset(
    {
        "nproc",
        "compare",
        "expect_refusal",
        "steps",
        "script",
        "data",
        "expect_capture_failure",
        "golden_case",
        "golden_metrics",
        "deterministic_mode",
        "eager_offload",
        "pool_prediction_tolerance",
        "resume_from_exit",
    }
)
_FARM_DATA = ("synthetic", "sentencepiece", "sft")
_COMPARISONS = ("golden", "eager-only")
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class CaseError(ValueError):
    """A case file the farm cannot run; the message names the file, the key and the fix."""


@dataclasses.dataclass(frozen=True)
class FarmSettings:
    """The ``CG_FARM`` block: ranks, whether the golden file is compared or eager vs graphed only,
    rule names the graphed run is expected to be refused with (a negative case), and how the farm
    runs the case: steps, a training script run through ``megatron-cg run`` (repository path),
    a real dataset the farm builds (``synthetic`` or ``sentencepiece``), an injected capture failure
    the graphed run must survive, the case (and metrics) whose golden file it is held to, and
    whether both runs pass Megatron's ``--deterministic-mode`` (false only for kernels this host runs
    only with non-deterministic algorithms allowed: eager vs graphed is still compared bit for bit,
    the golden file with Megatron's non-deterministic tolerances), and whether the eager run keeps
    Megatron's fine-grained offload flags (false: the eager reference trains without offload, which
    moves saves but changes no value; for models where Megatron's eager offload is not reproducible
    run to run). ``resume_from_exit`` (ckpt-resume cases): the first half ends at the middle step by
    --exit-interval, saving on that graceful exit, instead of training every step and saving by
    --save-interval (Megatron's convention)."""

    nproc: int = 1
    compare: str = "golden"
    expect_refusal: tuple[str, ...] = ()
    steps: int | None = None
    script: str | None = None
    data: str | None = None
    expect_capture_failure: bool = False
    golden_case: str | None = None
    golden_metrics: tuple[str, ...] = ()
    deterministic_mode: bool = True
    eager_offload: bool = True
    pool_prediction_tolerance: float | None = None  # the report's pool prediction held to the measured pool
    resume_from_exit: bool = False


@dataclasses.dataclass(frozen=True)
class _Case:
    name: str
    folder: Path
    env: dict[str, str]
    model_args: dict[str, Any]
    metrics: tuple[str, ...] | None
    farm: FarmSettings
    plugin_case: bool = True  # has a CG_FARM block (written for this farm), not one of Megatron's own
    test_type: str = "regular"

    @property
    def resumes(self) -> bool:
        return self.test_type == RESUME_TEST_TYPE

    def flags(self, placeholders: Mapping[str, str]) -> list[str]:
        """``MODEL_ARGS`` as a command line, placeholders resolved from ``placeholders``."""
        return render_flags(self.model_args, placeholders, where=f"{self.folder / CASE_FILE}")


def _refuse(path: Path, message: str) -> CaseError:
    return CaseError(f"{path}: {message}")


def load_case(folder: str | Path) -> _Case:
    """Reads and validates ``folder/model_config.yaml``; raises ``CaseError`` naming what to fix."""
    import yaml

    problem = input_path_problem("the case folder", folder, folder=True)
    if problem is not None:
        raise CaseError(problem)
    folder = Path(folder)
    path = folder / CASE_FILE
    if not path.is_file():
        raise CaseError(f"{folder} holds no {CASE_FILE}: a case is a folder with Megatron's model_config.yaml.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise _refuse(path, f"is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise _refuse(path, "must be a mapping with ENV_VARS and MODEL_ARGS.")
    unknown = sorted(set(data) - _KNOWN_KEYS)
    if unknown:
        raise _refuse(
            path,
            f"unknown key(s) {unknown}; Megatron's case files use {sorted(_KNOWN_KEYS - {'CG_FARM'})}, "
            "and the plugin adds CG_FARM.",
        )
    for key, reason in _NEVER_RUN.items():
        if key in data:
            raise _refuse(path, f"{key} is refused: {reason}; move what it prepares into the environment.")
    mode = data.get("MODE", "pretraining")
    if mode not in _SUPPORTED_MODES:
        raise _refuse(path, f"MODE {mode!r} is not run by the farm (it runs {', '.join(_SUPPORTED_MODES)}).")
    test_type = str(data.get("TEST_TYPE", "regular")).strip()
    if test_type not in _SUPPORTED_TEST_TYPES:
        raise _refuse(
            path,
            f"TEST_TYPE {test_type!r} needs a checkpoint from an earlier run, which the farm does "
            f"not keep; use one of {', '.join(_SUPPORTED_TEST_TYPES)}.",
        )
    model_args = data.get("MODEL_ARGS")
    if not isinstance(model_args, dict) or not model_args:
        raise _refuse(path, "MODEL_ARGS must map Megatron flags (--num-layers: 2, ...) to their values.")
    bad = [key for key in model_args if not isinstance(key, str) or not key.startswith("--")]
    if bad:
        raise _refuse(path, f"MODEL_ARGS keys must be flags spelled as Megatron spells them (--flag), got {bad}.")
    env = data.get("ENV_VARS") or {}
    if not isinstance(env, dict):
        raise _refuse(path, "ENV_VARS must map variable names to values.")
    metrics = data.get("METRICS")
    if metrics is not None and (not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics)):
        raise _refuse(path, 'METRICS must be a list of metric names ("lm loss", "num-zeros", ...).')
    return _Case(
        name=folder.name,
        folder=folder,
        env={str(k): _env_value(v) for k, v in env.items()},
        model_args=dict(model_args),
        metrics=None if metrics is None else tuple(metrics),
        farm=_farm_settings(path, data.get("CG_FARM") or {}),
        plugin_case="CG_FARM" in data,
        test_type=test_type,
    )


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _farm_settings(path: Path, block: Any) -> FarmSettings:
    if not isinstance(block, dict):
        raise _refuse(path, "CG_FARM must be a mapping (nproc, compare, expect_refusal, ...).")
    unknown = sorted(set(block) - _FARM_KEYS)
    if unknown:
        raise _refuse(path, f"CG_FARM has unknown key(s) {unknown}; use {sorted(_FARM_KEYS)}.")
    for key in ("nproc", "steps"):
        value = block.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(path, f"CG_FARM {key} {value!r} must be an integer >= 1.")
    compare = block.get("compare", "golden")
    if compare not in _COMPARISONS:
        raise _refuse(path, f"CG_FARM compare {compare!r} is unknown; use one of {', '.join(_COMPARISONS)}.")
    data = block.get("data")
    if data is not None and data not in _FARM_DATA:
        raise _refuse(
            path,
            f"CG_FARM data {data!r} is unknown; use one of {', '.join(_FARM_DATA)} (or --data-path "
            "in MODEL_ARGS for a dataset of your own).",
        )
    for key in ("expect_capture_failure", "deterministic_mode", "eager_offload", "resume_from_exit"):
        if not isinstance(block.get(key, False), bool):
            raise _refuse(path, f"CG_FARM {key} must be true or false.")
    tolerance = block.get("pool_prediction_tolerance")
    if tolerance is not None and (
        isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1
    ):
        raise _refuse(
            path,
            f"CG_FARM pool_prediction_tolerance {tolerance!r} must be a fraction between 0 and 1 (0.15: within 15%).",
        )
    return FarmSettings(
        nproc=block.get("nproc", 1),
        compare=compare,
        expect_refusal=_names(block, "expect_refusal"),
        steps=block.get("steps"),
        script=block.get("script"),
        data=data,
        expect_capture_failure=block.get("expect_capture_failure", False),
        golden_case=block.get("golden_case"),
        golden_metrics=_names(block, "golden_metrics"),
        deterministic_mode=block.get("deterministic_mode", True),
        eager_offload=block.get("eager_offload", True),
        pool_prediction_tolerance=None if tolerance is None else float(tolerance),
        resume_from_exit=block.get("resume_from_exit", False),
    )


def _names(block: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = block.get(key) or []
    return (value,) if isinstance(value, str) else tuple(str(item) for item in value)


def _values(flag: str, value: Any) -> list[str]:
    """One MODEL_ARGS entry's values on the command line, as Megatron's functional tests render it:
    true is the bare flag, false leaves it out, "[a b]" is a list of values."""
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, list):
        return [flag, *(str(item) for item in value)]
    text = str(value)
    if text.startswith("[") and text.endswith("]"):
        return [flag, *text[1:-1].split()]
    return [flag, text]


def render_flags(model_args: Mapping[str, Any], placeholders: Mapping[str, str], *, where: str) -> list[str]:
    """``MODEL_ARGS`` as a command line, every ``${NAME}`` replaced from ``placeholders``; raises
    ``CaseError`` naming each placeholder nothing resolves."""
    flags: list[str] = []
    unresolved: set[str] = set()
    for flag, value in model_args.items():
        for token in _values(flag, value):
            names = _PLACEHOLDER.findall(token)
            unresolved.update(name for name in names if name not in placeholders)
            flags.append(_PLACEHOLDER.sub(lambda m: placeholders.get(m.group(1), m.group(0)), token))
    if unresolved:
        raise CaseError(
            f"{where}: placeholder(s) {', '.join('${' + n + '}' for n in sorted(unresolved))} are not "
            "resolved; give their values (e.g. --data-path for ${DATA_PATH}) or drop the flags that use them."
        )
    return flags


# ---------------------------------------------------------------------------------------------- --fit-gpus
_PARALLEL_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
    "etp": "--expert-tensor-parallel-size",
}
# Flags that describe the case's pipeline stage by stage; they go when PP changes (a layout of 4 stages
# is wrong for 2, and none of them means anything at PP 1).
_PIPELINE_ONLY_FLAGS = (
    "--virtual-pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--microbatch-group-size-per-virtual-pipeline-stage",
    "--pipeline-model-parallel-layout",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--num-layers-in-first-pipeline-stage",
    "--num-layers-in-last-pipeline-stage",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--overlap-p2p-comm-warmup-flush",
)
# Megatron's flex token dispatcher (DeepEP, NCCL EP) needs TP x EP > 1 (token_dispatcher.py); its
# backend's own flags go with it.
_FLEX_DISPATCHER_FLAGS = (
    "--moe-flex-dispatcher-backend",
    "--moe-enable-deepep",
    "--moe-deepep-num-sms",
    "--moe-hybridep-num-sms",
    "--moe-flex-dispatcher-num-sms",
    "--moe-permute-fusion-into-hybridep",
)


@dataclasses.dataclass(frozen=True)
class _SizeNeed:
    """A flag that needs parallel sizes the fitted run may not have: ``keeps(new, old)`` says whether
    it still fits; ``why(new, old)`` says why it goes."""

    flag: str
    keeps: Callable[[Mapping[str, int], Mapping[str, int]], bool]
    why: Callable[[Mapping[str, int], Mapping[str, int]], str]


def _ep_overlap_why(new: Mapping[str, int], old: Mapping[str, int]) -> str:
    return f"EP {old['ep']} -> {new['ep']}: Megatron overlaps expert-parallel communication only with EP > 1"


SIZE_NEEDS: tuple[_SizeNeed, ...] = (
    *(
        _SizeNeed(flag, lambda new, old: new["pp"] == old["pp"], lambda new, old: f"PP {old['pp']} -> {new['pp']}")
        for flag in _PIPELINE_ONLY_FLAGS
    ),
    _SizeNeed("--sequence-parallel", lambda new, old: new["tp"] > 1, lambda new, old: "TP 1"),
    # Megatron refuses these without EP overlap, which needs EP > 1 (transformer_config.py).
    *(
        _SizeNeed(flag, lambda new, old: new["ep"] > 1 or new["ep"] == old["ep"], _ep_overlap_why)
        for flag in (
            "--overlap-moe-expert-parallel-comm",
            "--delay-wgrad-compute",
            "--ep-overlap-early-attn-memory-release",
        )
    ),
    # Written for the case's CP size: a hierarchy of CP groups, a communication type per layer or a2a+p2p.
    *(
        _SizeNeed(flag, lambda new, old: new["cp"] == old["cp"], lambda new, old: f"CP {old['cp']} -> {new['cp']}")
        for flag in ("--hierarchical-context-parallel-sizes", "--cp-comm-type")
    ),
)
MEGATRON_CI_GPUS = 8  # Megatron's functional cases run on one 8-GPU node unless they say otherwise


def _size(model_args: Mapping[str, Any], flag: str) -> int:
    """A size flag of ``MODEL_ARGS`` as a whole number (1 where it is not given)."""
    value = model_args.get(flag, 1)
    if value in (None, False):
        return 1
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CaseError(f"MODEL_ARGS {flag} {value!r} is not a whole number; give one, e.g. {flag}: 2.") from None


def _shrink(sizes: dict[str, int], order: tuple[str, ...], fits: Any) -> None:
    """Halves (an odd size: to 1) the first of ``order`` above 1 until ``fits()``."""
    while not fits():
        name = next(name for name in order if sizes[name] > 1)
        sizes[name] = sizes[name] // 2 if sizes[name] % 2 == 0 else 1


def _fit_dispatcher(args: dict[str, Any], sizes: Mapping[str, int]) -> list[str]:
    """The flex token dispatcher, which needs TP x EP > 1, becomes alltoall where the fitted run has neither."""
    if args.get("--moe-token-dispatcher-type") != "flex" or sizes["tp"] * sizes["ep"] > 1:
        return []
    args["--moe-token-dispatcher-type"] = "alltoall"
    changes = [
        "--moe-token-dispatcher-type flex -> alltoall (TP x EP 1: Megatron's DeepEP and NCCL EP dispatchers "
        "need TP x EP > 1)"
    ]
    for flag in _FLEX_DISPATCHER_FLAGS:
        if args.get(flag) not in (None, False):
            changes.append(f"{flag} {args.pop(flag)!r} dropped (the flex dispatcher's)")
    return changes


def fit_gpus(
    model_args: Mapping[str, Any], gpus: int, *, from_gpus: int = MEGATRON_CI_GPUS
) -> tuple[dict[str, Any], list[str]]:
    """``MODEL_ARGS`` scaled down to ``gpus`` GPUs: PP, then CP, then TP halve until their product
    divides ``gpus``, EP then ETP likewise; flags that need the old sizes go (``SIZE_NEEDS``) and the
    flex dispatcher becomes alltoall without TP x EP > 1; the global batch keeps its
    microbatches per data-parallel rank (``from_gpus`` is what the case was written for). Returns
    the new arguments and one line per flag changed."""
    if gpus < 1:
        raise CaseError(f"--fit-gpus {gpus} must be >= 1.")
    args = dict(model_args)
    sizes = {name: _size(args, flag) for name, flag in _PARALLEL_FLAGS.items()}
    if "etp" not in {name for name, flag in _PARALLEL_FLAGS.items() if flag in args}:
        sizes["etp"] = sizes["tp"]  # Megatron defaults the expert TP size to TP
    before = dict(sizes)
    # Pipeline stages go first (their layout flags go with them), then CP, then TP; EP before ETP.
    _shrink(sizes, ("pp", "cp", "tp"), lambda: gpus % (sizes["tp"] * sizes["pp"] * sizes["cp"]) == 0)
    sizes["etp"] = min(sizes["etp"], sizes["tp"])
    _shrink(sizes, ("ep", "etp"), lambda: gpus % (sizes["ep"] * sizes["etp"] * sizes["pp"]) == 0)
    changes = []
    for name, flag in _PARALLEL_FLAGS.items():
        if sizes[name] != before[name] or (flag in args and _size(args, flag) != sizes[name]):
            changes.append(f"{flag} {before[name]} -> {sizes[name]}")
            args[flag] = sizes[name]
    for need in SIZE_NEEDS:
        if args.get(need.flag) not in (None, False) and not need.keeps(sizes, before):
            value = args.pop(need.flag)
            shown = "" if value is True else f" {value!r}"
            changes.append(f"{need.flag}{shown} dropped ({need.why(sizes, before)})")
    changes += _fit_dispatcher(args, sizes)
    old_dp = max(1, from_gpus // (before["tp"] * before["pp"] * before["cp"]))
    new_dp = gpus // (sizes["tp"] * sizes["pp"] * sizes["cp"])
    if "--global-batch-size" in args and old_dp != new_dp:
        old_gbs = _size(args, "--global-batch-size")
        new_gbs = max(_size(args, "--micro-batch-size") * new_dp, old_gbs * new_dp // old_dp)
        if new_gbs != old_gbs:
            args["--global-batch-size"] = new_gbs
            changes.append(
                f"--global-batch-size {old_gbs} -> {new_gbs} (data-parallel size {old_dp} -> {new_dp}, "
                "the same microbatches per step)"
            )
    return args, changes
