"""The GPU functional farm: each case trains the same model eagerly and with TE graphs on N ranks,
through the plugin's launcher or through ``megatron-cg run`` with a user's own Megatron script, on
mock data or on a real indexed dataset it builds, and compares the per-step metrics.

Cases are folders in Megatron's functional-test format under ``tests/functional/test_cases``
(``farm.cases``). Used by ``tests/functional/test_farm.py`` and ``ci/run_gpu_functional.sh``,
which writes the summary table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import shutil
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_cg_plugin import compat, golden, rules
from megatron_cg_plugin.config import PLUGIN_FLAGS
from megatron_cg_plugin.console import failure_cause
from megatron_cg_plugin.data import synthetic as synthetic_data
from megatron_cg_plugin.farm.case_adapt import adapt_case_args, adapt_case_env
from megatron_cg_plugin.farm.cases import CASE_FILE, MEGATRON_CI_GPUS, CaseError, fit_gpus, load_case, render_flags
from megatron_cg_plugin.farm.distributed import MultiRankError, launch
from megatron_cg_plugin.golden import GoldenValues, format_report
from megatron_cg_plugin.inputs import PROCESS_VARIABLES, checkout_from_environment
from megatron_cg_plugin.launch import dry_run
from megatron_cg_plugin.launch.presets import expand_preset, flag_value

__all__ = [
    "ACCEPT_GOLDEN_CHANGE",
    "CASES",
    "CASES_DIR",
    "CaseResult",
    "DEFAULT_PLATFORM",
    "FARM_STEPS",
    "FarmCase",
    "FarmRunError",
    "MEGATRON_LM_SCRIPT",
    "REPO",
    "case_folder",
    "case_folders",
    "data_flags",
    "differing_steps",
    "format_summary",
    "golden_file",
    "golden_mismatches",
    "golden_rewrite_refusal",
    "load_cases",
    "megatron_lm_dir_from_environment",
    "platform_of",
    "prepare_case",
    "problems_of",
    "Refusal",
    "refusal_of",
    "run_case",
    "without_graph_only_flags",
    "without_offload_flags",
]

FARM_STEPS = 24  # >= 20 steps, capture after Megatron's 3 warmup steps
REPO = Path(__file__).resolve().parents[2]
CASES_DIR = REPO / "tests" / "functional" / "test_cases"  # <model>/<case>/model_config.yaml beside its golden file
# Megatron keeps golden values per GPU (golden_values_{dev,lts}_dgx_<gpu>.json): kernels, and so the last bits of
# a loss, differ between GPUs. A run is held to its own GPU's file; this one where the GPU is not known.
DEFAULT_PLATFORM = "h200"
_USER_SCRIPT = "tests/functional/_scripts/user_pretrain_gpt.py"  # knows nothing of the plugin
# A case's script in a Megatron-LM checkout (its top-level pretrain_gpt.py, ...), found where MEGATRON_LM_DIR says.
MEGATRON_LM_SCRIPT = "${MEGATRON_LM_DIR}/"


def megatron_lm_dir_from_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """MEGATRON_LM_DIR, the Megatron-LM checkout whose scripts the cases run (None: unset); set but empty it
    is refused (a script path joined to it would be one in the current folder)."""
    return checkout_from_environment(
        "MEGATRON_LM_DIR", os.environ if environ is None else environ, what="a Megatron-LM core_r0.19.0 checkout"
    )


# Step times are measured and recorded, never asserted; the golden comparison covers the rest.
_GOLDEN_METRICS = ("lm loss", "num-zeros", "mem-allocated-bytes", "mem-max-allocated-bytes")
_TIMING_WINDOW = (5, 20)  # Megatron's iteration-time window
_DETERMINISTIC_METRICS = ("lm loss", "mtp_1 loss", "num-zeros")  # Megatron's DeterministicTest metrics (pretraining)
_VALIDATION_METRIC = "lm loss validation"  # the evaluations' lm loss, under Megatron's TensorBoard tag
_SFT_IMPORTS = ("transformers", "datasets")  # SFTTokenizer's and SFTDataset's (megatron.training.datasets.sft_dataset)


def golden_file(platform: str) -> str:
    return f"golden_values_dev_dgx_{platform}.json"


def platform_of(device_name: str) -> str:
    """The GPU in Megatron's golden-file naming (``NVIDIA H100 80GB HBM3`` -> ``h100``): the first word
    holding a digit after the vendor, lowercased (``GB200``, ``A100``, ``L40S``)."""
    words = [word for word in device_name.replace("-", " ").split() if word.upper() != "NVIDIA"]
    named = next((word for word in words if any(ch.isdigit() for ch in word)), words[0] if words else "gpu")
    return "".join(ch for ch in named.lower() if ch.isalnum())


def data_flags(data: str | None, out_dir: Path) -> tuple[str, ...]:
    """Builds the case's real indexed dataset under ``out_dir`` (once) and returns its flags.
    ``synthetic``: seeded pre-tokenized documents (NullTokenizer, the same bytes everywhere);
    ``sentencepiece``: text tokenized by a SentencePiece model trained on it here; ``sft``: packed
    conversations and a word-level tokenizer for Megatron's ``--sft`` path (``synthetic_data.write_sft_dataset``)."""
    if data is None:
        return ()
    root = out_dir / "data"
    if data == "synthetic":
        prefix = root / "synthetic_text_document"
        if not prefix.with_suffix(".idx").exists():
            synthetic_data.write_indexed_dataset(
                prefix, synthetic_data.synthetic_documents(400, vocab_size=1024, seed=1234), eod=1023
            )
        return (
            "--data-path",
            str(prefix),
            "--split",
            "98,2,0",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1024",
        )
    if data == "sentencepiece":
        prefix, model = root / "spm_text_document", root / "spm.model"
        if not prefix.with_suffix(".idx").exists():
            corpus = synthetic_data.synthetic_corpus(400, seed=1234)
            synthetic_data.train_sentencepiece(corpus, root / "spm")
            documents, eod = synthetic_data.tokenize_corpus(corpus, model)
            synthetic_data.write_indexed_dataset(prefix, documents, eod=eod)
        return (
            "--data-path",
            str(prefix),
            "--split",
            "98,2,0",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(model),
        )
    if data == "sft":
        dataset, tokenizer = root / "sft.jsonl", root / "sft_tokenizer"
        if not dataset.exists():
            dataset, tokenizer = synthetic_data.write_sft_dataset(root, samples=400, seed=1234)
        return (*synthetic_data.sft_flags(dataset, tokenizer), "--split", "98,2,0")
    raise ValueError(f"unknown farm data {data!r}: use synthetic, sentencepiece or sft")


@dataclasses.dataclass(frozen=True)
class FarmCase:
    """One farm case, read from its folder (``farm.cases``: Megatron's ``model_config.yaml`` with
    a ``CG_FARM`` block). ``expect_capture_failure``: the graphed run injects a capture failure and
    must fall back to eager training (graphs 0, the failure in its report). ``golden_case`` names the
    case whose golden file this one is compared with (default: its own), on ``golden_metrics``;
    with ``check_golden`` False the case compares eager with graphed only. ``script`` runs a
    training script through ``megatron-cg run`` instead of the launcher; ``data`` trains on a real
    indexed dataset the farm builds (``data_flags``)."""

    name: str
    nproc: int
    flags: tuple[str, ...]
    folder: Path
    expect_capture_failure: bool = False
    golden_case: str | None = None
    golden_metrics: tuple[str, ...] = ()
    steps: int = FARM_STEPS
    env: tuple[tuple[str, str], ...] = ()  # extra environment of both runs
    script: str | None = None
    data: str | None = None
    check_golden: bool = True
    deterministic_mode: bool = True  # both runs pass Megatron's --deterministic-mode
    eager_offload: bool = True  # the eager run keeps Megatron's fine-grained offload flags (else drops them)
    # Compared eager vs graphed at every step, bit for bit: lm loss, and the case's METRICS that
    # Megatron checks deterministically (mtp_1 loss, num-zeros).
    equal_metrics: tuple[str, ...] = ("lm loss",)
    megatron_lm_dir: str | None = None  # the Megatron-LM checkout a ${MEGATRON_LM_DIR}/ script is in
    # The graphed run's pool predicted within this fraction of the measured one (None: not checked).
    pool_prediction_tolerance: float | None = None
    resumes: bool = False  # TEST_TYPE ckpt-resume: a first half that saves, a second that resumes from it
    resume_from_exit: bool = False  # the first half ends at the middle step by --exit-interval, saving on exit
    platform: str = DEFAULT_PLATFORM  # the GPU whose golden file the runs are held to

    @property
    def script_file(self) -> Path | None:
        """The script ``megatron-cg run`` runs (None: the launcher). Raises ``CaseError`` naming
        MEGATRON_LM_DIR for a Megatron-LM script without a checkout to find it in."""
        if self.script is None:
            return None
        if not self.script.startswith(MEGATRON_LM_SCRIPT):
            return REPO / self.script
        if self.megatron_lm_dir is None:
            raise CaseError(
                f"{self.name} runs Megatron-LM's {self.script[len(MEGATRON_LM_SCRIPT) :]}: set "
                "MEGATRON_LM_DIR to a Megatron-LM core_r0.19.0 checkout (its top-level scripts)."
            )
        return Path(self.megatron_lm_dir) / self.script[len(MEGATRON_LM_SCRIPT) :]

    def unmet(self) -> str | None:
        """Why this host cannot run the case beyond its GPUs (a Megatron-LM script not found, the imports of
        Megatron's --sft path missing), or None."""
        try:
            script = self.script_file
        except CaseError as error:
            return str(error)
        if script is not None and not script.is_file():
            return f"{self.name}: no script at {script}"
        missing = [
            name for name in (_SFT_IMPORTS if self.data == "sft" else ()) if importlib.util.find_spec(name) is None
        ]
        return (
            f"{self.name}: Megatron's --sft path imports {' and '.join(missing)}, not installed here"
            if missing
            else None
        )

    def run_name(self, *, graphed: bool, resumed: bool = False) -> str:
        """What a run's files are named after: ``<case>.<eager|graphed>[.resumed]``."""
        return f"{self.name}.{'graphed' if graphed else 'eager'}{'.resumed' if resumed else ''}"

    def checkpoint(self, out_dir: Path, *, graphed: bool) -> Path:
        """The folder the first half of a resume case saves into (and its second half loads from)."""
        return out_dir / f"{self.run_name(graphed=graphed)}.checkpoints"

    def resume_step(self, steps: int | None = None) -> int:
        """The step a resume case's second half resumes from: the middle one, as in Megatron's CI."""
        return (self.steps if steps is None else steps) // 2

    def argv(self, *, graphed: bool, out_dir: Path, steps: int | None = None, resumed: bool = False) -> list[str]:
        """One run's command line. A resume case's first half saves into its own folder (at the middle
        step, by --save-interval or on the graceful exit there), and its second half (``resumed``) loads the
        other run's save: the eager one the graphed checkpoint, the graphed one the eager checkpoint."""
        steps = self.steps if steps is None else steps
        run = self.run_name(graphed=graphed, resumed=resumed)
        entry = (
            ["-m", "megatron_cg_plugin.cli", "run", str(self.script_file)]
            if self.script
            else ["-m", "megatron_cg_plugin.pretrain_gpt"]
        )
        checkpoints: list[str] = []
        if self.resumes and resumed:
            checkpoints = ["--load", str(self.checkpoint(out_dir, graphed=not graphed))]
        elif self.resumes:
            own = str(self.checkpoint(out_dir, graphed=graphed))
            at = str(self.resume_step(steps))
            # Ending on --exit-interval, the save there is the exit's own: the interval (which --save needs) is
            # set past the run's end.
            every = str(steps + 1) if self.resume_from_exit else at
            checkpoints = ["--save", own, "--load", own, "--save-interval", every]
            checkpoints += ["--exit-interval", at] if self.resume_from_exit else []
        return [
            *entry,
            *self.run_flags(graphed=graphed, out_dir=out_dir),
            *checkpoints,
            # Each run its own TensorBoard folder where the case writes one (the last --tensorboard-dir wins).
            *(["--tensorboard-dir", str(out_dir / f"{run}.tensorboard")] if self.writes_tensorboard else []),
            "--train-iters",
            str(steps),
            "--cg-metrics-out",
            str(out_dir / f"{run}.metrics.json"),
            "--cg-report-out",
            str(out_dir / f"{run}.report.json"),
        ]

    @property
    def writes_tensorboard(self) -> bool:
        return flag_value(self.flags, "--tensorboard-dir") is not None

    @property
    def eval_interval(self) -> int | None:
        """Megatron evaluates after every step this divides (None: the case does not evaluate)."""
        iters, interval = self._whole_flag("--eval-iters"), self._whole_flag("--eval-interval")
        if iters is None or iters < 1 or interval is None:  # Megatron's defaults never evaluate in a farm run
            return None
        return interval

    def _whole_flag(self, flag: str) -> int | None:
        """The whole number ``flag`` gives in the case's flags (None: not given)."""
        value = flag_value(self.flags, flag)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise CaseError(
                f"{self.folder / CASE_FILE}: MODEL_ARGS {flag} {value!r} is not a whole number; give one."
            ) from None

    def evaluations(self, first: int, last: int) -> list[int]:
        """The steps from ``first`` to ``last`` after which Megatron evaluates."""
        interval = self.eval_interval
        return [] if interval is None else [step for step in range(first, last + 1) if step % interval == 0]

    def run_flags(self, *, graphed: bool, out_dir: Path) -> list[str]:
        """The Megatron and ``--cg-*`` flags of the case's run (``megatron-cg plan`` takes them), without
        the farm's step count and output files; builds the case's dataset under ``out_dir``. A case's own
        ``--split`` replaces the farm data's ``98,2,0``."""
        # The eager reference leaves out what only graphs use (the cg-flags-need-te-graphs rule refuses it
        # without them) and, where the case says so, Megatron's offload.
        flags = (
            self.flags
            if graphed
            else without_graph_only_flags(self.flags if self.eager_offload else without_offload_flags(self.flags))
        )
        data = data_flags(self.data, out_dir)
        if flag_value(self.flags, "--split") is not None:  # the case's own split (argparse would take the farm's)
            data = _without_flags(data, switches=(), options=("--split",))
        return [
            *flags,
            *data,
            *(
                ["--cg-moe-drop-stats"] if self.is_moe and "--cg-moe-drop-stats" not in self.flags else []
            ),  # the routers' measured drops, beside the capacity plan in the summary
            "--cuda-graph-impl",
            "transformer_engine" if graphed else "none",
            *(["--deterministic-mode"] if self.deterministic_mode else []),
        ]

    def checked_flags(self, *, graphed: bool, out_dir: Path) -> list[str]:
        """``run_flags`` with the farm's step count, which the run is given: what ``megatron-cg check``
        validates for the run (Megatron's optimizer setup needs a training length)."""
        return [*self.run_flags(graphed=graphed, out_dir=out_dir), "--train-iters", str(self.steps)]

    @property
    def eager_steps(self) -> int:
        """Steps both runs train eagerly: Megatron captures after --cuda-graph-warmup-steps (default 3),
        so a loss that differs by then began outside the graphs."""
        warmup = self._whole_flag("--cuda-graph-warmup-steps")
        return 3 if warmup is None else warmup

    @property
    def is_moe(self) -> bool:
        return "--num-experts" in expand_preset(list(self.flags))

    @property
    def golden_folder(self) -> Path:
        return self.folder if self.golden_case is None else case_folder(self.golden_case, self.folder.parents[1])

    @property
    def golden_path(self) -> Path:
        return self.golden_folder / golden_file(self.platform)

    @property
    def compared_metrics(self) -> tuple[str, ...]:
        return self.golden_metrics or (*_GOLDEN_METRICS, *((_VALIDATION_METRIC,) if self.eval_interval else ()))


# Megatron 0.19.2's fine-grained offload flags: switches, and options with their values.
_OFFLOAD_SWITCHES = ("--fine-grained-activation-offloading", "--delay-offload-until-cuda-graph")
_OFFLOAD_OPTIONS = (
    "--offload-modules",
    "--activation-offload-fraction",
    "--min-offloaded-tensor-size",
    "--delta-offload-bytes-across-pp-ranks",
    "--fine-grained-offloading-max-inflight-offloads",
)


# The plugin's flags that shape TE graphs only (config.PLUGIN_FLAGS' graphs_only).
_GRAPH_ONLY_SWITCHES = tuple(flag.flag for flag in PLUGIN_FLAGS if flag.graphs_only and flag.switch)
_GRAPH_ONLY_OPTIONS = tuple(flag.flag for flag in PLUGIN_FLAGS if flag.graphs_only and not flag.switch)


def _without_flags(flags: Sequence[str], *, switches: Sequence[str], options: Sequence[str]) -> tuple[str, ...]:
    """``flags`` without ``switches`` and ``options`` (an option takes its values along, also written
    ``--option=value``)."""
    kept: list[str] = []
    skipping = False
    for flag in flags:
        if flag.startswith("--"):
            name, joined = flag.split("=", 1)[0], "=" in flag
            skipping = name in options and not joined
            if name in options or name in switches:
                continue
        elif skipping:
            continue
        kept.append(flag)
    return tuple(kept)


def without_offload_flags(flags: Sequence[str]) -> tuple[str, ...]:
    """``flags`` without Megatron's fine-grained offload flags."""
    return _without_flags(flags, switches=_OFFLOAD_SWITCHES, options=_OFFLOAD_OPTIONS)


def without_graph_only_flags(flags: Sequence[str]) -> tuple[str, ...]:
    """``flags`` without the ``--cg-*`` flags that only graphs use, for the eager reference run."""
    return _without_flags(flags, switches=_GRAPH_ONLY_SWITCHES, options=_GRAPH_ONLY_OPTIONS)


def _before_capture(case: FarmCase, first_step: int) -> str:
    if first_step > case.eager_steps:
        return ""
    cause = (
        " Megatron's eager fine-grained offload ran in those steps of the graphed run, and it is not "
        "reproducible on every model (docs/farm.md)."
        if "--fine-grained-activation-offloading" in case.flags
        else ""
    )
    return (
        f"; it differs from step {first_step}, and steps 1-{case.eager_steps} train eagerly in both runs "
        f"(Megatron captures after --cuda-graph-warmup-steps {case.eager_steps}): the difference began outside "
        f"the graphs.{cause}"
    )


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A case whose flags Megatron or a rule refuses: it cannot run as written, which is no failure of
    the plugin. ``violations`` are (rule, message) pairs, ``megatron`` for Megatron's own checks."""

    mode: str  # which run: eager or graphed
    violations: tuple[tuple[str, str], ...]

    def lines(self) -> list[str]:
        return [
            f"REFUSED [{name}] {message}" + ("" if self.mode == "graphed" else f" (the {self.mode} run)")
            for name, message in self.violations
        ]


def refusal_of(case: FarmCase, out_dir: Path) -> Refusal | None:
    """Checks both runs' flags as ``megatron-cg check`` does (Megatron's validation, then every rule,
    on the case's ranks and environment, for the GPU host); None when both would start."""
    env = dict(case.env)
    # The farm's launcher sets each rank's rendezvous variables: this shell's are none of the runs'.
    host = {name: value for name, value in os.environ.items() if name not in PROCESS_VARIABLES}
    for graphed in (True, False):
        mode, parse_errors = "graphed" if graphed else "eager", io.StringIO()
        try:
            with dry_run.scoped_environ(**env), contextlib.redirect_stderr(parse_errors):
                dry_run.validated_args(
                    case.checked_flags(graphed=graphed, out_dir=out_dir), nproc=case.nproc, env={**host, **env}
                )
        except rules.RuleViolation as violation:
            return Refusal(mode, tuple(violation.violations))
        except dry_run.CheckError as error:
            return Refusal(mode, tuple(error.violations))
        except SystemExit:  # Megatron's parser: a flag this megatron-core does not know, a bad value
            return Refusal(mode, (("megatron", parse_errors.getvalue().strip() or "its parser refused the flags"),))
    return None


def case_folders(root: Path = CASES_DIR) -> list[Path]:
    """Every case folder under ``root`` (``<model>/<case>/model_config.yaml``), in path order."""
    return sorted(path.parent for path in root.glob(f"*/*/{CASE_FILE}"))


def case_folder(name: str, root: Path = CASES_DIR) -> Path:
    found = [folder for folder in case_folders(root) if folder.name == name]
    if len(found) != 1:
        raise CaseError(f"golden_case {name!r} names {len(found)} case folders under {root}; name exactly one case.")
    return found[0]


def load_cases(
    root: Path = CASES_DIR, *, megatron_lm_dir: str | None = None, platform: str = DEFAULT_PLATFORM
) -> tuple[FarmCase, ...]:
    """The farm's own cases (their runs write nothing the folder's location matters for), held to
    ``platform``'s golden files."""
    return tuple(
        prepare_case(folder, out_dir=Path("farm-out"), megatron_lm_dir=megatron_lm_dir, platform=platform)[0]
        for folder in case_folders(root)
    )


def prepare_case(
    folder: str | Path,
    *,
    out_dir: Path,
    gpus: int | None = None,
    data_path: str | None = None,
    steps: int | None = None,
    megatron_lm_dir: str | None = None,
    platform: str = DEFAULT_PLATFORM,
) -> tuple[FarmCase, list[str]]:
    """Any case folder (the farm's, a user's, one of Megatron-LM's own) as a farm run: infrastructure
    flags mapped (``case_adapt``), parallel sizes fitted to ``gpus``; returns the case and one line
    per change, comparison included (the golden file only where the run is the one it recorded)."""
    if steps is not None and steps < 1:
        raise CaseError(
            f"--steps {steps} must be >= 1 (training steps per run; default: the case's CG_FARM steps, "
            f"else {FARM_STEPS})."
        )
    if gpus is not None and gpus < 1:
        raise CaseError(f"--fit-gpus {gpus} must be >= 1 (the GPUs to scale the case's parallel sizes to).")
    if data_path is not None and not Path(data_path).is_dir():
        raise CaseError(
            f"--data-path {data_path} does not exist: give the folder that ${{DATA_PATH}} stands for in "
            "Megatron's case files, or leave --data-path out for mock data."
        )
    case = load_case(folder)
    notes: list[str] = []
    args, env = dict(case.model_args), dict(case.env)
    if case.plugin_case and case.resumes:
        _refuse_farm_checkpoint_flags(case.folder, args)
    placeholders: dict[str, str] = {}
    if not case.plugin_case:  # Megatron's own: written for its CI's mounts and an 8-GPU node
        if gpus is None:
            raise CaseError(
                f"{case.folder}: a Megatron case is written for {MEGATRON_CI_GPUS} GPUs; pass --fit-gpus N "
                "to scale its parallel sizes to the GPUs you have."
            )
        args, placeholders, changes = adapt_case_args(
            args,
            data_path=data_path,
            out_dir=out_dir,
            apex_wgrad=compat.apex_fused_wgrad_available(),
            resumes=case.resumes,
        )
        env, env_changes = adapt_case_env(env)
        notes += changes + env_changes
    else:
        # A plugin case's TensorBoard folder is the farm's: each run writes its own (FarmCase.argv).
        placeholders = {"TENSORBOARD_PATH": str(out_dir / f"{case.name}.tensorboard")}
        if data_path is not None:
            notes.append(f"--data-path {data_path} not used: this farm case names its own data")
    fitted: list[str] = []
    if gpus is not None:
        written_for = case.farm.nproc if case.plugin_case else MEGATRON_CI_GPUS
        try:
            args, fitted = fit_gpus(args, gpus, from_gpus=written_for)
        except CaseError as error:  # a size MODEL_ARGS gives that is no number
            raise CaseError(f"{case.folder / CASE_FILE}: {error}") from None
        if gpus != written_for:
            fitted.insert(0, f"ranks {written_for} -> {gpus}")
        notes += fitted
    compare = case.farm.compare
    # The farm's own golden files are this hardware's at the case's sizes; Megatron's are not.
    if compare == "golden" and (not case.plugin_case or fitted):
        recorded = sorted(p.name for p in case.folder.glob("golden_values_*.json")) or ["none"]
        compare = "eager-only"
        notes.append(
            f"eager vs graphed only: the golden values here ({', '.join(recorded)}) were recorded on other "
            "hardware, parallel sizes or data than this run"
        )
    if not case.farm.eager_offload:
        notes.append(
            "the eager run trains without Megatron's fine-grained offload flags (eager_offload: false): "
            "offload moves saves and changes no value, and Megatron's eager offload is not reproducible run "
            "to run on this model"
        )
    farm_case = FarmCase(
        name=case.name,
        nproc=gpus or case.farm.nproc,
        flags=tuple(render_flags(args, placeholders, where=str(folder))),
        folder=case.folder,
        expect_capture_failure=case.farm.expect_capture_failure,
        golden_case=case.farm.golden_case,
        golden_metrics=case.farm.golden_metrics,
        steps=steps if steps is not None else case.farm.steps or FARM_STEPS,
        env=tuple(env.items()),
        script=case.farm.script,
        data=case.farm.data,
        check_golden=compare == "golden",
        deterministic_mode=case.farm.deterministic_mode,
        eager_offload=case.farm.eager_offload,
        megatron_lm_dir=megatron_lm_dir,
        pool_prediction_tolerance=case.farm.pool_prediction_tolerance,
        equal_metrics=("lm loss", *(m for m in case.metrics or () if m in _DETERMINISTIC_METRICS and m != "lm loss")),
        resumes=case.resumes,
        resume_from_exit=case.farm.resume_from_exit,
        platform=platform,
    )
    if farm_case.eval_interval:
        farm_case = dataclasses.replace(farm_case, equal_metrics=(*farm_case.equal_metrics, _VALIDATION_METRIC))
    if farm_case.resumes and farm_case.resume_step() < 1:
        raise CaseError(f"{case.folder}: a ckpt-resume case needs 2 or more steps (it resumes from the middle one).")
    if case.farm.resume_from_exit and not case.resumes:
        raise CaseError(f"{case.folder}: CG_FARM resume_from_exit needs TEST_TYPE ckpt-resume.")
    return farm_case, notes


# A resume case's checkpoint folders and save step are the farm's (FarmCase.argv), and so is where its first half
# stops; a plugin case that names them would be overridden silently.
_RESUME_FLAGS_OF_THE_FARM = ("--save", "--load", "--save-interval", "--exit-interval")


def _refuse_farm_checkpoint_flags(folder: Path, args: dict[str, Any]) -> None:
    named = [flag for flag in _RESUME_FLAGS_OF_THE_FARM if flag in args]
    if named:
        raise CaseError(
            f"{folder}: a ckpt-resume case leaves {', '.join(named)} to the farm (each run saves into its own "
            "folder at the middle step, and the second half loads the other run's save): drop them, and set "
            "CG_FARM resume_from_exit: true for a first half that ends on --exit-interval."
        )


CASES: tuple[FarmCase, ...] = load_cases()


@dataclasses.dataclass(frozen=True)
class _Resumed:
    """A resume case's second half: the eager run from the graphed checkpoint, the graphed one from the eager
    checkpoint, and the graphed run's report."""

    eager: GoldenValues
    graphed: GoldenValues
    report: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CaseResult:
    case: FarmCase
    eager: GoldenValues
    graphed: GoldenValues
    report: dict[str, Any]
    log_tail: str
    resumed: _Resumed | None = None
    resume_step: int | None = None  # the step the second half resumed from
    tensorboard_tags: tuple[str, ...] = ()  # the scalars the graphed run wrote to TensorBoard (--tensorboard-dir)

    def golden_run(self) -> GoldenValues:
        """What the case's golden file holds: the graphed run; for a resume case the values a resumed job
        logs, the first half's up to the resume step and the resumed half's after it."""
        if self.resumed is None or self.resume_step is None:
            return self.graphed
        at = self.resume_step
        metrics = {}
        for name in dict.fromkeys([*self.graphed.metrics, *self.resumed.graphed.metrics]):
            first, second = self.graphed.metrics.get(name), self.resumed.graphed.metrics.get(name)
            values = {step: v for step, v in (first.values.items() if first else ()) if step <= at}
            values.update({step: v for step, v in (second.values.items() if second else ()) if step > at})
            if values:
                interval = (first or second).step_interval  # type: ignore[union-attr]
                metrics[name] = golden.MetricSeries(values, interval)
        return GoldenValues(metrics)

    def losses(self, which: GoldenValues) -> dict[int, float]:
        return dict(which.metrics["lm loss"].values)

    def window_median_ms(self, which: GoldenValues) -> float | None:
        times = which.metrics.get("iteration-time")
        if times is None:
            return None
        low, high = _TIMING_WINDOW
        window = [value for step, value in times.values.items() if low <= step <= high]
        return 1e3 * statistics.median(window) if window else None

    def summary(self) -> dict[str, Any]:
        eager_ms, graphed_ms = self.window_median_ms(self.eager), self.window_median_ms(self.graphed)
        scopes = self.report.get("scopes", [])
        resumed = self.resumed
        return {
            "case": self.case.name,
            "nproc": self.case.nproc,
            "steps": len(self.losses(self.graphed)),
            "losses_equal": self.losses(self.eager) == self.losses(self.graphed),
            # The second half of a resume case: steps, and eager == graphed from the other's checkpoint.
            "resumed_steps": None if resumed is None else len(self.losses(resumed.graphed)),
            "resumed_losses_equal": None
            if resumed is None
            else self.losses(resumed.eager) == self.losses(resumed.graphed),
            "evaluations": self.report.get("evaluations", 0),
            "eager_ms": eager_ms,
            "graphed_ms": graphed_ms,
            "reduction": None if not eager_ms or graphed_ms is None else 1 - graphed_ms / eager_ms,
            "graphs": sum(scope["graphs_captured"] for scope in scopes),
            "replays": sum(scope["replays"] for scope in scopes),
            "pool_mib": sum(scope["pool_bytes"] for scope in scopes) / 2**20,
            "capture_s": sum(scope["capture_seconds"] for scope in scopes),
            "rejected": sum(scope.get("rejected", 0) for scope in scopes),
            "capture_failures": [scope["failure"] for scope in scopes if scope.get("failure")],
            # MoE cases (--cg-moe-drop-stats): what the routers dropped, beside the capacity plan's uniform router.
            "moe_dropped": self.report.get("moe_dropped_fraction"),
            "moe_capacity": self.report.get("moe_planned_capacity"),
            "moe_uniform_dropped": self.report.get("moe_uniform_dropped_fraction"),
        }


class FarmRunError(MultiRankError):
    """One of a case's two runs failed: ``cause`` is the line worth reading (the plugin's refusal, the
    last exception line of the first failing rank: ``found``, None where there is neither), ``details`` the
    failing ranks' output tails and ``log_dir`` where every rank's whole output is."""

    def __init__(self, mode: str, log_dir: Path, error: MultiRankError) -> None:
        roots = [failure for failure in error.failures if not failure.terminated]
        found = next(
            (cause for cause in (failure_cause(f.stderr_tail + "\n" + f.stdout_tail) for f in roots) if cause), None
        )
        head = f"rank {roots[0].rank} (exit code {roots[0].exitcode})" if roots else str(error).splitlines()[0]
        self.mode, self.log_dir, self.found = mode, log_dir, found
        self.cause = f"the {mode} run failed: {head}" + (f": {found}" if found else "")
        self.details = "".join(str(failure) for failure in roots) or str(error)
        super().__init__(self.cause, error.failures, error.timed_out)


def run_case(
    case: FarmCase,
    out_dir: Path,
    *,
    steps: int | None = None,
    timeout_s: float = 900,
    devices: str | None = None,
    ports: Callable[[], int] | None = None,
) -> CaseResult:
    """Runs the eager and the graphed run; ``devices`` pins them (CUDA_VISIBLE_DEVICES), so
    single-GPU cases can run side by side on a multi-GPU host, and ``ports`` (a
    ``ports.PortAllocator``) gives each launch its rendezvous port where launches run side by side.
    A failed run raises ``FarmRunError``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(case.env)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    tails = []

    def run(graphed: bool, resumed: bool = False) -> tuple[GoldenValues, dict[str, Any]]:
        name = case.run_name(graphed=graphed, resumed=resumed)
        log_dir = out_dir / f"{name}.logs"
        try:
            result = launch(
                case.argv(graphed=graphed, out_dir=out_dir, steps=steps, resumed=resumed),
                nproc=case.nproc,
                env=({**env, **_TRUSTED_CHECKPOINT} if resumed else env) or None,
                timeout_s=timeout_s,
                log_dir=log_dir,
                master_port=None if ports is None else ports(),
            )
        except MultiRankError as error:
            raise FarmRunError(name.split(".", 1)[1].replace(".", " "), log_dir, error) from error
        tails.append(result.stdout.get(0, "")[-4000:])
        report = json.loads((out_dir / f"{name}.report.json").read_text())
        return GoldenValues.load(out_dir / f"{name}.metrics.json"), report

    if case.resumes:
        for graphed in (False, True):  # no checkpoint of an earlier farm run may be resumed from
            shutil.rmtree(case.checkpoint(out_dir, graphed=graphed), ignore_errors=True)
    eager_values, _ = run(False)
    graphed_values, report = run(True)
    tags = _tensorboard_tags(out_dir / f"{case.run_name(graphed=True)}.tensorboard") if case.writes_tensorboard else ()
    resumed, resume_step = None, None
    if case.resumes:
        resume_step = case.resume_step(steps)
        for graphed in (False, True):
            try:
                _rewind(case.checkpoint(out_dir, graphed=graphed), resume_step, case.steps if steps is None else steps)
            except ValueError as error:  # that first half ended well but left nothing to resume from: its failure
                name = case.run_name(graphed=graphed)
                mode, log_dir = name.split(".", 1)[1], out_dir / f"{name}.logs"
                raise FarmRunError(mode, log_dir, MultiRankError(str(error))) from error
        eager_resumed, _ = run(False, resumed=True)
        graphed_resumed, resumed_report = run(True, resumed=True)
        resumed = _Resumed(eager_resumed, graphed_resumed, resumed_report)
        for graphed in (False, True):  # a realistic model's checkpoints are gigabytes each
            shutil.rmtree(case.checkpoint(out_dir, graphed=graphed), ignore_errors=True)
    return CaseResult(
        case=case,
        eager=eager_values,
        graphed=graphed_values,
        report=report,
        log_tail=tails[-1],
        resumed=resumed,
        resume_step=resume_step,
        tensorboard_tags=tags,
    )


def _tensorboard_tags(folder: Path) -> tuple[str, ...]:
    """The scalar tags of the event files under ``folder`` (TensorBoard's own reader, which Megatron's
    writer needs installed anyway)."""
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-not-found]
        EventAccumulator,
    )

    tags: set[str] = set()
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags.update(accumulator.Tags().get("scalars", []))
    return tuple(sorted(tags))


# A second half loads the checkpoint its case's first half just wrote: trusted, so TE 2.20 may load the pickled
# FP8 delayed-scaling metadata in it (rule fp8-delayed-resume-pickle).
_TRUSTED_CHECKPOINT = {"NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1"}
_LATEST = "latest_checkpointed_iteration.txt"  # Megatron's tracker file: the iteration --load resumes from


def _rewind(folder: Path, step: int, last: int) -> None:
    """A first half's checkpoint folder made to resume from ``step``, as Megatron's CI does for ckpt-resume:
    the last step's save removed, the tracker pointing at ``step``. Raises ``ValueError`` where the first half
    saved nothing at ``step`` (``run_case`` reports it as that run's ``FarmRunError``)."""
    saved = folder / f"iter_{step:07d}"
    if not saved.is_dir():
        found = sorted(path.name for path in folder.glob("iter_*")) or ["nothing"]
        raise ValueError(f"{folder}: the first half saved no checkpoint at step {step} (found {', '.join(found)}).")
    if last != step:
        shutil.rmtree(folder / f"iter_{last:07d}", ignore_errors=True)
    (folder / _LATEST).write_text(f"{step}\n")


def golden_mismatches(case: FarmCase, result: CaseResult) -> list[Any]:
    """The graphed run against the case's golden file (which must exist); a case run without
    --deterministic-mode is held to Megatron's non-deterministic tolerances."""
    return golden.compare(
        golden.GoldenValues.load(case.golden_path),
        result.golden_run(),
        deterministic=case.deterministic_mode,
        metrics=case.compared_metrics,
    )


def differing_steps(eager: dict[int, float], graphed: dict[int, float]) -> dict[int, tuple[float, float | None]]:
    """The steps whose value the graphed run does not repeat bit for bit: step -> (eager, graphed)."""
    return {step: (eager[step], graphed.get(step)) for step in sorted(eager) if eager[step] != graphed.get(step)}


def problems_of(case: FarmCase, result: CaseResult, *, with_golden: bool = True) -> list[str]:
    """Everything wrong with a case's runs (empty: it passed): eager vs graphed per step, the
    capture and replay figures of the report, and (``with_golden``) the golden file where the case
    keeps one."""
    summary = result.summary()
    steps = case.steps
    first_half_end = result.resume_step if case.resume_from_exit and result.resume_step else steps
    problems = _pair_problems(case, result.eager, result.graphed, range(1, first_half_end + 1), "")
    problems += _evaluation_problems(case, result.report, 1, first_half_end, "")
    if result.resumed is not None and result.resume_step is not None:
        at, resumed = result.resume_step, result.resumed
        where = f" (resumed from step {at}: eager from the graphed checkpoint, graphed from the eager one)"
        problems += _pair_problems(case, resumed.eager, resumed.graphed, range(at + 1, steps + 1), where)
        problems += _evaluation_problems(case, resumed.report, at + 1, steps, where)
        resumed_scopes = resumed.report.get("scopes", [])
        if not any(scope["graphs_captured"] and scope["replays"] for scope in resumed_scopes):
            problems.append(f"nothing captured or replayed after the resume{where}")
        problems += [
            f"{scope['rejected']} replays refused by their contract{where}"
            for scope in resumed_scopes
            if scope.get("rejected")
        ]
        problems += [f"capture failed{where}: {scope['failure']}" for scope in resumed_scopes if scope.get("failure")]
    if "--cg-log-to-tensorboard" in case.flags and "cuda-graphs/graphs-captured" not in result.tensorboard_tags:
        problems.append(
            "--cg-log-to-tensorboard: the graphed run's TensorBoard holds no cuda-graphs/ figures, only "
            f"{list(result.tensorboard_tags)}"
        )
    if summary["rejected"]:
        problems.append(f"{summary['rejected']} replays refused by their contract")
    problems += _pool_prediction_problems(case, result.report)
    if case.expect_capture_failure:
        if summary["graphs"] or summary["replays"]:
            problems.append(f"graphs survived a failed capture: {summary}")
        if not any("injected failure" in failure for failure in summary["capture_failures"]):
            problems.append(f"the injected capture failure is not in the report: {summary['capture_failures']}")
    else:
        if not (summary["graphs"] and summary["replays"]):
            problems.append(f"nothing captured or replayed: {summary}")
        problems += [f"capture failed: {failure}" for failure in summary["capture_failures"]]
        # Graph banks (hybrid CP): every CP size's bank replays, none refuses.
        banks = [bank for scope in result.report.get("scopes", []) for bank in scope.get("banks") or ()]
        problems += [
            f"bank CP {bank['cp_size']}: {bank['replays']} replays, {bank['rejected']} rejected"
            for bank in banks
            if not bank["replays"] or bank["rejected"]
        ]
        # In-graph offload (--cg-slot-capture with Megatron's offload flags): the replays moved saves to the host,
        # and with the delayed flush, delayed groups were seen flushed after the replays.
        if "--cg-slot-capture" in case.flags and "--fine-grained-activation-offloading" in case.flags:
            scopes = result.report.get("scopes", [])
            if not any(scope.get("offloaded_bytes") for scope in scopes):
                problems.append(
                    "--cg-slot-capture with --fine-grained-activation-offloading offloaded nothing inside "
                    f"the graphs: {[(s.get('scope'), s.get('offloaded_bytes')) for s in scopes]}"
                )
            if "--delay-offload-until-cuda-graph" in case.flags and not any(
                scope.get("offload_groups_flushed") for scope in scopes
            ):
                problems.append(
                    "--delay-offload-until-cuda-graph: no delayed offload group was seen flushed after a "
                    "slot-shared replay"
                )
    if case.check_golden and with_golden:
        if not case.golden_path.exists():
            others = sorted(path.name for path in case.golden_folder.glob(golden_file("*")))
            problems.append(
                f"no golden file {case.golden_path} for this GPU ({case.platform}"
                + (f"; there are {', '.join(others)}" if others else "")
                + "): write it from a real run on this GPU with "
                "MEGATRON_CG_UPDATE_GOLDEN=1 bash ci/run_gpu_functional.sh"
            )
        else:
            mismatches = golden_mismatches(case, result)
            if mismatches:
                problems.append(golden.format_report(mismatches))
    return problems


def _pair_problems(case: FarmCase, eager: GoldenValues, graphed: GoldenValues, steps: range, where: str) -> list[str]:
    """One eager and one graphed run: every step of ``steps`` logged in both, and each compared metric equal
    bit for bit at every step."""
    problems = []
    logged = [set(run.metrics["lm loss"].values) if "lm loss" in run.metrics else set() for run in (eager, graphed)]
    if not logged[0] == logged[1] == set(steps):  # every step asked for (--steps), in both runs
        problems.append(
            f"expected steps {steps.start}-{steps.stop - 1} logged{where}, got {len(logged[0])} eager / "
            f"{len(logged[1])} graphed"
        )
    for metric in case.equal_metrics:
        eager_series, graphed_series = (run.metrics.get(metric) for run in (eager, graphed))
        if eager_series is None or graphed_series is None:
            if metric != _VALIDATION_METRIC or case.evaluations(steps.start, steps.stop - 1):
                missing = "eager" if eager_series is None else "graphed"
                problems.append(f"{metric} was not recorded by the {missing} run{where}")
            continue
        differing = differing_steps(dict(eager_series.values), dict(graphed_series.values))
        if differing:
            problems.append(
                f"{metric} differs eager vs graphed{where} (step: eager, graphed): {differing}"
                + ("" if where else _before_capture(case, min(differing)))
            )
    return problems


def _evaluation_problems(case: FarmCase, report: dict[str, Any], first: int, last: int, where: str) -> list[str]:
    """The graphed run evaluated after each step Megatron evaluates after, and no graph replayed inside an
    evaluation (a layer in eval mode runs eagerly); graphed layers ran eagerly there once graphs existed."""
    expected = case.evaluations(first, last)
    if not expected:
        return []
    problems = []
    if report.get("evaluations") != len(expected):
        problems.append(f"expected {len(expected)} evaluations{where}, the report has {report.get('evaluations')}")
    if report.get("evaluation_replays"):
        problems.append(f"{report['evaluation_replays']} graph replays inside evaluations{where}")
    captured_at = first - 1 + case.eager_steps  # Megatron captures after this step
    if any(step > captured_at for step in expected) and not report.get("evaluation_eager_layer_calls"):
        problems.append(f"no graphed layer ran in the evaluations after capture{where}")
    return problems


def _pool_prediction_problems(case: FarmCase, report: dict[str, Any]) -> list[str]:
    """The planner against the graphed run (``pool_prediction_tolerance``): each pool the report
    measured (TE's graph pool; with --cg-slot-capture also the GPU arenas) within the tolerance of
    the prediction the run itself made from its flags."""
    if case.pool_prediction_tolerance is None:
        return []
    scopes = report.get("scopes", [])
    pairs = [("graph pool", report.get("predicted_pool_bytes"), sum(s.get("pool_bytes") or 0 for s in scopes))]
    if report.get("predicted_arena_bytes") is not None:
        pairs.append(("GPU arenas", report["predicted_arena_bytes"], sum(s.get("arena_bytes") or 0 for s in scopes)))
    problems = []
    for what, predicted, measured in pairs:
        if predicted is None or not measured:
            problems.append(f"{what}: nothing to hold the planner to (predicted {predicted}, measured {measured})")
        elif abs(predicted / measured - 1) > case.pool_prediction_tolerance:
            problems.append(
                f"{what} predicted {predicted / 2**20:.1f} MiB against {measured / 2**20:.1f} MiB measured "
                f"({predicted / measured:.2f}x), outside {case.pool_prediction_tolerance:.0%}"
            )
    return problems


ACCEPT_GOLDEN_CHANGE = "MEGATRON_CG_ACCEPT_GOLDEN_CHANGE"


def golden_rewrite_refusal(case: str, previous_mismatches: Sequence[Any] | None, environ: dict[str, str]) -> str | None:
    """Why an update-mode run must not replace a golden file, or None: a run that differs from the
    file it would replace is a regression until someone says otherwise (``ACCEPT_GOLDEN_CHANGE=1``).
    ``previous_mismatches``: ``golden.compare`` with that file (None: there is no file yet)."""
    if not previous_mismatches or environ.get(ACCEPT_GOLDEN_CHANGE) == "1":
        return None
    return (
        f"{case}: this run differs from the golden file it would replace:\n{format_report(previous_mismatches)}\n"
        f"Fix the regression, or set {ACCEPT_GOLDEN_CHANGE}=1 to accept the change (and say why in the commit)."
    )


def _moe_cell(row: dict[str, Any]) -> str:
    if row.get("moe_dropped") is None:
        return "-"
    plan = (
        ""
        if row.get("moe_capacity") is None
        else (f" (plan: {row['moe_capacity']} slots, {100 * (row.get('moe_uniform_dropped') or 0):.1f}%)")
    )
    return f"{100 * row['moe_dropped']:.2f}%{plan}"


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    def equal(value: bool | None) -> str:
        return "-" if value is None else "yes" if value else "NO"

    lines = [
        "| case | ranks | steps | eager == graphed loss | resumed: steps, equal | evaluations | eager ms | graphed ms "
        "| step time | graphs | replays | pool MiB | capture s | MoE dropped (plan: capacity, uniform router) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        reduction = "-" if row["reduction"] is None else f"{-100 * row['reduction']:+.1f}%"
        resumed = (
            "-" if row.get("resumed_steps") is None else f"{row['resumed_steps']}, {equal(row['resumed_losses_equal'])}"
        )
        lines.append(
            f"| {row['case']} | {row['nproc']} | {row['steps']} | {equal(row['losses_equal'])} | {resumed} | "
            f"{row.get('evaluations') or '-'} | "
            f"{num(row['eager_ms'], '.2f')} | {num(row['graphed_ms'], '.2f')} | {reduction} | {row['graphs']} | "
            f"{row['replays']} | {num(row['pool_mib'], '.1f')} | {num(row['capture_s'], '.2f')} | {_moe_cell(row)} |"
        )
    return "\n".join(lines)
