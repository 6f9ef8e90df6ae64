"""The farm's ckpt-resume cases, evaluations, per-GPU golden files and TensorBoard folders, on CPU: the command
lines of both halves, the checkpoint rewind between them, the four runs of ``run_case`` (with a fake launch that
writes what each run would), the golden values a resumed job logs, and what ``problems_of`` reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_cg_plugin.farm import runner
from megatron_cg_plugin.farm.case_adapt import adapt_case_args
from megatron_cg_plugin.farm.cases import CaseError
from megatron_cg_plugin.farm.distributed import LaunchResult, MultiRankError
from megatron_cg_plugin.golden import GoldenValues, MetricSeries

VALIDATION = "lm loss validation"
AT = runner.FARM_STEPS // 2  # where a case of the farm's 24 steps resumes
WHERE = f" (resumed from step {AT}: eager from the graphed checkpoint, graphed from the eager one)"
TRACKER = "latest_checkpointed_iteration.txt"
EVALUATES = ("--eval-iters: 2", "--eval-interval: 5")  # after steps 5, 10, 15 and 20


def case_folder(tmp_path: Path, *model_args: str, farm_block: str = "", test_type: str = "ckpt-resume") -> Path:
    """A plugin case file (tiny-gpt plus ``model_args`` lines) under ``tmp_path/cases/gpt/tiny_resume``."""
    folder = tmp_path / "cases" / "gpt" / "tiny_resume"
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"  {arg}\n" for arg in ("--cg-preset: tiny-gpt", *model_args))
    block = "".join(f"  {line}\n" for line in ("nproc: 1", *farm_block.splitlines()))
    (folder / "model_config.yaml").write_text(f"MODEL_ARGS:\n{lines}TEST_TYPE: {test_type}\nCG_FARM:\n{block}")
    return folder


def resume_case(tmp_path: Path, *model_args: str, platform: str = runner.DEFAULT_PLATFORM, **block) -> runner.FarmCase:
    farm_block = "\n".join(f"{key}: {json.dumps(value)}" for key, value in block.items())
    case, _ = runner.prepare_case(
        case_folder(tmp_path, *model_args, farm_block=farm_block), out_dir=tmp_path / "out", platform=platform
    )
    return case


def values(case: runner.FarmCase, first: int, last: int) -> GoldenValues:
    """One run's metrics over steps ``first``-``last``: its losses, and its validation losses where it evaluated."""
    metrics = {"lm loss": MetricSeries({step: 2.0 + step / 64 for step in range(first, last + 1)})}
    evaluated = case.evaluations(first, last)
    if evaluated:
        metrics[VALIDATION] = MetricSeries({step: 3.0 + step / 64 for step in evaluated})
    return GoldenValues(metrics)


def report(case: runner.FarmCase | None = None, first: int = 1, last: int = 0, **scope) -> dict:
    """A graphed run's report: one scope that captured and replayed, and the evaluations of ``first``-``last``."""
    scopes = [{"graphs_captured": 2, "replays": 40, "pool_bytes": 0, "capture_seconds": 1.0, **scope}]
    evaluated = [] if case is None else case.evaluations(first, last)
    return {"scopes": scopes, "evaluations": len(evaluated), "evaluation_eager_layer_calls": 8 * len(evaluated)}


def passing(case: runner.FarmCase) -> runner.CaseResult:
    """A resume case's four runs, each as it should be: every step logged, eager equal to graphed."""
    at, last = case.resume_step(), case.steps
    first_end = at if case.resume_from_exit else last
    second = runner._Resumed(values(case, at + 1, last), values(case, at + 1, last), report(case, at + 1, last))
    first = values(case, 1, first_end)
    return runner.CaseResult(case, first, first, report(case, 1, first_end), "", resumed=second, resume_step=at)


def with_resumed(result: runner.CaseResult, **changes) -> runner.CaseResult:
    return dataclasses.replace(result, resumed=dataclasses.replace(result.resumed, **changes))


def shifted(run: GoldenValues, metric: str, step: int) -> GoldenValues:
    """``run`` with ``metric`` one 64th higher at ``step``."""
    series = dict(run.metrics[metric].values)
    series[step] += 1 / 64
    return GoldenValues({**run.metrics, metric: MetricSeries(series)})


def without_step(run: GoldenValues, step: int) -> GoldenValues:
    return GoldenValues(
        {
            name: MetricSeries({s: v for s, v in series.values.items() if s != step})
            for name, series in run.metrics.items()
        }
    )


def without_metric(run: GoldenValues, metric: str) -> GoldenValues:
    return GoldenValues({name: series for name, series in run.metrics.items() if name != metric})


def checkpoint_flags(argv: list[str]) -> dict[str, str]:
    return {
        flag: argv[argv.index(flag) + 1]
        for flag in ("--save", "--load", "--save-interval", "--exit-interval")
        if flag in argv
    }


# -- the command lines of both halves --------------------------------------------------------------------------


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("from_exit", [False, True])
def test_each_first_half_saves_into_its_own_folder_at_the_middle_step(tmp_path, graphed, from_exit):
    case = resume_case(tmp_path, resume_from_exit=from_exit)
    own = str(case.checkpoint(tmp_path, graphed=graphed))
    argv = case.argv(graphed=graphed, out_dir=tmp_path)
    # Ending on --exit-interval, the save there is the exit's own: --save-interval (needed by --save) is past the end.
    assert checkpoint_flags(argv) == {
        "--save": own,
        "--load": own,
        "--save-interval": "25" if from_exit else str(AT),
        **({"--exit-interval": str(AT)} if from_exit else {}),
    }
    assert argv[argv.index("--train-iters") + 1] == "24"  # an exit at the middle step still trains toward 24
    assert argv[argv.index("--cg-metrics-out") + 1] == str(tmp_path / f"{case.run_name(graphed=graphed)}.metrics.json")
    assert checkpoint_flags(case.argv(graphed=graphed, out_dir=tmp_path, steps=10))["--save-interval"] == (
        "11" if from_exit else "5"
    )


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("from_exit", [False, True])
def test_each_second_half_loads_the_other_runs_checkpoint_and_saves_nothing(tmp_path, graphed, from_exit):
    case = resume_case(tmp_path, resume_from_exit=from_exit)
    argv = case.argv(graphed=graphed, out_dir=tmp_path, resumed=True)
    assert checkpoint_flags(argv) == {"--load": str(case.checkpoint(tmp_path, graphed=not graphed))}
    name = f"tiny_resume.{'graphed' if graphed else 'eager'}.resumed"
    assert argv[argv.index("--cg-report-out") + 1] == str(tmp_path / f"{name}.report.json")
    assert argv[argv.index("--cuda-graph-impl") + 1] == ("transformer_engine" if graphed else "none")


def test_a_regular_case_names_no_checkpoint(tmp_path):
    case, _ = runner.prepare_case(case_folder(tmp_path, test_type="regular"), out_dir=tmp_path)
    assert not case.resumes
    assert checkpoint_flags(case.argv(graphed=True, out_dir=tmp_path)) == {}


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("resumed", [False, True])
def test_each_run_writes_its_own_tensorboard_folder_after_the_cases_own(tmp_path, graphed, resumed):
    case = resume_case(tmp_path, "--tensorboard-dir: ${TENSORBOARD_PATH}")
    argv = case.argv(graphed=graphed, out_dir=tmp_path, resumed=resumed)
    folders = [argv[i + 1] for i, token in enumerate(argv) if token == "--tensorboard-dir"]
    assert len(folders) == 2  # the case's, then the run's: argparse keeps the last
    assert folders[-1] == str(tmp_path / f"{case.run_name(graphed=graphed, resumed=resumed)}.tensorboard")
    assert "--tensorboard-dir" not in resume_case(tmp_path / "plain").argv(graphed=graphed, out_dir=tmp_path)


# -- the rewind between the halves -----------------------------------------------------------------------------


def saved(folder: Path, *steps: int) -> Path:
    for step in steps:
        (folder / f"iter_{step:07d}").mkdir(parents=True)
    return folder


def test_the_rewind_removes_the_last_save_and_points_the_tracker_at_the_resume_step(tmp_path):
    folder = saved(tmp_path / "ckpt", 12, 24)
    runner._rewind(folder, 12, 24)
    assert sorted(path.name for path in folder.iterdir()) == ["iter_0000012", TRACKER]
    assert (folder / TRACKER).read_text() == "12\n"


def test_the_rewind_keeps_the_save_it_resumes_from_when_it_is_the_last(tmp_path):
    folder = saved(tmp_path / "ckpt", 12)
    runner._rewind(folder, 12, 12)
    assert (folder / "iter_0000012").is_dir() and (folder / TRACKER).read_text() == "12\n"


@pytest.mark.parametrize("steps, found", [((10, 24), "iter_0000010, iter_0000024"), ((), "nothing")])
def test_the_rewind_refuses_a_first_half_that_saved_nothing_at_the_step_naming_what_it_found(tmp_path, steps, found):
    folder = saved(tmp_path / "ckpt", *steps)
    with pytest.raises(ValueError, match=rf"saved no checkpoint at step 12 \(found {found}\)"):
        runner._rewind(folder, 12, 24)
    assert not (folder / TRACKER).exists()


# -- run_case: four launches on CPU ----------------------------------------------------------------------------


@dataclasses.dataclass
class Launched:
    run: str  # <case>.<eager|graphed>[.resumed]
    checkpoints: dict[str, str]
    fresh_save: bool | None  # the --save folder did not exist yet (None: no --save)
    loadable: list[str]  # what the --load folder held at launch
    tracker: str | None


class FakeLaunch:
    """Stands in for ``distributed.launch``: records each run and writes what Megatron and the plugin would, the
    metrics of the steps it trains (after the tracker's step where it loads a checkpoint without saving one), a
    report, and (``--save``) an ``iter_*`` folder at each save step; ``fail`` names a run that raises,
    ``saves_nothing`` one that ignores --save (a user's script without checkpoints)."""

    def __init__(self, case: runner.FarmCase, fail: str | None = None, saves_nothing: str | None = None) -> None:
        self.case, self.fail, self.saves_nothing, self.runs = case, fail, saves_nothing, []

    def __call__(self, argv, *, nproc, env, timeout_s, log_dir, master_port) -> LaunchResult:
        argv = list(argv)
        run = Path(argv[argv.index("--cg-metrics-out") + 1]).name.removesuffix(".metrics.json")
        flags = checkpoint_flags(argv)
        save, load = (Path(flags[key]) if key in flags else None for key in ("--save", "--load"))
        tracker = load / TRACKER if load else None
        self.runs.append(
            Launched(
                run,
                flags,
                None if save is None else not save.exists(),
                sorted(path.name for path in load.iterdir()) if load and load.is_dir() else [],
                tracker.read_text() if tracker and tracker.exists() else None,
            )
        )
        if run == self.fail:
            raise MultiRankError(f"{run} failed")
        first = int(self.runs[-1].tracker) + 1 if load and not save else 1
        last = int(flags.get("--exit-interval", argv[argv.index("--train-iters") + 1]))
        if save and run != self.saves_nothing:
            interval = int(flags["--save-interval"])
            for step in {*range(interval, last + 1, interval), last}:
                (save / f"iter_{step:07d}").mkdir(parents=True)
        out = Path(argv[argv.index("--cg-report-out") + 1]).parent
        seconds = dict.fromkeys(range(first, last + 1), 0.5 if ".graphed" in run else 1.0)  # tells the runs apart
        GoldenValues({**values(self.case, first, last).metrics, "iteration-time": MetricSeries(seconds)}).save(
            out / f"{run}.metrics.json"
        )
        (out / f"{run}.report.json").write_text(json.dumps({"run": run, **report(self.case, first, last)}))
        return LaunchResult(nproc=nproc, stdout={0: f"log of {run}"}, stderr={}, wall_s=0.0)


def fake_launch(monkeypatch, case: runner.FarmCase, **fake) -> FakeLaunch:
    launch = FakeLaunch(case, **fake)
    monkeypatch.setattr(runner, "launch", launch)
    return launch


@pytest.mark.parametrize("from_exit", [False, True])
def test_a_resume_case_runs_both_halves_each_second_half_from_the_other_runs_checkpoint(
    tmp_path, monkeypatch, from_exit
):
    case = resume_case(tmp_path, resume_from_exit=from_exit)
    out = tmp_path / "out"
    eager_ckpt, graphed_ckpt = (case.checkpoint(out, graphed=graphed) for graphed in (False, True))
    for stale in (eager_ckpt, graphed_ckpt):  # an earlier farm run's, never resumed from
        saved(stale, 12)
    launch = fake_launch(monkeypatch, case)
    result = runner.run_case(case, out)
    assert [run.run for run in launch.runs] == [
        "tiny_resume.eager",
        "tiny_resume.graphed",
        "tiny_resume.eager.resumed",
        "tiny_resume.graphed.resumed",
    ]
    assert [run.fresh_save for run in launch.runs] == [True, True, None, None]
    assert [run.checkpoints.get("--load") for run in launch.runs[2:]] == [str(graphed_ckpt), str(eager_ckpt)]
    for resumed in launch.runs[2:]:  # rewound: the middle step's save, the tracker pointing at it
        assert resumed.loadable == ["iter_0000012", TRACKER] and resumed.tracker == "12\n"
    assert not eager_ckpt.exists() and not graphed_ckpt.exists()  # removed once both halves ran

    runs = (result.eager, result.graphed, result.resumed.eager, result.resumed.graphed)
    assert [set(run.metrics["iteration-time"].values.values()) for run in runs] == [{1.0}, {0.5}, {1.0}, {0.5}]
    assert result.resume_step == AT and result.report["run"] == "tiny_resume.graphed"
    assert max(result.eager.metrics["lm loss"].values) == (AT if from_exit else 24)
    assert list(result.resumed.eager.metrics["lm loss"].values) == list(range(AT + 1, 25))
    assert result.resumed.report["run"] == "tiny_resume.graphed.resumed"
    assert result.log_tail == "log of tiny_resume.graphed.resumed"
    assert runner.problems_of(case, result, with_golden=False) == []


def test_a_regular_case_runs_eager_then_graphed_and_reads_the_graphed_runs_tensorboard(tmp_path, monkeypatch):
    case, _ = runner.prepare_case(
        case_folder(tmp_path, "--tensorboard-dir: ${TENSORBOARD_PATH}", test_type="regular"), out_dir=tmp_path
    )
    read = []
    monkeypatch.setattr(runner, "_tensorboard_tags", lambda folder: read.append(folder) or ("cuda-graphs/replays",))
    launch = fake_launch(monkeypatch, case)
    result = runner.run_case(case, tmp_path / "out")
    assert [run.run for run in launch.runs] == ["tiny_resume.eager", "tiny_resume.graphed"]
    assert all(run.checkpoints == {} for run in launch.runs)
    assert result.resumed is None and result.resume_step is None
    assert read == [tmp_path / "out" / "tiny_resume.graphed.tensorboard"]
    assert result.tensorboard_tags == ("cuda-graphs/replays",)


@pytest.mark.parametrize(
    "fake, mode, cause",
    [
        ({"fail": "tiny_resume.graphed.resumed"}, "graphed resumed", "tiny_resume.graphed.resumed failed"),
        # The first half exits cleanly without a save to resume from: that half's failure, not a crash of the farm.
        ({"saves_nothing": "tiny_resume.graphed"}, "graphed", "saved no checkpoint at step 12 (found nothing)"),
    ],
)
def test_a_failed_half_is_a_farm_run_failure_naming_the_half(tmp_path, monkeypatch, fake, mode, cause):
    case = resume_case(tmp_path)
    launch = fake_launch(monkeypatch, case, **fake)
    with pytest.raises(runner.FarmRunError) as error:
        runner.run_case(case, tmp_path / "out")
    run = f"tiny_resume.{mode.replace(' ', '.')}"
    assert error.value.mode == mode and error.value.log_dir == tmp_path / "out" / f"{run}.logs"
    assert error.value.cause.startswith(f"the {mode} run failed: ") and cause in error.value.cause
    assert launch.runs[-1].run == run  # nothing ran after it


# -- the golden values a resumed job logs ----------------------------------------------------------------------


def series_of(run: GoldenValues) -> dict[str, tuple[dict[int, float], int]]:
    return {name: (dict(series.values), series.step_interval) for name, series in run.metrics.items()}


def test_the_golden_run_is_the_first_half_up_to_the_resume_step_and_the_resumed_graphed_run_after(tmp_path):
    case = resume_case(tmp_path)
    first = GoldenValues(
        {
            "lm loss": MetricSeries(dict.fromkeys(range(1, 25), 1.0)),
            VALIDATION: MetricSeries({5: 1.0, 10: 1.0, 15: 1.0, 20: 1.0}, 5),
            "only before": MetricSeries({3: 1.0, 20: 1.0}),
            "gone after the resume": MetricSeries({20: 1.0}),  # nothing of it up to the resume step: left out
        }
    )
    second = GoldenValues(
        {
            "lm loss": MetricSeries(dict.fromkeys(range(13, 25), 2.0)),
            VALIDATION: MetricSeries({15: 2.0, 20: 2.0}, 5),
            "only after": MetricSeries({20: 2.0}),
        }
    )
    result = dataclasses.replace(passing(case), graphed=first)
    result = with_resumed(result, graphed=second)  # not the resumed eager run: it is compared, never recorded
    assert series_of(result.golden_run()) == {
        "lm loss": ({**dict.fromkeys(range(1, 13), 1.0), **dict.fromkeys(range(13, 25), 2.0)}, 1),
        VALIDATION: ({5: 1.0, 10: 1.0, 15: 2.0, 20: 2.0}, 5),
        "only before": ({3: 1.0}, 1),
        "only after": ({20: 2.0}, 1),
    }
    assert dataclasses.replace(result, resumed=None).golden_run() is first  # a case that does not resume


# -- problems_of for a resumed case ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_args", [(), EVALUATES], ids=["trains", "evaluates"])
@pytest.mark.parametrize("from_exit", [False, True])
def test_a_resume_case_whose_halves_agree_passes(tmp_path, model_args, from_exit):
    case = resume_case(tmp_path, *model_args, resume_from_exit=from_exit)
    assert runner.problems_of(case, passing(case), with_golden=False) == []


def resumed_report(**fields):
    return lambda r: with_resumed(r, report={**r.resumed.report, **fields})


def first_report(**fields):
    return lambda r: dataclasses.replace(r, report={**r.report, **fields})


@pytest.mark.parametrize(
    "change, problems",
    [
        pytest.param(
            lambda r: with_resumed(r, graphed=shifted(r.resumed.graphed, "lm loss", 20)),
            [f"lm loss differs eager vs graphed{WHERE} (step: eager, graphed): {{20: (2.3125, 2.328125)}}"],
            id="a differing step",
        ),
        pytest.param(
            lambda r: with_resumed(r, graphed=without_step(r.resumed.graphed, 24)),
            [
                f"expected steps 13-24 logged{WHERE}, got 12 eager / 11 graphed",
                f"lm loss differs eager vs graphed{WHERE} (step: eager, graphed): {{24: (2.375, None)}}",
            ],
            id="a step missing",
        ),
        pytest.param(
            resumed_report(scopes=report(replays=0)["scopes"]),
            [f"nothing captured or replayed after the resume{WHERE}"],
            id="captured, never replayed",
        ),
        pytest.param(
            resumed_report(scopes=report(rejected=3)["scopes"]),
            [f"3 replays refused by their contract{WHERE}"],
            id="replays refused",
        ),
        pytest.param(
            resumed_report(scopes=report(failure="out of memory")["scopes"]),
            [f"capture failed{WHERE}: out of memory"],
            id="capture failed",
        ),
    ],
)
def test_what_goes_wrong_after_the_resume_is_reported_as_the_resumed_halfs(tmp_path, change, problems):
    case = resume_case(tmp_path)
    assert runner.problems_of(case, change(passing(case)), with_golden=False) == problems


@pytest.mark.parametrize(
    "from_exit, problems", [(True, []), (False, ["expected steps 1-24 logged, got 12 eager / 12 graphed"])]
)
def test_a_first_half_that_exits_at_the_middle_step_logs_only_its_steps(tmp_path, from_exit, problems):
    case = resume_case(tmp_path, resume_from_exit=from_exit)
    half = values(case, 1, AT)
    result = dataclasses.replace(passing(case), eager=half, graphed=half)
    assert runner.problems_of(case, result, with_golden=False) == problems


# -- evaluations -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_args, interval",
    [
        (EVALUATES, 5),
        ((), None),
        (("--eval-iters: 0", "--eval-interval: 5"), None),  # Megatron evaluates nothing without iterations
        (("--eval-interval: 5",), None),  # the presets' --eval-iters 0
    ],
)
def test_only_a_case_that_evaluates_compares_its_validation_losses(tmp_path, model_args, interval):
    case = resume_case(tmp_path, *model_args)
    assert case.eval_interval == interval
    assert case.evaluations(1, 24) == ([5, 10, 15, 20] if interval else [])
    assert (VALIDATION in case.equal_metrics) == (VALIDATION in case.compared_metrics) == bool(interval)


@pytest.mark.parametrize(
    "change, problems",
    [
        pytest.param(first_report(evaluations=3), ["expected 4 evaluations, the report has 3"], id="count"),
        pytest.param(
            resumed_report(evaluations=1), [f"expected 2 evaluations{WHERE}, the report has 1"], id="resumed count"
        ),
        pytest.param(first_report(evaluation_replays=2), ["2 graph replays inside evaluations"], id="replays"),
        pytest.param(
            resumed_report(evaluation_eager_layer_calls=0),
            [f"no graphed layer ran in the evaluations after capture{WHERE}"],
            id="no eager calls",
        ),
        pytest.param(
            lambda r: with_resumed(r, graphed=shifted(r.resumed.graphed, VALIDATION, 20)),
            [f"{VALIDATION} differs eager vs graphed{WHERE} (step: eager, graphed): {{20: (3.3125, 3.328125)}}"],
            id="validation loss",
        ),
    ],
)
def test_what_goes_wrong_in_an_evaluation_is_reported_with_its_half(tmp_path, change, problems):
    case = resume_case(tmp_path, *EVALUATES)
    assert runner.problems_of(case, change(passing(case)), with_golden=False) == problems


def test_a_case_that_does_not_evaluate_needs_no_evaluation_figures_in_its_reports(tmp_path):
    case = resume_case(tmp_path)
    bare = {"scopes": report()["scopes"]}  # no evaluation fields at all
    result = with_resumed(dataclasses.replace(passing(case), report=bare), report=bare)
    assert runner.problems_of(case, result, with_golden=False) == []


@pytest.mark.parametrize(
    "change, problems",
    [
        (resumed_report(evaluation_eager_layer_calls=0), []),  # its one evaluation, after step 15: before capture
        (first_report(evaluation_eager_layer_calls=0), ["no graphed layer ran in the evaluations after capture"]),
    ],
    ids=["resumed half", "first half"],
)
def test_graphed_layers_must_run_in_evaluations_only_once_their_half_captured(tmp_path, change, problems):
    # Both halves evaluate after step 15 alone; the second half captures after its own 3 warmup steps (15).
    case = resume_case(tmp_path, "--eval-iters: 1", "--eval-interval: 15")
    assert runner.problems_of(case, change(passing(case)), with_golden=False) == problems


def test_a_validation_loss_is_missed_only_in_a_half_that_evaluated(tmp_path):
    case = resume_case(tmp_path, "--eval-iters: 1", "--eval-interval: 20", resume_from_exit=True)
    result = passing(case)
    assert VALIDATION not in result.graphed.metrics  # the first half stops at step 12, before any evaluation
    assert runner.problems_of(case, result, with_golden=False) == []
    missing = with_resumed(result, graphed=without_metric(result.resumed.graphed, VALIDATION))
    assert runner.problems_of(case, missing, with_golden=False) == [
        f"{VALIDATION} was not recorded by the graphed run{WHERE}"
    ]


# -- golden files per GPU --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, platform",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA L40S", "l40s"),
    ],
)
def test_a_gpus_name_gives_megatrons_golden_file_name(device, platform):
    assert runner.platform_of(device) == platform
    assert runner.golden_file(platform) == f"golden_values_dev_dgx_{platform}.json"


@pytest.mark.parametrize(
    "recorded, platform, problems",
    [
        (("h100", "a100"), "h100", []),
        (
            ("h100", "a100"),
            "h200",
            [
                "no golden file {folder}/golden_values_dev_dgx_h200.json for this GPU (h200; there are "
                "golden_values_dev_dgx_a100.json, golden_values_dev_dgx_h100.json): write it from a real run on "
                "this GPU with MEGATRON_CG_UPDATE_GOLDEN=1 bash ci/run_gpu_functional.sh"
            ],
        ),
        (
            (),
            "h200",
            [
                "no golden file {folder}/golden_values_dev_dgx_h200.json for this GPU (h200): write it from a real "
                "run on this GPU with MEGATRON_CG_UPDATE_GOLDEN=1 bash ci/run_gpu_functional.sh"
            ],
        ),
    ],
)
def test_a_run_is_held_to_its_own_gpus_golden_file_of_what_a_resumed_job_logs(tmp_path, recorded, platform, problems):
    case = resume_case(tmp_path, platform=platform, golden_metrics=["lm loss"])
    # The second half trains differently from the first half's steps 13-24: the golden file holds the resumed ones.
    later = shifted(values(case, AT + 1, 24), "lm loss", 20)
    result = with_resumed(passing(case), eager=later, graphed=later)
    for gpu in recorded:
        result.golden_run().save(case.folder / runner.golden_file(gpu))
    expected = [problem.format(folder=case.folder) for problem in problems]
    assert runner.problems_of(case, result) == expected


def test_load_cases_holds_every_case_to_the_named_gpus_files(tmp_path):
    case_folder(tmp_path)
    (case,) = runner.load_cases(tmp_path / "cases", platform="h100")
    assert case.platform == "h100" and case.golden_path == case.folder / "golden_values_dev_dgx_h100.json"
    (default,) = runner.load_cases(tmp_path / "cases")
    assert default.golden_path.name == f"golden_values_dev_dgx_{runner.DEFAULT_PLATFORM}.json"


# -- case files: what a resume case leaves to the farm ---------------------------------------------------------


@pytest.mark.parametrize("flag", ["--save", "--load", "--save-interval", "--exit-interval"])
def test_a_plugin_resume_case_leaves_its_checkpoint_flags_to_the_farm(tmp_path, flag):
    with pytest.raises(CaseError, match=f"a ckpt-resume case leaves {flag} to the farm"):
        resume_case(tmp_path, f"{flag}: 12")
    regular = case_folder(tmp_path / "regular", f"{flag}: 12", test_type="regular")
    assert flag in runner.prepare_case(regular, out_dir=tmp_path)[0].flags  # a regular case's flags are its own


@pytest.mark.parametrize(
    "test_type, farm_block, refusal",
    [
        ("regular", "resume_from_exit: true", "CG_FARM resume_from_exit needs TEST_TYPE ckpt-resume"),
        ("ckpt-resume", "steps: 1", "a ckpt-resume case needs 2 or more steps"),
    ],
)
def test_resume_settings_a_case_cannot_run_are_refused(tmp_path, test_type, farm_block, refusal):
    folder = case_folder(tmp_path, farm_block=farm_block, test_type=test_type)
    with pytest.raises(CaseError, match=refusal):
        runner.prepare_case(folder, out_dir=tmp_path)


def test_a_megatron_resume_case_file_keeps_its_checkpoint_format_through_prepare_case(tmp_path):
    folder = tmp_path / "megatron_resume"
    folder.mkdir()
    (folder / "model_config.yaml").write_text(
        "MODEL_ARGS:\n  --num-layers: 2\n  --save: ${CHECKPOINT_SAVE_PATH}\n  --ckpt-format: torch_dist\n"
        "TEST_TYPE: ckpt-resume\n"
    )
    case, _ = runner.prepare_case(folder, out_dir=tmp_path, gpus=1)  # one of Megatron's own: no CG_FARM block
    assert case.resumes and "--save" not in case.flags
    assert case.flags[case.flags.index("--ckpt-format") + 1] == "torch_dist"


MEGATRON_CHECKPOINT_ARGS = {
    "--save": "${CHECKPOINT_SAVE_PATH}",
    "--load": "${CHECKPOINT_LOAD_PATH}",
    "--save-interval": 50,
    "--exit-interval": 50,
    "--finetune": True,
    "--pretrained-checkpoint": "/pretrained",
    "--ckpt-format": "torch_dist",
    "--ckpt-fully-parallel-save": True,
    "--no-load-optim": True,
    "--num-layers": 2,
}
FARMS_FOLDERS = "the farm gives each run its folders and save step"
FOREIGN = "the farm starts from no other checkpoint"
FARMS_STEPS = "the farm sets the steps and runs eager and graphed"
NO_CHECKPOINT = "the farm keeps no checkpoint"


@pytest.mark.parametrize(
    "resumes, kept, dropped",
    [
        (
            True,
            ("--ckpt-format", "--ckpt-fully-parallel-save", "--no-load-optim", "--num-layers"),
            {
                "--save": FARMS_FOLDERS,
                "--load": FARMS_FOLDERS,
                "--save-interval": FARMS_FOLDERS,
                "--exit-interval": FARMS_STEPS,
                "--finetune": FOREIGN,
                "--pretrained-checkpoint": FOREIGN,
            },
        ),
        (
            False,
            ("--num-layers",),
            {
                **dict.fromkeys(
                    (
                        "--save",
                        "--load",
                        "--save-interval",
                        "--finetune",
                        "--pretrained-checkpoint",
                        "--ckpt-format",
                        "--ckpt-fully-parallel-save",
                        "--no-load-optim",
                    ),
                    NO_CHECKPOINT,
                ),
                "--exit-interval": FARMS_STEPS,
            },
        ),
    ],
    ids=["ckpt-resume", "regular"],
)
def test_a_megatron_resume_case_keeps_its_checkpoint_options_but_not_the_farms_folders(
    tmp_path, resumes, kept, dropped
):
    args, _, changes = adapt_case_args(
        MEGATRON_CHECKPOINT_ARGS, data_path="/data", out_dir=tmp_path, apex_wgrad=True, resumes=resumes
    )
    assert args == {flag: MEGATRON_CHECKPOINT_ARGS[flag] for flag in kept}
    assert sorted(changes) == sorted(f"{flag} dropped: {why}" for flag, why in dropped.items())


# -- TensorBoard -----------------------------------------------------------------------------------------------

TENSORBOARD = ("--tensorboard-dir: ${TENSORBOARD_PATH}",)
LOGGED = "--cg-log-to-tensorboard: true"


@pytest.mark.parametrize(
    "model_args, tags, problems",
    [
        (
            (*TENSORBOARD, LOGGED),
            (),
            ["--cg-log-to-tensorboard: the graphed run's TensorBoard holds no cuda-graphs/ figures, only []"],
        ),
        (
            (*TENSORBOARD, LOGGED),
            ("lm loss",),
            ["--cg-log-to-tensorboard: the graphed run's TensorBoard holds no cuda-graphs/ figures, only ['lm loss']"],
        ),
        ((*TENSORBOARD, LOGGED), ("cuda-graphs/graphs-captured", "lm loss"), []),
        (TENSORBOARD, (), []),  # Megatron's own TensorBoard, no figures of the plugin asked for
    ],
)
def test_the_report_logged_to_tensorboard_must_be_found_there(tmp_path, model_args, tags, problems):
    case = resume_case(tmp_path, *model_args)
    result = dataclasses.replace(passing(case), tensorboard_tags=tags)
    assert runner.problems_of(case, result, with_golden=False) == problems
