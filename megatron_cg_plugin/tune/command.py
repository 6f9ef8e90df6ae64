"""``megatron-cg tune [SCRIPT.py] <flags>``: which CUDA-graph setup to train a model with.

From the model's flags it lists the setups that fit the model (``setups.graph_setups``, the list the memory
guard reads too), checks each one's flags (``tune.candidates.setup_flags``) as ``megatron-cg check`` does
(Megatron's validation and the one rule list, ``rules.check_run``: a refused setup keeps its rules),
predicts each one's graph memory as the run's report does (``planner.prediction.predict_graph_memory``),
drops those over the memory budget, and times the rest in one process on the GPU (``tune.timing``, the
bench's schedules) until the best is separated from the next or ``--tune-seconds`` ends.
``--tune-dry-run`` stops before the timing, on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_cg_plugin import inputs, rules
from megatron_cg_plugin.bench import output as bench_output
from megatron_cg_plugin.bench.command import (
    BenchOptions,
    device_time_per_step,
    first_train_step,
    refuse_unbenchable,
    run_in_first_train_step,
    user_script,
)
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.farm.distributed import gpu_stack_missing
from megatron_cg_plugin.launch import dry_run
from megatron_cg_plugin.launch.presets import expand_preset, find_preset
from megatron_cg_plugin.parse_errors import unknown_own_flag
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.setups.graph_setups import EAGER, GraphSetup, ModelKind, enumerate_setups, graph_bytes
from megatron_cg_plugin.tune import ranking
from megatron_cg_plugin.tune.candidates import (
    build_time_notes,
    built_setup,
    given_setup,
    placement,
    same_graphs,
    setup_flags,
    strip_flags,
)
from megatron_cg_plugin.tune.ranking import Row
from megatron_cg_plugin.tune.timing import TimingOptions, TimingResult, length_flags, time_setups

__all__ = ["TuneError", "TunePlan", "main", "plan_setups", "report"]


class TuneError(ValueError):
    """The tune cannot run as asked; the message names what to change."""


@dataclasses.dataclass(frozen=True)
class _TuneOptions:
    memory_gib: float | None = None  # the graphs' memory budget (None: on the GPU, the device's less eager's peak)
    seconds: float = 300.0  # timing, both schedules together
    out: Path | None = None
    dry_run: bool = False
    plot: bool = True

    def __post_init__(self) -> None:
        if self.memory_gib is not None and not (math.isfinite(self.memory_gib) and self.memory_gib > 0):
            raise TuneError(
                f"--tune-memory-gib {self.memory_gib:g}: give the GiB the graphs may take, above 0 (e.g. 20), "
                "or leave it out for the device's memory less eager's peak."
            )
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise TuneError(f"--tune-seconds {self.seconds:g}: give the seconds of timing, above 0 (e.g. 300).")
        if self.out is not None:  # before any setup is checked or timed
            problem = inputs.output_folder_problem("--tune-out", self.out)
            if problem is not None:
                raise TuneError(problem)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.memory_gib is None else int(self.memory_gib * 2**30)


def _number(flag: str, text: str | None) -> float | None:
    """``text`` as given after ``flag`` read as a number (argparse's own type errors name no fix)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise TuneError(f"{flag} {text!r}: give a number.") from None


def _parse_tune_argv(argv: Sequence[str]) -> tuple[_TuneOptions, list[str]]:
    """The tune's own ``--tune-*`` options, and the flags left (a script first, if any)."""
    parser = argparse.ArgumentParser(prog="megatron-cg tune", add_help=False)
    parser.add_argument("--tune-memory-gib")
    parser.add_argument("--tune-seconds", default=str(_TuneOptions.seconds))
    parser.add_argument("--tune-out", type=Path)
    parser.add_argument("--tune-no-plot", action="store_true")
    parser.add_argument("--tune-dry-run", action="store_true")
    known, flags = parser.parse_known_args(list(argv))
    typo = unknown_own_flag(parser, flags, "--tune-", "tune")
    if typo is not None:
        raise TuneError(typo)
    try:
        find_preset(flags)  # a misspelt preset, named before anything is built
    except ValueError as error:
        raise TuneError(str(error)) from None
    options = _TuneOptions(
        memory_gib=_number("--tune-memory-gib", known.tune_memory_gib),
        seconds=_number("--tune-seconds", known.tune_seconds) or 0.0,
        out=known.tune_out,
        dry_run=known.tune_dry_run,
        plot=not known.tune_no_plot,
    )
    return options, flags


# Checks a setup's flags with the environment it needs beyond the user's (NAME=value); raises the rules'
# RuleViolation or the dry run's CheckError.
Validate = Callable[[Sequence[str], tuple[str, ...]], tuple[RunSettings, PluginConfig | None]]


@dataclasses.dataclass(frozen=True)
class TunePlan:
    """The setups of one model, checked and predicted: its rows in ``enumerate_setups``' order, the plugin
    config each allowed setup's flags resolve, and the setup whose flags the timing process builds with."""

    kind: ModelKind
    base: tuple[str, ...]  # the user's flags, preset expanded
    rows: tuple[Row, ...]
    configs: dict[str, PluginConfig]
    built: GraphSetup | None

    @property
    def built_flags(self) -> list[str]:
        assert self.built is not None, "no setup to build the timing process with"
        return setup_flags(self.base, self.built)


def _expanded(flags: Sequence[str]) -> list[str]:
    """``flags`` with the preset's in front and ``--cg-preset`` gone, so a setup can drop a preset's flag."""
    return strip_flags(expand_preset(flags), {"--cg-preset": 1})


def plan_setups(flags: Sequence[str], validate: Validate) -> TunePlan:
    """Every setup of the model ``flags`` describe: eager, then ``setups.graph_setups``' list, each setup built
    from its own flags (``setup_flags``) through ``validate`` (a refusal keeps its rules), checked,
    predicted and placed. The eager setup's check comes first and is the model's own: its refusal is raised
    (the flags describe no model to tune)."""
    base = _expanded(flags)
    eager = GraphSetup(graphed=False)
    eager_settings, eager_config = validate(setup_flags(base, eager), ())
    kind = ModelKind.of(eager_settings)
    yours = given_setup(base, kind)
    kind = dataclasses.replace(kind, modules=yours.modules if yours.graphed else None)  # the user's scope is weighed

    def build(setup: GraphSetup, environment: tuple[str, ...]) -> tuple[RunSettings, PluginConfig | None]:
        try:
            return validate(setup_flags(base, setup), environment)
        except dry_run.CheckError as refusal:
            raise rules.RuleViolation(refusal.violations) from refusal

    rows = [Row(eager, tuple(setup_flags(base, eager)), yours=eager == yours, schedule="steps")]
    configs = {eager.label: eager_config or PluginConfig()}
    for setup in enumerate_setups(eager_settings, configs[eager.label], kind=kind, build=build):
        graph, flags_of = setup.graph, tuple(setup_flags(base, setup.graph))
        if setup.refused:
            rows.append(
                Row(graph, flags_of, yours=graph == yours, environment=setup.environment, refused=setup.refused)
            )
            continue
        assert setup.settings is not None and setup.config is not None  # built: enumerate_setups read them
        configs[graph.label] = setup.config
        where = placement(graph, setup.settings, kind, setup.environment)
        rows.append(
            Row(
                graph,
                flags_of,
                yours=graph == yours,
                environment=setup.environment,
                predicted_bytes=graph_bytes(setup.plan),
                prediction_leaves_out=() if setup.plan is None else setup.plan.unpredicted,
                schedule=where.schedule,
                why=where.why,
            )
        )
    rows = _timed_once(rows, kind)
    built = built_setup([row.setup for row in rows if row.timable], kind, kind.modules)
    if built is not None:
        rows = [
            dataclasses.replace(row, notes=build_time_notes(row.setup, built, kind)) if row.timable else row
            for row in rows
        ]
    return TunePlan(kind, tuple(base), tuple(rows), configs, built)


def _timed_once(rows: Sequence[Row], kind: ModelKind) -> list[Row]:
    """``rows`` with each whole-layer setup that captures the same graphs as a timed ``attn mlp`` one
    (``candidates.same_graphs``) left out of the timing, which would only find them tied."""
    timable = {row.setup: row for row in rows if row.timable}
    found = []
    for row in rows:
        twin_setup = same_graphs(row.setup, kind) if row.timable else None
        twin = None if twin_setup is None else timable.get(twin_setup)
        if twin is not None:
            why = (
                f"the same graphs as {twin.label} on layers without MoE (Megatron captures a dense layer's "
                f"attention and MLP in one graph for either scope): timed once, as {twin.label}"
            )
            row = dataclasses.replace(row, schedule=None, why=why)
        found.append(row)
    return found


def _validator(*, launcher: bool) -> Validate:
    env = dict(os.environ)

    def validate(flags: Sequence[str], environment: tuple[str, ...]) -> tuple[RunSettings, PluginConfig | None]:
        extra = dict(item.split("=", 1) for item in environment)
        with dry_run.scoped_environ(**extra):  # Megatron's validation reads os.environ, the rules ``env``
            _args, settings, config = dry_run.validated_args(flags, nproc=1, env=env | extra, launcher=launcher)
        return settings, config

    return validate


def report(
    plan: TunePlan,
    rows: Sequence[Row],
    *,
    budget: str,
    stopped: dict[str, str] | None = None,
    eager_seconds: dict[str, float] | None = None,
) -> list[str]:
    """What the tune prints: the model, the table, the refusals' and the notes' words, the budget, how timing
    stopped, eager's step in each schedule (``eager_seconds``), and the winning flags (or why graphs do not
    pay)."""
    lines = [f"megatron-cg tune: {plan.kind.describe()}; {len(rows)} setups", "", ranking.table(rows), ""]
    refused = [row for row in rows if row.refused]
    if refused:
        lines.append("refused by the rules (docs/troubleshooting.md):")
        lines += [f"  {row.label}: [{name}] {message}" for row in refused for name, message in row.refused]
    noted = [row for row in rows if (row.why and not row.refused) or row.notes or row.prediction_leaves_out]
    lines += ["notes:"] if noted else []
    for row in noted:
        words = [f"{'timed in blocks' if row.schedule == 'blocks' else 'not timed'}: {row.why}"] if row.why else []
        words += [f"timed with {note}" for note in row.notes]
        words += [f"the prediction leaves out {what}" for what in row.prediction_leaves_out]
        lines.append(f"  {row.label}: " + "; ".join(words))
    lines.append(f"graph memory budget: {budget}")
    if plan.built is not None:
        lines.append(f"the timing process builds the model with {plan.built.label}'s flags; each arm sets its scope")
    if stopped:
        lines.append("timing stopped: " + ", ".join(f"{schedule} schedule {why}" for schedule, why in stopped.items()))
    if eager_seconds and len(eager_seconds) > 1:  # each schedule's ratios are to its own eager steps
        each = [f"{seconds * 1e3:.1f} ms in the {schedule} schedule" for schedule, seconds in eager_seconds.items()]
        lines.append(f"eager's median step: {', '.join(each)} (the schedules' ratios compare as far as these agree)")
    lines += ranking.winner_lines(rows, plan.kind.offload)
    return lines


def main(argv: Sequence[str]) -> int:
    options, flags = _parse_tune_argv(argv)
    script = user_script(flags)
    if script is not None:
        flags = flags[1:]
    # Checked as the timing runs them: the run's length is the tune's, whatever the flags give (or not)
    plan = plan_setups([*flags, *length_flags(TimingOptions(options.seconds), 1)], _validator(launcher=script is None))
    if options.dry_run:
        return _untimed(plan, options, "dry run: nothing timed (drop --tune-dry-run to time them on a GPU)")
    missing = gpu_stack_missing(1)
    if missing:
        raise TuneError(
            f"megatron-cg tune times the setups on a GPU with Transformer Engine, and this host {missing}; "
            "--tune-dry-run lists and predicts them on CPU."
        )
    if options.out is not None and options.plot:
        try:
            bench_output.plot_available()
        except bench_output.BenchOutputError as error:
            raise TuneError(str(error).replace("--bench-no-plot", "--tune-no-plot")) from None
    if plan.built is None:
        return _untimed(
            plan,
            options,
            "no graphed setup is left to time: every one is refused or cannot run in this process (above).",
        )
    timing = _time(plan, options, script)
    budget = (
        "none" if timing.budget_bytes is None else f"{timing.budget_bytes / 2**20:.0f} MiB ({timing.budget_source})"
    )
    summaries = {schedule: result.summary() for schedule, result in timing.results.items()}
    eager = {schedule: summary.arms[EAGER].median for schedule, summary in summaries.items() if EAGER in summary.arms}
    lines = report(plan, timing.rows, budget=budget, stopped=timing.stopped, eager_seconds=eager)
    if not timing.results:
        lines.append("nothing was timed: every graphed setup is refused, over the budget or not in this process")
    print("\n".join(lines))
    if options.out is not None:
        extra = {
            "dry_run": False,
            "budget_bytes": timing.budget_bytes,
            "budget_source": timing.budget_source,
            "eager_peak_bytes": timing.eager_peak_bytes,
            "stopped": timing.stopped,
        }
        _write(options.out, plan, timing.rows, lines, extra, timing.results, plot=options.plot)
    return 0


def _untimed(plan: TunePlan, options: _TuneOptions, why: str) -> int:
    """The table and the files of a tune that times nothing (a dry run, or nothing left to time): each setup's
    rules, prediction and budget (``--tune-memory-gib`` where given), and ``why``."""
    rows = ranking.apply_budget(plan.rows, options.budget_bytes, source="--tune-memory-gib")
    budget = (
        "none given (on the GPU: the device's memory less eager's peak and 5%)"
        if options.memory_gib is None
        else f"{options.memory_gib:g} GiB (--tune-memory-gib)"
    )
    lines = [*report(plan, rows, budget=budget), why]
    print("\n".join(lines))
    if options.out is not None:
        _write(options.out, plan, rows, lines, {"dry_run": options.dry_run, "budget_bytes": options.budget_bytes})
    return 0


def _time(plan: TunePlan, options: _TuneOptions, script: Path | None) -> TimingResult:
    """The timing process: the model built with ``plan.built``'s flags, the setups timed in its first train_step."""
    from megatron.training import training

    timing_options = TimingOptions(seconds=options.seconds)
    flags = [*plan.built_flags, *length_flags(timing_options, len(plan.rows))]
    arms = {row.label: (row.setup, plan.configs[row.label]) for row in plan.rows if row.timable and row.setup.graphed}
    sink: list[TimingResult] = []

    def check(settings: RunSettings, config: PluginConfig) -> None:
        refuse_unbenchable(settings, config, BenchOptions(arms=("eager", "plugin")))

    def make_driver(before: Callable[[], None] | None) -> Callable[..., Any]:
        train_step = training.train_step

        def run(args: tuple, kwargs: dict) -> tuple[TimingResult, Any]:
            import torch

            from megatron_cg_plugin.tune.trainer import TuneTrainer  # deferred: Megatron's and TE's side

            trainer = TuneTrainer(train_step, args, kwargs, setups=arms)
            device = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            found = time_setups(
                plan.rows,
                trainer,
                options=timing_options,
                budget_bytes=options.budget_bytes,
                device_bytes=device,
                flags=flags,
                clock=time.perf_counter,
                profile=functools.partial(device_time_per_step, table_dir=None),
            )
            return found, trainer

        return first_train_step(train_step, sink, run, before)

    code = run_in_first_train_step(script, flags, training, check, make_driver, command="tune")
    if not sink:
        raise TuneError(
            f"{script} exited with code {code} before the tune ran; its output is above."
            if code
            else "Megatron's pretrain() returned without training (see the log above)."
        )
    return sink[0]


def _write(
    out: Path,
    plan: TunePlan,
    rows: Sequence[Row],
    lines: Sequence[str],
    extra: dict,
    results: dict[str, bench_output.BenchResult] | None = None,
    *,
    plot: bool = False,
) -> None:
    """``tune.json`` and ``tune.md`` in ``out``; after timing, each schedule's bench files in ``out/<schedule>``."""
    out.mkdir(parents=True, exist_ok=True)
    data = ranking.to_json(rows, model=plan.kind.describe(), flags=list(plan.base), **extra)
    (out / "tune.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "tune.md").write_text("\n".join(lines) + "\n")
    written = [out / "tune.json", out / "tune.md"]
    for schedule, result in (results or {}).items():
        written += bench_output.write(result, out / schedule, with_plot=plot)
    for path in written:
        print(f"megatron-cg tune: wrote {path}")
