"""The support matrix: configurations built from factors, each run eager vs graphed through
Megatron-LM's own ``pretrain_gpt.py`` (``megatron-cg run``) at the sizes users train, and the table
``docs/support-matrix.md`` generated from the run's JSON.

The factors (model, graphed scope, precision, capture path, micro-batch size) are crossed in an
all-pairs covering design (``matrix.covering``): every pair of values meets in some cell. Before any
GPU work both runs of each cell go through the plugin's one rule check (``farm.runner.refusal_of``, what
``megatron-cg check`` runs); a refused cell is recorded with its rules and not run. The design
prefers cells that run, so refusals cover only pairs no running cell can. Every other cell trains
the same steps eagerly and graphed on a real indexed dataset (the farm's synthetic one) and is
compared bit for bit per step (``farm.runner``), with the pools the run measured beside the
prediction it made, and what teardown left.

    megatron-cg matrix plan [--out cells.json]        the design, with each cell's refusal (CPU)
    megatron-cg matrix run CELLS.json --out DIR [--jobs N] [--steps N]   on a GPU host (MEGATRON_LM_DIR)
    megatron-cg matrix bench CELLS.json --out DIR [--parallel N] [-- BENCH FLAGS]   plugin / stock step time
    megatron-cg matrix render CELLS.json RESULTS.json...   docs/support-matrix.md's text

The bench (``matrix.bench``) times each cell's capture against Megatron's own graphs with
``megatron-cg bench``; its JSON renders beside the runs' as the "plugin / stock" column.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_cg_plugin.farm.distributed import MultiRankError
from megatron_cg_plugin.farm.ports import PortAllocator
from megatron_cg_plugin.farm.runner import (
    MEGATRON_LM_SCRIPT,
    FarmCase,
    FarmRunError,
    differing_steps,
    problems_of,
    run_case,
)
from megatron_cg_plugin.farm.runner import refusal_of as farm_refusal_of
from megatron_cg_plugin.inputs import InputError, read_json, require_fields
from megatron_cg_plugin.matrix.covering import all_pairs, uncovered_pairs

__all__ = [
    "Cell",
    "FACTORS",
    "MATRIX_STEPS",
    "allowed",
    "cell_env",
    "cell_flags",
    "cell_name",
    "design",
    "farm_case",
    "load_cells",
    "load_results",
    "merge_results",
    "refusal_of",
    "render",
    "run_cell",
    "run_matrix",
    "select_cells",
]

FACTORS: dict[str, tuple[str, ...]] = {
    "model": ("gpt", "llama", "moe-droppad", "moe-dropless"),
    "scope": ("layer", "attn", "moe"),
    "precision": ("bf16", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise"),
    "capture": ("te", "slot", "slot-offload"),
    "mbs": ("1", "2"),
    # What the training loop does beside the steps: nothing, or evaluate every 3rd step and resume from the middle
    # step's checkpoint in a new process (the farm's ckpt-resume: each run's second half from the other's checkpoint).
    "loop": ("train", "eval-resume"),
}
# Factors added to a published design, with the value its earlier cells had: the design keeps those cells (and
# their names) and adds cells for the new pairs only.
_EXTENDED = {"loop": "train"}
MATRIX_STEPS = 10  # 3 eager warmup steps, then 7 graphed ones
_TAIL_LINES = 5  # of a failed cell's error on screen, under its first line
_MICROBATCHES = 4  # per step: the global batch is 4 micro-batches on one rank
_SEQ = 2048

_SIZES = (
    f"--seq-length {_SEQ} --max-position-embeddings {_SEQ} --num-layers 4 --hidden-size 2048 --num-attention-heads 16"
)
_TRAINING = (
    "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 "
    "--bf16 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --log-num-zeros-in-grad --seed 1234 "
    "--transformer-impl transformer_engine --no-gradient-accumulation-fusion --num-workers 0"
)
_LLAMA = (
    "--group-query-attention --num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0"
)
_MOE = (
    f"{_LLAMA} --ffn-hidden-size 5632 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 1408 "
    "--moe-token-dispatcher-type alltoall --moe-grouped-gemm"
)
# GPT-3's layer as Megatron-LM's script defaults it (learned positions, GELU, LayerNorm, biases, dropout 0.1);
# Llama's (GQA, SwiGLU, RMSNorm, RoPE, untied, no biases, no dropout); a 16-expert top-2 MoE on Llama's attention.
_MODEL_FLAGS = {
    "gpt": "--ffn-hidden-size 8192",
    "llama": f"{_LLAMA} --ffn-hidden-size 5632",
    "moe-droppad": f"{_MOE} --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity",
    "moe-dropless": _MOE,
}
_PRECISION_FLAGS = {
    "bf16": "",
    "fp8-delayed": "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max",
    "fp8-tensorwise": "--fp8-format hybrid --fp8-recipe tensorwise",
    "fp8-blockwise": "--fp8-format e4m3 --fp8-recipe blockwise",
}
_CAPTURE_FLAGS = {
    "te": "",
    "slot": "--cg-slot-capture",
    # Attention's saves to pinned host memory inside the graphs (Megatron's flags name the groups).
    "slot-offload": "--cg-slot-capture --fine-grained-activation-offloading --offload-modules core_attn attn_proj",
}
_OFFLOAD_ENV = (("NVTE_CPU_OFFLOAD_V1", "1"),)


def _scope_flags(cell: Mapping[str, str]) -> str:
    if cell["scope"] == "layer":
        return ""
    if cell["scope"] == "attn":
        return "--cuda-graph-modules attn"
    # The MoE block: whole with a fixed capacity, its router and preprocess where dropless.
    return "--cuda-graph-modules " + (
        "attn moe" if cell["model"] == "moe-droppad" else "attn moe_router moe_preprocess"
    )


def allowed(cell: Mapping[str, str]) -> bool:
    """The MoE-block scope exists on MoE models only."""
    return cell["scope"] != "moe" or cell["model"].startswith("moe")


def cell_name(cell: Mapping[str, str]) -> str:
    """The factors' values joined, an added factor's only where it is not what the earlier cells had."""
    values = (cell[f] for f in FACTORS if f not in _EXTENDED or cell[f] != _EXTENDED[f])
    return "_".join(values).replace("-", "")


# Evaluation every 3rd step (before and after capture in both halves of a 10-step run resumed from step 5) on the
# dataset's 10% validation split; later flags win over _TRAINING's.
_LOOP_FLAGS = {"train": "", "eval-resume": "--eval-interval 3 --eval-iters 2 --split 90,10,0"}


def cell_flags(cell: Mapping[str, str]) -> list[str]:
    """The Megatron and ``--cg-*`` flags of a cell, without ``--cuda-graph-impl`` (the farm sets it
    per run) and without the data flags (the farm builds its dataset)."""
    mbs = int(cell["mbs"])
    text = " ".join(
        (
            _SIZES,
            _TRAINING,
            _MODEL_FLAGS[cell["model"]],
            _scope_flags(cell),
            _PRECISION_FLAGS[cell["precision"]],
            _CAPTURE_FLAGS[cell["capture"]],
            f"--micro-batch-size {mbs} --global-batch-size {_MICROBATCHES * mbs}",
            _LOOP_FLAGS[cell["loop"]],
        )
    )
    return text.split()


@dataclasses.dataclass(frozen=True)
class Cell:
    factors: dict[str, str]
    refused_by: tuple[str, ...] = ()  # the rules (or Megatron's check) that refuse it before any GPU work
    refusal: str = ""

    @property
    def name(self) -> str:
        return cell_name(self.factors)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "factors": self.factors,
            "flags": cell_flags(self.factors),
            "refused_by": list(self.refused_by),
            "refusal": self.refusal,
        }


_CELLS_FILE = "the file `megatron-cg matrix plan --out CELLS.json` wrote"


def load_cells(path: Path) -> list[Cell]:
    """The design ``matrix plan`` wrote; a file that is none is refused naming it, the cell and the field."""
    rows = read_json(path, what="the cells file", give=_CELLS_FILE)
    if not isinstance(rows, list) or not rows:
        held = "no cells" if rows == [] else f"a {type(rows).__name__}, not a list of cells"
        raise InputError(f"the cells file {path} holds {held}; give {_CELLS_FILE}.")
    cells = []
    for number, row in enumerate(rows, start=1):
        where = f"the cells file {path}, cell {number}"
        require_fields(row, {"factors": dict, "refused_by": list, "refusal": str}, where=where, give=_CELLS_FILE)
        factors = require_fields(
            row["factors"], dict.fromkeys(FACTORS, str), where=f"{where} factors", give=_CELLS_FILE
        )
        unknown = next((name for name in FACTORS if factors[name] not in FACTORS[name]), None)
        if unknown is not None:
            raise InputError(
                f"{where}: factor {unknown!r} is {factors[unknown]!r}, not one of {', '.join(FACTORS[unknown])}; "
                f"give {_CELLS_FILE}."
            )
        cells.append(Cell({name: factors[name] for name in FACTORS}, tuple(row["refused_by"]), row["refusal"]))
    return cells


def select_cells(cells: Sequence[Cell], only: Sequence[str] | None, source: Path) -> list[Cell]:
    """The cells ``--only`` names (all without it); a name not in the design is refused."""
    if not only:
        return list(cells)
    unknown = sorted(set(only) - {cell.name for cell in cells})
    if unknown:
        raise ValueError(f"--only names cells not in {source}: {', '.join(unknown)}")
    return [cell for cell in cells if cell.name in only]


def cell_env(cell: Mapping[str, str]) -> dict[str, str]:
    """The environment a cell's runs get beyond the host's (Megatron's offload needs TE's v1 offload)."""
    return dict(_OFFLOAD_ENV) if cell["capture"] == "slot-offload" else {}


def refusal_of(
    cell: Mapping[str, str], out_dir: Path, *, flags: Sequence[str] | None = None
) -> tuple[tuple[str, ...], str]:
    """The rules that refuse the cell's runs as ``megatron-cg check`` would (``farm.runner.refusal_of``, its
    dataset built under ``out_dir``), on ``flags`` in place of the cell's where given; ``((), "")``
    when both would start."""
    case = farm_case(Cell(dict(cell)), megatron_lm_dir=None)
    if flags is not None:
        case = dataclasses.replace(case, flags=tuple(flags))
    refusal = farm_refusal_of(case, out_dir)
    if refusal is None:
        return (), ""
    return tuple(name for name, _ in refusal.violations), "\n".join(refusal.lines())


def design(refused: Callable[[Mapping[str, str]], tuple[tuple[str, ...], str]]) -> list[Cell]:
    """The all-pairs design over ``FACTORS``; running cells cover their pairs first."""
    verdicts: dict[str, tuple[tuple[str, ...], str]] = {}

    def verdict(cell: Mapping[str, str]) -> tuple[tuple[str, ...], str]:
        name = cell_name(cell)
        if name not in verdicts:
            verdicts[name] = refused(cell)
        return verdicts[name]

    base = {name: values for name, values in FACTORS.items() if name not in _EXTENDED}
    earlier = [
        {**cell, **_EXTENDED}
        for cell in all_pairs(base, allowed=allowed, preferred=lambda cell: not verdict({**cell, **_EXTENDED})[0])
    ]
    chosen = earlier + all_pairs(FACTORS, allowed=allowed, preferred=lambda cell: not verdict(cell)[0], covered=earlier)
    assert not uncovered_pairs(chosen, FACTORS, allowed=allowed)
    return [Cell({name: cell[name] for name in FACTORS}, *verdict(cell)) for cell in chosen]


def farm_case(cell: Cell, *, megatron_lm_dir: str | None, steps: int = MATRIX_STEPS) -> FarmCase:
    """A cell as a farm run of Megatron-LM's pretrain_gpt.py on the farm's synthetic indexed dataset.
    The eager reference of an offload cell trains without Megatron's offload (it moves saves and
    changes no value; Megatron's eager offload is not reproducible run to run, docs/farm.md). An
    eval-resume cell's first half ends on --exit-interval at the middle step, so each run writes one
    checkpoint (a 2048-hidden MoE's is about 9 GB with its optimizer)."""
    return FarmCase(
        name=cell.name,
        nproc=1,
        flags=tuple(cell_flags(cell.factors)),
        folder=Path("."),
        steps=steps,
        script=MEGATRON_LM_SCRIPT + "pretrain_gpt.py",
        data="synthetic",
        check_golden=False,
        env=tuple(cell_env(cell.factors).items()),
        eager_offload=cell.factors["capture"] != "slot-offload",
        megatron_lm_dir=megatron_lm_dir,
        resumes=cell.factors["loop"] == "eval-resume",
        resume_from_exit=cell.factors["loop"] == "eval-resume",
        equal_metrics=("lm loss", "lm loss validation") if cell.factors["loop"] == "eval-resume" else ("lm loss",),
    )


def run_cell(
    cell: Cell,
    out_dir: Path,
    *,
    megatron_lm_dir: str | None,
    steps: int,
    timeout_s: float,
    ports: Callable[[], int] | None = None,
) -> dict[str, Any]:
    """One cell's row: refused, or exact / differs / failed with the figures of its two runs."""
    row: dict[str, Any] = {**cell.to_json(), "steps": steps}
    if cell.refused_by:
        return {**row, "result": "refused"}
    case = farm_case(cell, megatron_lm_dir=megatron_lm_dir, steps=steps)
    try:
        result = run_case(case, out_dir, timeout_s=timeout_s, ports=ports)
    except (MultiRankError, OSError, ValueError) as error:  # a run that died: the cell is a failure, the rest go on
        return {**row, "result": "failed", "problems": [_failure(error)]}
    finally:  # a cell's checkpoints only carry its run to its resumed half: cells side by side would fill the disk
        for graphed in (False, True):
            shutil.rmtree(case.checkpoint(out_dir, graphed=graphed), ignore_errors=True)
    problems = problems_of(case, result, with_golden=False)
    differing = differing_steps(result.losses(result.eager), result.losses(result.graphed))
    resumed = result.resumed
    differing_resumed = (
        {} if resumed is None else differing_steps(result.losses(resumed.eager), result.losses(resumed.graphed))
    )
    return {
        **row,
        "result": "differs" if differing or differing_resumed else ("failed" if problems else "exact"),
        "problems": problems,
        "first_differing_step": min(differing, default=None),
        "first_differing_resumed_step": min(differing_resumed, default=None),
        "summary": result.summary(),
        **_memory_figures(result.report),
    }


def _failure(error: Exception) -> str:
    """A run that died, for its row: the cause a farm run found in the failing rank's output (a refusal whole,
    else the last exception line), or that rank's last lines where it found none; else the error's message."""
    if isinstance(error, FarmRunError):
        tail = error.details.rstrip().splitlines()[-_TAIL_LINES:]
        text = error.cause if error.found else "\n".join([error.cause, *tail])
    else:
        text = str(error)[-1500:]
    return f"{type(error).__name__}: {text}"


def _memory_figures(report: Mapping[str, Any]) -> dict[str, Any]:
    scopes = report.get("scopes", [])

    def total(key: str) -> int | None:
        values = [s.get(key) for s in scopes if s.get(key) is not None]
        return sum(values) if values else None

    return {
        "pool_bytes": total("pool_bytes"),
        "predicted_pool_bytes": report.get("predicted_pool_bytes"),
        "arena_bytes": total("arena_bytes"),
        "predicted_arena_bytes": report.get("predicted_arena_bytes"),
        "teardown_pool_bytes_left": total("teardown_pool_bytes_left"),
        "teardown_allocated_delta_bytes": total("teardown_allocated_delta_bytes"),
        "prediction_leaves_out": list(report.get("prediction_leaves_out") or ()),
    }


def run_matrix(
    cells: Sequence[Cell],
    out_dir: Path,
    *,
    megatron_lm_dir: str | None,
    jobs: int = 1,
    steps: int = MATRIX_STEPS,
    timeout_s: float = 900,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Runs every cell (``jobs`` at a time on the one GPU: correctness is compared within each cell,
    step times are then shared-GPU figures) and writes ``out_dir/matrix.json`` as rows finish. Each
    launch takes its rendezvous port from one allocator, so cells side by side never share one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    ports = PortAllocator()

    def record(row: dict[str, Any]) -> None:
        rows[row["name"]] = row
        # The cause on screen, not only in matrix.json: the failure's first line, and its last ones under it.
        failure = (row.get("problems") or [""])[0].strip().splitlines() if row["result"] == "failed" else []
        progress(
            f"{row['name']}: {row['result']}"
            + (f" {row['refused_by']}" if row.get("refused_by") else "")
            + (f": {failure[0]}" if failure else "")
            + "".join(f"\n   {line.strip()}" for line in failure[1:][-_TAIL_LINES:])
        )
        (out_dir / "matrix.json").write_text(
            json.dumps(
                {"factors": FACTORS, "steps": steps, "rows": [rows[c.name] for c in cells if c.name in rows]}, indent=1
            )
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [
            pool.submit(
                run_cell, cell, out_dir, megatron_lm_dir=megatron_lm_dir, steps=steps, timeout_s=timeout_s, ports=ports
            )
            for cell in cells
        ]
        for future in concurrent.futures.as_completed(futures):
            record(future.result())
    return [rows[cell.name] for cell in cells]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _ratio(predicted: int | None, measured: int | None) -> str:
    if predicted is None or not measured:
        return "-"
    return f"{_mib(predicted)} / {_mib(measured)} ({predicted / measured:.2f})"


_RESULT_WORDS = {
    "exact": "exact",
    "differs": "**differs**",
    "failed": "**failed**",
    "refused": "refused",
    "not-run": "**not run**",
}


_BENCH_KEY = "bench"  # what tells a matrix bench's JSON (matrix.bench.RESULTS_FILE) from a run's matrix.json


_RESULTS_FILE = "a matrix.json `megatron-cg matrix run` wrote, or a matrix-bench.json of `matrix bench`"
# The fields ``render`` reads of a row, by its result; a bench row's by the bench's result.
_ROW_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {"refused": {"refused_by": list}}
_BENCH_ROW_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "benched": {"ratio": dict, "parallel": int, "rounds": int, "steps_per_block": int, "skip_steps": int},
    "stock-refused": {"stock_refused_by": list},
}
_RATIO_FIELDS: dict[str, type | tuple[type, ...]] = {
    "median": (int, float),
    "low": (int, float),
    "high": (int, float),
    "n": int,
}


def load_results(path: Path) -> dict[str, Any]:
    """A run's ``matrix.json`` or a bench's ``matrix-bench.json``, checked for what ``render`` reads of it; a
    file that is neither is refused naming it, the row and the field."""
    data = read_json(path, what="the results file", give=_RESULTS_FILE)
    bench = isinstance(data, Mapping) and _BENCH_KEY in data
    fields: dict[str, type | tuple[type, ...]] = {"rows": list, **({_BENCH_KEY: dict} if bench else {"steps": int})}
    require_fields(data, fields, where=f"the results file {path}", give=_RESULTS_FILE)
    for number, row in enumerate(data["rows"], start=1):
        where = f"the results file {path}, row {number}"
        require_fields(row, {"name": str, "result": str}, where=where, give=_RESULTS_FILE)
        known = ("benched", "failed", "refused", "stock-refused") if bench else tuple(_RESULT_WORDS)
        if row["result"] not in known:
            raise InputError(
                f"{where}: result {row['result']!r} is not one of {', '.join(known)}; give {_RESULTS_FILE}."
            )
        needs = (_BENCH_ROW_FIELDS if bench else _ROW_FIELDS).get(row["result"], {})
        require_fields(row, needs, where=where, give=_RESULTS_FILE)
        if bench and row["result"] == "benched":
            require_fields(row["ratio"], _RATIO_FIELDS, where=f"{where} ratio", give=_RESULTS_FILE)
    return data


def merge_results(cells: Sequence[Cell], runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One matrix over the design ``cells`` from several runs' ``matrix.json`` (a matrix run in parts,
    or a cell run again): each cell's row from the last run that has it; a refused
    cell from the design (the rules refuse it on CPU); any other cell without a row is "not run".
    Matrix benches' JSON among ``runs`` merge the same way, by cell name, into each row's ``bench``
    (a refused cell has none)."""
    benches = [run for run in runs if _BENCH_KEY in run]
    runs = [run for run in runs if _BENCH_KEY not in run]
    if not runs or len({run["steps"] for run in runs}) != 1:
        raise ValueError(
            "give one or more matrix.json files, all run with the same --steps (and any matrix-bench.json beside them)."
        )
    latest = {row["name"]: row for run in runs for row in run["rows"]}
    benched = {row["name"]: row for run in benches for row in run["rows"]}
    rows = []
    for cell in cells:
        if cell.refused_by:
            rows.append({**cell.to_json(), "result": "refused"})
            continue
        # A run from before a factor was added lacks it: the design's factors are the cell's.
        row = {**latest.get(cell.name, {**cell.to_json(), "result": "not-run"}), "factors": cell.factors}
        rows.append({**row, _BENCH_KEY: benched[cell.name]} if cell.name in benched else row)
    return {"factors": FACTORS, "steps": runs[0]["steps"], "rows": rows}


def _bench_cell(row: Mapping[str, Any]) -> str:
    """The plugin / stock ratio of a cell's bench: median [lowest, highest] +-95% (n pairs of rounds)."""
    bench = row.get(_BENCH_KEY)
    if row["result"] == "refused" or bench is None or bench["result"] == "refused":
        return "-"
    if bench["result"] == "stock-refused":
        return "- (stock: " + ", ".join(f"`{rule}`" for rule in bench["stock_refused_by"]) + ")"
    if bench["result"] != "benched":
        return "**bench failed**"
    ratio, half = bench["ratio"], bench.get("ratio_half_width")
    return (
        f"{ratio['median']:.2f} [{ratio['low']:.2f}, {ratio['high']:.2f}]"
        + ("" if half is None else f" +-{half:.1%}")
        + f" (n={ratio['n']})"
    )


def _bench_note(rows: Sequence[Mapping[str, Any]]) -> str:
    """How the plugin / stock column was measured, from the benches' own rows."""
    benches = [row[_BENCH_KEY] for row in rows if row.get(_BENCH_KEY) and row["result"] != "refused"]
    benched = [bench for bench in benches if bench["result"] == "benched"]
    if not benched:
        return "plugin / stock: not benched (`megatron-cg matrix bench`); `-` in every cell."

    def values(key: str) -> str:
        return "/".join(str(value) for value in sorted({bench[key] for bench in benched}))

    parallel = max(bench["parallel"] for bench in benched)  # refused rows never launched: no "parallel"
    side = (
        "one bench at a time on the GPU"
        if parallel == 1
        else f"up to {parallel} benches side by side on the one GPU (shared-GPU figures)"
    )
    return (
        f"plugin / stock ({len(benched)} cells benched): the step time of the cell's own capture (bench arm "
        "`plugin` in te cells, `slot`, `slot-offload`) over Megatron's TE graphs on the same flags (with Megatron's "
        "offload in slot-offload cells), from `megatron-cg bench` through `pretrain_gpt.py` without "
        "`--deterministic-mode`, one process per cell; the median over pairs of mirrored rounds [lowest, highest] "
        f"+- the median's 95% half-width (n pairs); {values('rounds')} rounds of {values('steps_per_block')} steps "
        f"per arm, the first {values('skip_steps')} of each block left out; {side}. Below 1 the plugin's step is "
        "faster; `-` for a refused or not benched cell, with the rule that refuses the stock arm where one does."
    )


def render(results: Mapping[str, Any]) -> str:
    """``docs/support-matrix.md`` from a matrix's JSON (``run_matrix``'s, or ``merge_results``')."""
    rows = results["rows"]
    factors = results["factors"]
    pair_count = len(uncovered_pairs([], factors, allowed=allowed))
    lines = [
        "# Support matrix",
        "",
        "Generated by `megatron-cg matrix render` from a run's `matrix.json`; do not edit by hand. Each cell trains "
        f"{results['steps']} steps eagerly and graphed through Megatron-LM's own `pretrain_gpt.py` (`megatron-cg run`) "
        "on a synthetic indexed dataset, deterministic, on one GPU, and compares the lm loss of every step bit for "
        "bit; a refused cell was stopped by the named rule before any GPU work (`megatron-cg check` says the same). "
        "An eval-resume cell also evaluates every 3rd step (validation losses compared too) and runs a second half "
        "from the middle step's checkpoint in a new process, the eager run from the graphed run's checkpoint and "
        "the graphed run from the eager one's, compared step by step.",
        "",
        f"The {len(rows)} cells are an all-pairs design over "
        f"{', '.join(f'{k} ({len(v)})' for k, v in factors.items())}: "
        f"each of the {pair_count} pairs of values that can meet does so in some cell.",
        "",
        _bench_note(rows),
        "",
        "| cell | model | scope | precision | capture | mbs | loop | result | plugin / stock "
        "| pool MiB predicted / measured | arenas MiB predicted / measured "
        "| left after teardown (pool, allocated MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        f = row["factors"]
        result = _RESULT_WORDS[row["result"]]
        if row["result"] == "refused":
            result += " " + ", ".join(f"`{rule}`" for rule in row["refused_by"])
        elif row.get("first_differing_step") is not None:
            result += f" from step {row['first_differing_step']}"
        elif row.get("first_differing_resumed_step") is not None:
            result += f" after the resume, from step {row['first_differing_resumed_step']}"
        left = (
            "-"
            if row.get("teardown_pool_bytes_left") is None
            else f"{_mib(row['teardown_pool_bytes_left'])}, {_mib(row.get('teardown_allocated_delta_bytes'))}"
        )
        lines.append(
            f"| {row['name']} | {f['model']} | {f['scope']} | {f['precision']} | {f['capture']} | {f['mbs']} | "
            f"{f['loop']} | "
            f"{result} | {_bench_cell(row)} | {_ratio(row.get('predicted_pool_bytes'), row.get('pool_bytes'))} | "
            f"{_ratio(row.get('predicted_arena_bytes'), row.get('arena_bytes'))} | {left} |"
        )
    counts = {word: sum(row["result"] == word for row in rows) for word in _RESULT_WORDS}
    lines += ["", ", ".join(f"{n} {word.replace('-', ' ')}" for word, n in counts.items() if n) + "."]
    return "\n".join(lines) + "\n"
