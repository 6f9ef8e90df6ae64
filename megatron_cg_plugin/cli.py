"""``megatron-cg``: the plugin's command line. ``megatron-cg --help`` lists the commands (the synopsis
and summary of each is its function's docstring, ``helptext._command_lines``) and every ``--cg-*`` flag.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import shlex
import sys
import traceback
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from megatron_cg_plugin import console, golden, helptext, inputs, rules
from megatron_cg_plugin.bench.output import BenchOutputError
from megatron_cg_plugin.farm.cases import CaseError
from megatron_cg_plugin.farm.distributed import gpu_name, gpu_stack_missing
from megatron_cg_plugin.launch.presets import repeated_flags_note
from megatron_cg_plugin.moe.capacity import capacity_plan, parse_load
from megatron_cg_plugin.parse_errors import OneLineErrors, reported_as
from megatron_cg_plugin.planner.capture_plan import plan_capture
from megatron_cg_plugin.planner.prediction import predict_graph_memory
from megatron_cg_plugin.settings import RunSettings

if TYPE_CHECKING:  # the farm imports torch (through the dry run): imported by the commands that use it
    from megatron_cg_plugin.farm import runner as farm

__all__ = ["EXIT_BAD_INPUT", "EXIT_MISMATCH", "EXIT_OK", "main"]

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = console.EXIT_OK, console.EXIT_MISMATCH, console.EXIT_BAD_INPUT


def _moe_plan_text(settings: RunSettings, router_load: str | None = None) -> str:
    """``megatron-cg plan``'s MoE part: per MoE layer the fixed capacity, the padded expert GEMMs
    and the fraction of tokens ``router_load`` (default uniform) would drop (``moe.capacity``). A router
    load is checked whatever the model; a dense model, which has no router, refuses one."""
    if not settings.num_experts:
        if router_load is not None:
            raise ValueError(
                f"--router-load {router_load} says how a router spreads tokens over experts, and this "
                "model is dense (no --num-experts): drop --router-load."
            )
        return "MoE: none (a dense model)."
    router_load = router_load or "uniform"
    load = parse_load(router_load, settings.num_experts)
    if settings.num_layers is None:  # read_settings reads --num-layers, which Megatron requires
        raise TypeError("the MoE plan needs the run's --num-layers")
    layers = [index + 1 for index in range(settings.num_layers) if settings.is_moe_layer(index)]
    if settings.capacity_factor is None:
        return (
            f"MoE: layers {layers} are dropless (no --moe-expert-capacity-factor): expert shapes change per "
            "step, so the MoE block cannot be graphed whole; graph attn moe_router [moe_preprocess], or add "
            "--moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity for a fixed capacity."
            + (
                f"\nnote: --router-load {router_load} is not used: a dropless router drops no token, whatever its load."
                if router_load != "uniform"
                else ""
            )
        )
    plan = capacity_plan(settings)
    ffn = settings.moe_ffn_hidden_size or settings.ffn_hidden_size
    # Experts and a capacity factor were checked above; Megatron requires --hidden-size and derives the ffn sizes.
    if plan is None or settings.hidden_size is None or ffn is None:
        raise TypeError("the MoE plan needs the run's capacity plan, hidden size and expert ffn size")
    shapes = plan.gemm_shapes(settings.hidden_size, ffn, gated=settings.swiglu or settings.quick_geglu)
    dropped = plan.dropped_fraction(load)
    padded = (
        "" if settings.pad_to_capacity else (" (not padded: add --moe-pad-expert-input-to-capacity for static shapes)")
    )
    return "\n".join(
        [
            f"MoE layers {layers}: {plan.tokens_per_rank} tokens x top-{plan.topk} per rank and microbatch, "
            f"{plan.num_experts} experts ({plan.local_experts} local), capacity factor {plan.capacity_factor}",
            f"  capacity: {plan.capacity} slots per expert per source rank{padded}; each local expert's GEMMs take "
            f"{plan.tokens_per_local_expert} rows (x TP {plan.tensor_parallel} x EP {plan.expert_parallel})",
            *(
                [
                    f"  the capacity exceeds the {plan.tokens_per_rank} tokens per rank (factor x top-k > experts): "
                    "Megatron pads each expert to the tokens alone, and its alltoall dispatcher fails; use a factor of "
                    f"at most {plan.num_experts / plan.topk:g}"
                ]
                if plan.exceeds_tokens
                else []
            ),
            f"  expert GEMMs (rows, in, out): fc1 {shapes['fc1']}, fc2 {shapes['fc2']}",
            f"  dropped tokens for a {router_load} router: {100 * dropped:.1f}%",
        ]
    )


def _golden(argv: Sequence[str]) -> int:
    """compare EXPECTED ACTUAL [--deterministic] [--metrics M ...] | update ACTUAL GOLDEN
    compare a run's metrics with a golden file (Megatron's thresholds), or write one from a real run"""
    parser = OneLineErrors(prog="megatron-cg golden")
    sub = parser.add_subparsers(dest="action", required=True)
    compare = sub.add_parser("compare", help="compare a run's metrics with a golden file")
    compare.add_argument("expected")
    compare.add_argument("actual")
    compare.add_argument(
        "--deterministic", action="store_true", help="lm loss must match exactly (runs with --deterministic-mode)"
    )
    compare.add_argument("--metrics", nargs="+", default=None, help="compare only these metrics")
    update = sub.add_parser("update", help="write a real run's metrics as the new golden file")
    update.add_argument("actual")
    update.add_argument("golden")
    options = parser.parse_args(argv)
    try:
        # In the order the command line names them, each file named by its place there.
        expected = (
            None
            if options.action == "update"
            else golden.GoldenValues.load(options.expected, role="EXPECTED", needs_metrics=True)
        )
        actual = golden.GoldenValues.load(options.actual, role="ACTUAL", needs_metrics=True)
        if expected is None:
            golden.update(options.golden, actual)
            print(f"wrote {options.golden} from {options.actual}")
            return EXIT_OK
    except (OSError, ValueError) as error:
        print(f"megatron-cg golden: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        mismatches = golden.compare(expected, actual, deterministic=options.deterministic, metrics=options.metrics)
    except ValueError as error:  # a metric name nothing knows
        print(f"megatron-cg golden compare{' --metrics' if options.metrics else ''}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(golden.format_report(mismatches))
    return EXIT_MISMATCH if mismatches else EXIT_OK


def _dry_run_command(
    argv: Sequence[str],
    *,
    prog: str,
    usage: str,
    produce: Callable[[argparse.Namespace, list[str]], str],
    extra_options: Sequence[tuple[str, str | None]] = (),
) -> int:
    """``check`` and ``plan``: their own options (``--nproc``, ``extra_options`` as (flag, default)),
    the launcher flags after them, ``produce``'s text on success, one line and exit 2 on bad input."""
    parser = OneLineErrors(prog=prog, add_help=False)
    parser.add_argument(
        "--nproc", type=int, default=1, help="number of ranks the run would use (sets the data-parallel size)"
    )
    for flag, default in extra_options:
        parser.add_argument(flag, default=default)
    if any(flag in ("-h", "--help") for flag in argv):
        # Megatron 0.19.2's own --help crashes (a bare '%' in one of its help strings), so say what
        # this command takes here; the flags themselves are Megatron's and the plugin's --cg-*.
        print(f"{usage}\n\n{helptext.plugin_flags_help()}")
        return EXIT_OK
    options, flags = parser.parse_known_args(argv)
    if options.nproc < 1:
        print(f"{prog}: --nproc must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with reported_as(prog):  # Megatron's parser reads the flags for this command
            text = produce(options, flags)
    except ValueError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    note = repeated_flags_note(flags)
    print(text if note is None else f"{text}\n{note}")
    return EXIT_OK


def _check(argv: Sequence[str]) -> int:
    """[--nproc N] <launcher flags>
    validate the flags on CPU (Megatron's checks and the plugin's rules); print the capture plan"""
    usage = (
        "usage: megatron-cg check [--nproc N] <launcher flags>\n\nValidates the flags the launcher "
        "(python -m megatron_cg_plugin.pretrain_gpt) would get, on CPU, and prints the capture plan. "
        "The flags are Megatron's plus the plugin's --cg-* below (docs/troubleshooting.md lists every rule); "
        "--cg-preset NAME gives a complete model to start from."
    )

    def produce(options: argparse.Namespace, flags: list[str]) -> str:
        from megatron_cg_plugin.launch import dry_run  # deferred: torch (seconds); --help and golden start without it

        return "flags OK\n" + dry_run.check(flags, nproc=options.nproc, env=dict(os.environ))

    return _dry_run_command(argv, prog="megatron-cg check", usage=usage, produce=produce)


def _plan(argv: Sequence[str]) -> int:
    """[--nproc N] [--router-load uniform|zipf:S|s1,s2,...] <launcher flags>
    the check, then the graph pool the capture will reserve and, for MoE, the expert capacity plan"""

    def produce(options: argparse.Namespace, flags: list[str]) -> str:
        from megatron_cg_plugin.launch import dry_run  # deferred: torch (seconds); --help and golden start without it

        env = dict(os.environ)
        _args, settings, config = dry_run.validated_args(flags, nproc=options.nproc, env=env)
        memory = predict_graph_memory(settings, config)
        return (
            plan_capture(settings).describe()
            + "\n"
            + _moe_plan_text(settings, options.router_load)
            + "\n"
            + (
                "graph pool: nothing graphed, or layers the planner does not model"
                if memory is None
                else memory.describe()
            )
        )

    usage = (
        "usage: megatron-cg plan [--nproc N] [--router-load uniform|zipf:S|s1,s2,...] <launcher flags>\n\n"
        "Checks the flags as megatron-cg check does, then prints the capture plan and, for MoE models, the "
        "fixed expert capacity, the padded expert GEMM shapes and the dropped-token fraction for a router "
        "load, and the graph pool the capture will reserve (predicted from the shapes: docs/performance.md). "
        "Set NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (or --deterministic-mode) as the run will, for cuDNN's deterministic "
        "attention backward workspace."
    )
    return _dry_run_command(
        argv, prog="megatron-cg plan", usage=usage, produce=produce, extra_options=(("--router-load", None),)
    )


def _bench(argv: Sequence[str]) -> int:
    """[--bench-rounds R --bench-steps S --bench-arms ARM,... --bench-out DIR] [SCRIPT.py] <flags>
    eager vs Megatron's graphs vs the plugin's, in one process on a GPU (bench.json, bench.md, bench.png)"""
    if any(flag in ("-h", "--help") for flag in argv):
        print(
            "usage: megatron-cg bench [--bench-rounds 8] [--bench-steps 20] [--bench-skip-steps 2] "
            "[--bench-arms eager,stock,plugin (also plugin-no-check, plugin-recording, slot, slot-offload, "
            "slot-offload-staged, and slot-offload-w<N>, slot-offload-staged-w<N>: --cg-offload-window N; -f<P> "
            "after either: --activation-offload-fraction P/100)] "
            "[--bench-out bench-out] [--bench-no-plot] [--bench-profile-dir DIR] [--bench-cached-batches N] "
            "[--bench-interleave steps --bench-cycles 60 [--bench-capture-rounds N] [--bench-seconds S]] "
            "[SCRIPT.py] <launcher or script flags>\n\n"
            "Trains the launcher's model (or, with SCRIPT.py first, your own Megatron script's, run as "
            "megatron-cg run runs it) in interleaved blocks of each arm in one process and writes "
            "bench.json, bench.md and bench.png (docs/performance.md).\n\n" + helptext.plugin_flags_help()
        )
        return EXIT_OK
    from megatron_cg_plugin.bench import (
        command as bench,  # deferred: torch (seconds); --help and golden start without it
    )

    try:
        with reported_as("megatron-cg bench"):  # Megatron's parser reads the flags for this command
            return bench.main(argv)
    except (bench.BenchError, BenchOutputError) as error:
        print(f"megatron-cg bench: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _tune(argv: Sequence[str]) -> int:
    """[--tune-memory-gib X --tune-seconds S --tune-out DIR --tune-dry-run] [SCRIPT.py] <flags>
    which CUDA-graph setup to train with: the setups the rules allow, predicted, then timed against eager on a GPU"""
    if any(flag in ("-h", "--help") for flag in argv):
        print(
            "usage: megatron-cg tune [--tune-memory-gib X] [--tune-seconds 300] [--tune-out DIR] [--tune-no-plot] "
            "[--tune-dry-run] [SCRIPT.py] <launcher or script flags>\n\n"
            "Lists the CUDA-graph setups that fit the model (eager; attn, attn mlp, the whole layer; attn "
            "moe_router moe_preprocess for MoE, attn moe with a capacity factor; each under TE's graphs and "
            "--cg-slot-capture, with and without your offload flags), checks each as megatron-cg check does (a "
            "refused one names its rules), predicts its graph memory as megatron-cg plan does, drops those over "
            "the budget (--tune-memory-gib, or on the GPU the device's memory less eager's peak and 5%), and "
            "times the rest against eager in one process on a GPU until the best is separated from the next or "
            "--tune-seconds ends. Prints the table and the winning flags; --tune-out DIR writes tune.json, tune.md "
            "and the timing's bench files (the plot needs pip install 'megatron-cg-plugin[bench]', or "
            "--tune-no-plot). --tune-dry-run lists and predicts on CPU (docs/tune.md).\n\n"
            + helptext.plugin_flags_help()
        )
        return EXIT_OK
    from megatron_cg_plugin.tune import command as tune  # deferred: torch (seconds); --help and golden start without it

    return tune.main(argv)


def _farm(argv: Sequence[str]) -> int:
    """CASE_DIR... [--fit-gpus N] [--data-path DIR] [--out DIR] [--steps N] [--dry-run]
    eager vs graphed on case folders in Megatron's model_config.yaml format (the farm's or Megatron-LM's)"""
    from pathlib import Path

    from megatron_cg_plugin.farm import runner as farm  # deferred: torch (seconds); --help and golden start without it

    parser = OneLineErrors(
        prog="megatron-cg farm",
        description=(
            "Runs each case folder (Megatron's model_config.yaml, the farm's own or one of Megatron-LM's "
            "tests/functional_tests/test_cases) eagerly and with TE graphs through the plugin, and compares them. A "
            "case whose flags Megatron or a rule refuses is reported REFUSED and not run. Exit code: 0 when every case "
            "that ran passed, 1 when one failed, 2 on bad input or when every case was refused."
        ),
    )
    parser.add_argument("cases", nargs="+", help="case folders holding model_config.yaml")
    parser.add_argument("--fit-gpus", type=int, help="scale the parallel sizes and the global batch to N GPUs")
    parser.add_argument("--data-path", help="the folder ${DATA_PATH} stands for (default: mock data)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("farm-out"),
        help="metrics, reports, logs and built datasets (default: farm-out in the current folder)",
    )
    parser.add_argument(
        "--steps", type=int, help=f"training steps per run, >= 1 (default: the case's, else {farm.FARM_STEPS})"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would run and check each case's flags as megatron-cg check does (on CPU), run nothing",
    )
    options = parser.parse_args(argv)
    inputs.require_output_folder("--out", options.out)
    checkout = farm.megatron_lm_dir_from_environment()
    device = gpu_name()
    try:
        prepared = [
            farm.prepare_case(
                folder,
                out_dir=options.out,
                gpus=options.fit_gpus,
                data_path=options.data_path,
                steps=options.steps,
                megatron_lm_dir=checkout,
                platform=farm.DEFAULT_PLATFORM if device is None else farm.platform_of(device),
            )
            for folder in options.cases
        ]
        unmet = next((reason for case, _ in prepared if (reason := case.unmet())), None)
        if unmet:  # a Megatron-LM script the host has no checkout of
            raise CaseError(unmet)
        missing = None if options.dry_run else gpu_stack_missing(max(case.nproc for case, _ in prepared))
        if missing:  # said before any rank starts, after what the cases' own flags break
            for case, _ in prepared:
                _print_refusal(case, farm.refusal_of(case, options.out))
            raise CaseError(f"this host cannot run the cases: it {missing}; --dry-run checks their flags on CPU.")
    except CaseError as error:
        print(f"megatron-cg farm: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    outcomes, rows, refusals = [], [], []
    for case, notes in prepared:
        print(
            f"== {case.name}: {case.nproc} rank(s), {case.steps} steps, "
            f"{'golden file and eager vs graphed' if case.check_golden else 'eager vs graphed'}"
        )
        for note in notes:
            print(f"   {note}")
        outcome, row, refusal = _farm_case(case, options)
        outcomes.append(outcome)
        rows += [row] if row else []
        refusals += [(case, refusal)] if refusal else []
    if rows:
        print(farm.format_summary(rows))
    print(_farm_tally(outcomes))
    if "failed" in outcomes:
        return EXIT_MISMATCH
    if set(outcomes) == {"refused"}:  # nothing could run as written: the first case's cause, where errors go
        _print_refusal(*refusals[0])
        return EXIT_BAD_INPUT
    return EXIT_OK


def _print_refusal(case: farm.FarmCase, refusal: farm.Refusal | None) -> None:
    """A refused case on stderr, its cause (the first broken rule) on the first line."""
    if refusal is not None:
        lines = rules.refusal_lines(refusal.violations)
        run = "" if refusal.mode == "graphed" else f" (the {refusal.mode} run)"
        print(f"megatron-cg farm: {case.name}{run}: " + "\n".join(lines), file=sys.stderr)


def _farm_case(case: farm.FarmCase, options: argparse.Namespace) -> tuple[str, dict | None, farm.Refusal | None]:
    """One case: checked as megatron-cg check checks (a refused case never launches), then run unless
    ``--dry-run``; returns its outcome (passed, failed, refused, checked), its summary row and its refusal."""
    from megatron_cg_plugin.farm import runner as farm  # deferred: imports torch, as in _farm

    if options.dry_run:
        print("   python " + shlex.join(case.argv(graphed=True, out_dir=options.out)))
        if case.resumes:  # the second half, from the eager run's checkpoint
            print("   then python " + shlex.join(case.argv(graphed=True, out_dir=options.out, resumed=True)))
    refusal = farm.refusal_of(case, options.out)
    if refusal is not None:
        print("\n".join(f"   {line}" for line in refusal.lines()))
        return "refused", None, refusal
    if options.dry_run:
        print("   check: OK (Megatron's validation and every rule, eager and graphed)")
        return "checked", None, None
    try:
        result = farm.run_case(case, options.out)
    except farm.FarmRunError as error:  # the next cases still run
        print(_run_failure(error))
        return "failed", None, None
    problems = farm.problems_of(case, result)
    print("   " + ("PASS" if not problems else "FAIL\n   " + "\n   ".join(problems)))
    return ("failed" if problems else "passed"), result.summary(), None


def _farm_tally(outcomes: Sequence[str]) -> str:
    counts = ", ".join(
        f"{outcomes.count(name)} {name}" for name in ("passed", "failed", "checked", "refused") if name in outcomes
    )
    refused = (
        (
            " (refused: Megatron or a plugin rule refuses the case's flags, so it cannot run as written; that "
            "is no failure of the plugin, and each line says what to change)"
        )
        if "refused" in outcomes
        else ""
    )
    return f"farm: {counts}{refused}"


def _run_failure(error: farm.FarmRunError) -> str:
    """A failed farm run: its cause first and last, the failing ranks' output tails between."""
    cause = error.cause.replace("\n", "\n   ")
    tails = "\n".join(f"   | {line}" for line in error.details.rstrip().splitlines())
    return f"   FAIL: {cause}\n{tails}\n   logs: {error.log_dir}\n   FAIL: {cause}"


def _matrix(argv: Sequence[str]) -> int:
    """plan [--out FILE] | run CELLS.json [--out DIR --jobs N --steps N --only CELL...] | bench ... | render CELLS.json RUN.json...
    the support matrix: an all-pairs design (model, scope, precision, capture, micro-batch size, loop), each cell checked by
    the rules, run eager vs graphed through Megatron-LM's pretrain_gpt.py (MEGATRON_LM_DIR), rendered as markdown;
    bench CELLS.json --out DIR [--parallel N --only CELL...] [-- BENCH FLAGS]: each cell's plugin / stock step time"""  # noqa: E501 - its first line is the synopsis `megatron-cg --help` prints whole
    import json
    import tempfile
    from pathlib import Path

    from megatron_cg_plugin.matrix import (
        runner as matrix,  # deferred: torch (seconds); --help and golden start without it
    )

    if argv[:1] == ["bench"]:  # its own parser: the flags after -- go to megatron-cg bench
        from megatron_cg_plugin.matrix import bench as matrix_bench  # deferred: torch, as matrix above

        return matrix_bench.main(argv[1:])
    parser = OneLineErrors(prog="megatron-cg matrix", description=matrix.__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser(
        "bench",
        help="plugin / stock step time per cell (megatron-cg bench) on this GPU host; megatron-cg matrix bench --help",
    )
    plan = sub.add_parser("plan", help="the all-pairs design, each cell checked by the plugin's rules (CPU)")
    plan.add_argument("--out", type=Path, default=Path("matrix-cells.json"))
    run = sub.add_parser("run", help="run the cells eager vs graphed on this GPU host (needs MEGATRON_LM_DIR)")
    run.add_argument("cells", type=Path, help="the cells file `matrix plan` wrote")
    run.add_argument("--out", type=Path, default=Path("matrix-out"))
    run.add_argument("--jobs", type=int, default=1, help="cells run side by side on the one GPU")
    run.add_argument("--steps", type=int, default=matrix.MATRIX_STEPS)
    run.add_argument("--only", nargs="+", help="run only these cells (names from the cells file)")
    render = sub.add_parser("render", help="the support-matrix markdown of the design and its runs' matrix.json")
    render.add_argument("cells", type=Path, help="the cells file `matrix plan` wrote")
    render.add_argument(
        "results",
        type=Path,
        nargs="+",
        help="matrix.json of each run and matrix-bench.json of each bench, later ones win",
    )
    options = parser.parse_args(argv)
    try:
        if options.action == "plan":
            inputs.require_output_file("--out", options.out)  # before the design's minute of checks
            with contextlib.redirect_stdout(io.StringIO()), tempfile.TemporaryDirectory() as data:
                cells = matrix.design(lambda cell: matrix.refusal_of(cell, Path(data)))  # quiet: Megatron's printout
            options.out.parent.mkdir(parents=True, exist_ok=True)
            options.out.write_text(json.dumps([cell.to_json() for cell in cells], indent=1) + "\n")
            refused = sum(bool(cell.refused_by) for cell in cells)
            print(f"{len(cells)} cells ({refused} refused by a rule) -> {options.out}")
            return EXIT_OK
        cells = matrix.load_cells(options.cells)
        if options.action == "render":
            runs = [matrix.load_results(path) for path in options.results]
            print(matrix.render(matrix.merge_results(cells, runs)), end="")
            return EXIT_OK
        if options.jobs < 1 or options.steps < 4:
            raise ValueError("--jobs must be >= 1 and --steps >= 4 (3 eager warmup steps, then graphed ones).")
        selected = matrix.select_cells(cells, options.only, options.cells)  # a misspelt cell before the host
        inputs.require_output_folder("--out", options.out)
        checkout = _matrix_host_ready()
        rows = matrix.run_matrix(
            selected,
            options.out,
            megatron_lm_dir=checkout,
            jobs=options.jobs,
            steps=options.steps,
        )
    except (OSError, ValueError, KeyError) as error:
        print(f"megatron-cg matrix: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_MISMATCH if any(row["result"] in ("differs", "failed") for row in rows) else EXIT_OK


def _matrix_host_ready() -> str:
    """What every cell's runs need, said once before any cell starts: Megatron-LM's pretrain_gpt.py where
    MEGATRON_LM_DIR says (returned), and a GPU with Transformer Engine."""
    from megatron_cg_plugin.farm.runner import megatron_lm_dir_from_environment  # deferred: torch, as in _matrix

    checkout = megatron_lm_dir_from_environment()
    if checkout is None or not os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
        raise ValueError(
            f"MEGATRON_LM_DIR={checkout or '(unset)'} holds no pretrain_gpt.py: every cell runs Megatron-LM's own "
            "script; set MEGATRON_LM_DIR to a Megatron-LM core_r0.19.0 checkout."
        )
    missing = gpu_stack_missing(1)
    if missing:
        raise ValueError(f"this host cannot run the cells: it {missing}; matrix plan checks them on CPU.")
    return checkout


def _run(argv: Sequence[str]) -> int:
    """[--nproc-per-node N] SCRIPT [ARGS...]
    run a Megatron training script (Megatron-LM's pretrain_gpt.py, yours) with the plugin installed"""
    from megatron_cg_plugin.launch import run_script  # deferred: torch (seconds); --help and golden start without it

    return run_script.main(argv)


def _unknown_command(name: str, commands: Collection[str]) -> str:
    close = difflib.get_close_matches(name, list(commands), n=1)
    hint = f", did you mean {close[0]!r}?" if close else ""
    return (
        f"megatron-cg: unknown command {name!r}{hint} The commands: {', '.join(commands)} "
        "(megatron-cg --help lists them with every --cg-* flag)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "bench": _bench,
        "check": _check,
        "farm": _farm,
        "golden": _golden,
        "matrix": _matrix,
        "plan": _plan,
        "run": _run,
        "tune": _tune,
    }
    if not argv or argv[0] in ("-h", "--help"):
        print(helptext.usage(commands))
        return EXIT_OK
    if argv[0] == "--version":
        print(helptext.versions_text())
        return EXIT_OK
    if argv[0] not in commands:
        print(_unknown_command(argv[0], commands), file=sys.stderr)
        return EXIT_BAD_INPUT
    allocator = _allocator_setting_problem(os.environ)
    if allocator:  # before anything imports torch, which parses it then and aborts the process on some values
        print(f"megatron-cg {argv[0]}: {allocator}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # Megatron's notes on optional packages it lacks are no cause of anything a command reports.
    console.hide_optional_package_warnings()
    if argv[0] not in ("run", "bench"):  # a run's other warnings are the script's own business
        # Nor do Megatron's other warnings (deprecations, overridden defaults) change a check or a comparison.
        warnings.filterwarnings("ignore", category=UserWarning)
    if argv[0] == "run":  # what fails inside the user's script is the script's: its traceback is its own
        return commands["run"](argv[1:])
    return _front_door(argv[0], commands[argv[0]], argv[1:])


def _allocator_setting_problem(environ: Mapping[str, str]) -> str | None:
    """The first problem of the caching allocator's settings in ``environ``, naming the variable, or None."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        problems = inputs.allocator_config_problems(environ.get(name))
        if problems:
            return (
                f"{name}={environ[name]!r}: {problems[0]} (torch reads it as it is imported, and stops the process "
                "on some values it cannot parse): fix it or unset it."
            )
    return None


def _front_door(name: str, command: Callable[[Sequence[str]], int], argv: Sequence[str]) -> int:
    """One way out of every command: input the plugin refuses (its ``ValueError`` family, a file it cannot read)
    in one line naming what to change, exit 2; anything else is a bug of the plugin's: its traceback, and a line
    saying so, exit 3."""
    try:
        return command(argv)
    except (ValueError, OSError) as error:
        print(f"megatron-cg {name}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:  # noqa: BLE001 - the last resort: reported as the plugin's bug, not the user's input
        traceback.print_exc()
        print(
            f"megatron-cg {name}: the traceback above is a bug of megatron-cg-plugin, not of your input: please "
            "report it with the command line.",
            file=sys.stderr,
        )
        return console.EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
