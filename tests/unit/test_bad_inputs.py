"""Bad input across the commands: each ends with exit code 2, no traceback, and a line naming the flag,
file or variable, what is wrong and what to give, before any long work starts. One table, run
in-process from a folder holding the files the rows name; a rule's refusal is asserted by the rule's
name and the flag anywhere in stderr (its layout is the refusal's), any other refusal by its first line.
Then the shared checks themselves (``megatron_cg_plugin.inputs``), and what is not refused."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shlex
from pathlib import Path

import pytest

from megatron_cg_plugin import cli, console, golden, inputs, installation, refusal
from megatron_cg_plugin.golden import GoldenValues, MetricSeries
from megatron_cg_plugin.launch import pretrain_gpt
from megatron_cg_plugin.matrix.runner import Cell

TE = "--cuda-graph-impl transformer_engine"
GPT = ["--cg-preset", "tiny-gpt"]
ALLOC_YES = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:yes"}
CONNECTIONS_ONE = {"CUDA_DEVICE_MAX_CONNECTIONS": "one"}
# Every variable a row sets or a command reads from the environment: unset around each test.
VARIABLES = (
    *inputs.PROCESS_VARIABLES,
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    *inputs.ALLOCATOR_VARIABLES,
    "NCCL_GRAPH_REGISTER",
    "MEGATRON_LM_DIR",
)
GOOD_CELL = {"model": "gpt", "scope": "layer", "precision": "bf16", "capture": "te", "mbs": "1", "loop": "train"}
VALIDATING_SCRIPT = """\
from megatron.training.arguments import parse_and_validate_args
from megatron_cg_plugin.host_stand_ins import gpu_host_stand_ins

with gpu_host_stand_ins():
    parse_and_validate_args()
"""


@dataclasses.dataclass(frozen=True)
class Row:
    argv: tuple[str, ...]
    says: str  # what the refusal must name: in its first line, or (a rule's) anywhere beside the rule's name
    env: tuple[tuple[str, str], ...] = ()
    rule: str | None = None  # the rule that refuses it, where a rule does

    @property
    def id(self) -> str:
        env = " ".join(f"{name}={value!r}" for name, value in self.env)
        return " ".join(filter(None, (env, *self.argv)))[:90]


def row(command: str, says: str, *, env: dict[str, str] | None = None, rule: str | None = None) -> Row:
    """``command`` as a shell would split it (``''`` is an empty argument)."""
    return Row(tuple(shlex.split(command)), says, tuple((env or {}).items()), rule)


G = "--cg-preset tiny-gpt"
M = "--cg-preset tiny-moe"
ROWS = [
    # -- check: the run's folders and files, the environment, the testing hook, a scope twice
    row(f"check {G} --save a_file --save-interval 5", "--save a_file is a file", rule="run-folders"),
    row(f"check {G} --tensorboard-dir a_file/tb", "--tensorboard-dir a_file/tb lies under a_file", rule="run-folders"),
    row(f"check {G} --data-cache-path ''", "--data-cache-path is empty", rule="run-folders"),
    row(f"check {G} --load ''", "--load is empty", rule="run-folders"),
    row(f"check {G} --cg-report-out a_file/r.json", "--cg-report-out a_file/r.json lies under", rule="cg-flags"),
    row(f"check {G} --cg-metrics-out a_folder", "--cg-metrics-out a_folder is a directory", rule="cg-flags"),
    row(f"check {G}", "WORLD_SIZE='abc'", env={"WORLD_SIZE": "abc"}, rule="environment-values"),
    row(f"check {G}", "RANK='-1'", env={"RANK": "-1"}, rule="environment-values"),
    row(f"check {G}", "LOCAL_RANK='x'", env={"LOCAL_RANK": "x"}, rule="environment-values"),
    row(f"check {G}", "MASTER_PORT='70000'", env={"MASTER_PORT": "70000"}, rule="environment-values"),
    row(f"check {G}", "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:yes': expandable_segments takes", env=ALLOC_YES),
    row(f"check {G}", "CUDA_DEVICE_MAX_CONNECTIONS='one'", env=CONNECTIONS_ONE, rule="environment-values"),
    row(f"check {G}", "NCCL_GRAPH_REGISTER=yes", env={"NCCL_GRAPH_REGISTER": "yes"}, rule="environment-switches"),
    row(f"check {G} {TE} --cg-inject-capture-failure 3", "graphs 2 layer(s)", rule="inject-capture-failure-layer"),
    row(f"check {G} {TE} --cuda-graph-modules attn attn", "--cuda-graph-modules attn", rule="cuda-graph-modules-twice"),
    # -- every command: the allocator's settings, before anything imports torch (which aborts on some)
    row(
        f"check {G}",
        "PYTORCH_CUDA_ALLOC_CONF='garbage': 'garbage' is not a key",
        env={"PYTORCH_CUDA_ALLOC_CONF": "garbage"},
    ),
    row("golden compare golden.json golden.json", "PYTORCH_ALLOC_CONF='x:1'", env={"PYTORCH_ALLOC_CONF": "x:1"}),
    # -- plan: the router load
    row(f"plan {M} --router-load nan", "--router-load 'nan': nan is no share"),
    row(f"plan {M} --router-load 1,-1,1,1", "--router-load '1,-1,1,1': -1 is no share"),
    row(f"plan {M} --router-load 0,0,0,0", "--router-load '0,0,0,0': every share is 0"),
    row(f"plan {M} --router-load zipf:inf", "--router-load 'zipf:inf': the Zipf exponent inf"),
    # -- run: the environment before Megatron's parser reads it, and a run's folders in a script's own validation
    row("run noop.py", "WORLD_SIZE='abc'", env={"WORLD_SIZE": "abc"}, rule="environment-values"),
    row(f"run validating.py {G} --save a_file --save-interval 5", "--save a_file is a file", rule="run-folders"),
    row("run ''", "megatron-cg run: the training script is empty"),
    row("run a_folder", "megatron-cg run: the training script a_folder is a folder"),
    # -- bench: its folders and numbers when parsed; the environment when the plugin installs
    row(f"bench missing.py {G}", "megatron-cg bench: the training script missing.py does not exist"),
    row(f"bench --bench-out a_file {G}", "megatron-cg bench: --bench-out a_file is a file"),
    row(f"bench --bench-profile-dir a_file/p {G}", "--bench-profile-dir a_file/p lies under a_file"),
    row(f"bench --bench-skip-steps -1 {G}", "--bench-skip-steps -1"),
    row(f"bench {G}", "MASTER_PORT='0'", env={"MASTER_PORT": "0"}, rule="environment-values"),
    # -- farm: its output folder, the checkout variable, a case file's values
    row("farm good_case --dry-run --out a_file", "megatron-cg farm: --out a_file is a file"),
    row("farm good_case --dry-run", "MEGATRON_LM_DIR is set but empty", env={"MEGATRON_LM_DIR": ""}),
    row("farm bad_size_case --fit-gpus 1 --dry-run", "bad_size_case/model_config.yaml: MODEL_ARGS --tensor-model-pa"),
    row("farm no_such_case --dry-run", "megatron-cg farm: the case folder no_such_case does not exist"),
    row("farm a_file --dry-run", "megatron-cg farm: the case folder a_file is a file"),
    row("farm '' --dry-run", "megatron-cg farm: the case folder is empty"),
    # -- tune: where it writes, before any setup is checked
    row(f"tune --tune-dry-run --tune-out a_file/t {G}", "megatron-cg tune: --tune-out a_file/t lies under a_file"),
    # -- matrix plan: where it writes, before the design's minute of checks
    row("matrix plan --out a_file/cells.json", "--out a_file/cells.json lies under a_file"),
    row("matrix plan --out a_folder", "--out a_folder is a directory"),
    # -- matrix run: the cells file, the output folder, the checkout
    row("matrix run missing.json", "the cells file missing.json does not exist"),
    row("matrix run zero_bytes.json", "the cells file zero_bytes.json is empty"),
    row("matrix run empty_list.json", "the cells file empty_list.json holds no cells"),
    row("matrix run not_json.json", "the cells file not_json.json is not JSON"),
    row("matrix run cell_without_refusal.json", "cell 1 lacks the field 'refusal'"),
    row("matrix run cell_bad_factor.json", "cell 1: factor 'precision' is 'fp16'"),
    row("matrix run cells.json --out a_file", "megatron-cg matrix: --out a_file is a file"),
    row("matrix run cells.json", "MEGATRON_LM_DIR is set but empty", env={"MEGATRON_LM_DIR": " "}),
    # -- matrix bench: the bench's own flags and numbers before any cell starts
    row("matrix bench cells.json --out out -- --bench-rouns 4", "unknown bench flag --bench-rouns (did you mean"),
    row("matrix bench cells.json --out out -- --bench-rounds 3", "--bench-rounds 3"),
    row("matrix bench cells.json --out out --timeout-s -1", "--timeout-s -1 must be a positive number"),
    row("matrix bench cells.json --out out --parallel 0", "--parallel 0"),
    row("matrix bench cells.json --out a_file", "megatron-cg matrix bench: --out a_file is a file"),
    row("matrix bench empty_list.json --out out", "the cells file empty_list.json holds no cells"),
    row("matrix bench cells.json --out out", "MEGATRON_LM_DIR is set but empty", env={"MEGATRON_LM_DIR": ""}),
    # -- matrix render: the cells file and each results file
    row("matrix render cells.json results_without_steps.json", "results_without_steps.json lacks the field 'steps'"),
    row("matrix render cells.json results_bad_row.json", "results_bad_row.json, row 1 lacks the field 'result'"),
    row("matrix render cells.json not_json.json", "the results file not_json.json is not JSON"),
    row("matrix render empty_list.json results.json", "the cells file empty_list.json holds no cells"),
    # -- golden: each file named as the command line names it
    row("golden compare missing.json golden.json", "EXPECTED missing.json does not exist"),
    row("golden compare zero_bytes.json golden.json", "EXPECTED zero_bytes.json is empty"),
    row("golden compare empty_object.json golden.json", "EXPECTED empty_object.json holds no metrics"),
    row("golden compare golden_without_end.json golden.json", "metric 'lm loss': field 'end_step' is missing"),
    row("golden compare golden.json not_json.json", "ACTUAL not_json.json is not JSON"),
    row("golden update empty_object.json new.json", "ACTUAL empty_object.json holds no metrics"),
    row("golden update golden.json a_folder", "GOLDEN a_folder is a directory"),
    row("golden update golden.json a_file/new.json", "GOLDEN a_file/new.json lies under a_file"),
]


def _write_files(folder: Path) -> None:
    """The files the rows name, in ``folder``."""
    (folder / "a_file").write_text("a file, not a folder\n")
    (folder / "a_folder").mkdir()
    (folder / "zero_bytes.json").write_text("")
    (folder / "empty_list.json").write_text("[]\n")
    (folder / "empty_object.json").write_text("{}\n")
    (folder / "not_json.json").write_text("cells: none\n")
    cell = Cell(GOOD_CELL).to_json()
    (folder / "cells.json").write_text(json.dumps([cell]))
    (folder / "cell_without_refusal.json").write_text(json.dumps([{k: v for k, v in cell.items() if k != "refusal"}]))
    (folder / "cell_bad_factor.json").write_text(json.dumps([{**cell, "factors": {**GOOD_CELL, "precision": "fp16"}}]))
    run = {"factors": {}, "steps": 10, "rows": [{"name": cell["name"], "result": "exact"}]}
    (folder / "results.json").write_text(json.dumps(run))
    (folder / "results_without_steps.json").write_text(json.dumps({"rows": run["rows"]}))
    (folder / "results_bad_row.json").write_text(json.dumps({**run, "rows": [{"name": cell["name"]}]}))
    GoldenValues({"lm loss": MetricSeries({1: 10.5, 2: 10.25})}).save(folder / "golden.json")
    (folder / "golden_without_end.json").write_text(
        json.dumps({"lm loss": {"start_step": 1, "step_interval": 1, "values": {"1": 10.5}}})
    )
    (folder / "noop.py").write_text("print('the script ran')\n")
    (folder / "validating.py").write_text(VALIDATING_SCRIPT)
    for case, size in (("good_case", 1), ("bad_size_case", "two")):
        (folder / case).mkdir()
        (folder / case / "model_config.yaml").write_text(
            f"MODEL_ARGS:\n  --num-layers: 2\n  --tensor-model-parallel-size: {size}\nCG_FARM:\n  nproc: 1\n"
        )


def _reset_megatron_globals() -> None:
    global_vars = importlib.import_module("megatron.training.global_vars")
    global_vars.unset_global_variables()
    global_vars.destroy_global_vars()
    importlib.import_module("megatron.core.num_microbatches_calculator").unset_num_microbatches_calculator()


@pytest.fixture
def in_folder_of_inputs(tmp_path, monkeypatch):
    """The current folder holds the rows' files; no variable a row sets is set; no install left behind."""
    _write_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    installation.uninstall()
    yield tmp_path
    installation.uninstall()
    _reset_megatron_globals()


def run_cli(argv, capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as stop:  # a refusal as a run stops: the plugin's RunRefused, argparse
        code = stop.code if isinstance(stop.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", ROWS, ids=[case.id for case in ROWS])
def test_bad_input_is_one_line_naming_it_and_exit_2(case, in_folder_of_inputs, monkeypatch, capsys):
    for name, value in case.env:
        monkeypatch.setenv(name, value)
    code, out, err = run_cli(case.argv, capsys)
    assert code == console.EXIT_BAD_INPUT, (out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    if case.rule is None:
        assert case.says in err.splitlines()[0], err
    else:
        assert f"[{case.rule}]" in err and case.says in err, err
    assert "the script ran" not in out  # the environment's refusal comes before the script


def test_the_table_covers_every_command():
    commands = {" ".join(case.argv[:2]) if case.argv[0] in ("matrix", "golden") else case.argv[0] for case in ROWS}
    assert commands >= {
        *("check", "plan", "run", "bench", "farm"),
        *("matrix plan", "matrix run", "matrix bench", "matrix render", "golden compare", "golden update"),
    }
    assert len(ROWS) >= 30


# -- what is not refused ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (["--load", "no_checkpoint_yet"], {}),  # Megatron starts from scratch without a checkpoint there
        (["--save", "new/checkpoints", "--save-interval", "5", "--tensorboard-dir", "a_folder"], {}),
        (
            [],
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, max_split_size_mb:128", "NCCL_GRAPH_REGISTER": "0"},
        ),
        ([], {"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2,>:4],backend:native"}),
        ([], {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3", "MASTER_PORT": "29500"}),
        ([], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    ],
)
def test_what_the_run_takes_passes(flags, env, in_folder_of_inputs, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = run_cli(["check", *GPT, *flags], capsys)
    assert code == console.EXIT_OK, err
    assert out.startswith("flags OK")


def test_the_same_cg_flag_twice_gets_a_note_naming_the_one_that_applies(in_folder_of_inputs, capsys):
    argv = ["check", *GPT, "--cg-report-out", "a.json", "--cg-report-out=b.json", "--cg-metrics-out", "m.json"]
    code, out, _ = run_cli(argv, capsys)
    assert code == console.EXIT_OK
    assert "note: --cg-report-out is given 2 times (a.json, b.json); only the last, b.json, applies." in out
    assert "--cg-metrics-out is given" not in out  # given once
    code, out, _ = run_cli(["check", *GPT, "--cg-report-out", "a.json", "--cg-report-out", "a.json"], capsys)
    assert code == console.EXIT_OK and "note:" not in out  # the same value twice contradicts nothing


def test_the_farm_checks_a_case_without_this_shells_rendezvous_variables(in_folder_of_inputs, monkeypatch, capsys):
    """The farm's launcher sets each rank's WORLD_SIZE, RANK and MASTER_PORT: a stale one in the shell refuses
    no case."""
    (in_folder_of_inputs / "good_case" / "model_config.yaml").write_text(
        "MODEL_ARGS:\n  --cg-preset: tiny-gpt\nCG_FARM:\n  nproc: 1\n  compare: eager-only\n"
    )
    monkeypatch.setenv("MASTER_PORT", "not-a-port")
    code, out, err = run_cli(["farm", "good_case", "--dry-run", "--out", "out"], capsys)
    assert code == console.EXIT_OK, out + err
    assert "check: OK" in out and "environment-values" not in out


def test_a_refusal_is_printed_by_a_rank_that_is_no_number(capsys):
    """Rank 0 and each node's first rank print a refusal; a RANK that is no number cannot tell, so it prints."""
    for environ, printed in (
        ({"RANK": "abc", "LOCAL_RANK": "abc"}, True),
        ({"RANK": "0", "LOCAL_RANK": "0"}, True),
        ({"RANK": "3", "LOCAL_RANK": "1"}, False),
    ):
        refusal.refuse([("environment-values", "RANK='abc'")], environ=environ)
        assert ("RANK='abc'" in capsys.readouterr().err) == printed, environ


# -- the shared checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("expandable_segments:true", "expandable_segments takes True or False"),
        ("max_split_size_mb:19", "max_split_size_mb takes a whole number of MiB, 20 or more"),
        ("max_split_size_mb:big", "max_split_size_mb takes a whole number"),
        ("garbage_collection_threshold:1.0", "garbage_collection_threshold takes a fraction between 0 and 1"),
        ("garbage_collection_threshold:0", "garbage_collection_threshold takes a fraction"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions takes a power of two"),
        ("roundup_power2_divisions:[256:3]", "divisions 0 or powers of two"),
        ("roundup_power2_divisions:[300:2]", "sizes are powers of two"),
        ("roundup_power2_divisions:[256:2", "a [ list is not closed"),
        ("backend:cudaMalloc", "backend takes native or cudaMallocAsync"),
        ("pinned_num_register_threads:3", "pinned_num_register_threads takes a power of two up to 128"),
        ("pinned_use_cuda_host_register:1", "pinned_use_cuda_host_register takes True or False"),
        ("release_lock_on_cudamalloc:yes", "release_lock_on_cudamalloc takes True or False"),
        ("expandable_segmnts:True", "'expandable_segmnts' is not a key torch's allocator takes"),
        ("expandable_segments", "expandable_segments needs a value"),
        ("expandable_segments:True;max_split_size_mb:128", "takes True or False"),
    ],
)
def test_an_allocator_setting_torch_refuses_is_named(config, says):
    problems = inputs.allocator_config_problems(config)
    assert problems and says in problems[0], problems
    assert any(says in problem for problem in inputs.environment_problems({"PYTORCH_ALLOC_CONF": config}))


@pytest.mark.parametrize(
    "config",
    [
        "",
        "expandable_segments:False",
        "expandable_segments : True , max_split_size_mb : 20,",
        "garbage_collection_threshold:0.6,max_split_size_mb:512",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[1:0,64:8,>:1]",
        "backend:cudaMallocAsync",
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,pinned_use_background_threads:False",
        "release_lock_on_cudamalloc:True,per_process_memory_fraction:0.5",
    ],
)
def test_an_allocator_setting_torch_takes_passes(config):
    assert inputs.allocator_config_problems(config) == []


def test_expandable_segments_are_read_however_spaced():
    assert inputs.expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments : True"})
    assert inputs.expandable_segments({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert not inputs.expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not inputs.expandable_segments({})


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 with WORLD_SIZE=2"),
        ({"MASTER_PORT": "-1"}, "MASTER_PORT='-1'"),
        ({"MASTER_PORT": "65536"}, "MASTER_PORT='65536'"),
        ({"CUDA_DEVICE_MAX_CONNECTIONS": "0"}, "CUDA_DEVICE_MAX_CONNECTIONS='0'"),
    ],
)
def test_a_process_variable_out_of_range_is_named(environ, says):
    problems = inputs.environment_problems(environ)
    assert len(problems) == 1 and says in problems[0], problems


def test_the_launcher_refuses_the_environment_before_megatrons_parser(in_folder_of_inputs, monkeypatch, capsys):
    """Megatron's parser reads WORLD_SIZE with int(): the launcher stops at install(), naming it, not there."""
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main(GPT)
    assert stop.value.code == console.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "[environment-values]" in err and "WORLD_SIZE='abc'" in err and "Traceback" not in err


def test_install_refuses_the_environment_before_megatrons_parser(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "two")
    installation.uninstall()
    with pytest.raises(SystemExit) as stop:
        installation.install()
    assert stop.value.code == console.EXIT_BAD_INPUT
    assert installation.active_session() is None
    err = capsys.readouterr().err
    assert "[environment-values]" in err and "WORLD_SIZE='two'" in err


@pytest.mark.parametrize(
    ("make", "check", "says"),
    [
        (lambda folder: folder / "out", inputs.output_folder_problem, None),
        (lambda folder: folder, inputs.output_folder_problem, None),
        (lambda folder: folder / "out.json", inputs.output_file_problem, None),
        (lambda folder: folder, inputs.output_file_problem, "is a directory"),
        (lambda folder: folder / "a_file", inputs.output_folder_problem, "is a file"),
        (lambda folder: folder / "a_file" / "x", inputs.output_folder_problem, "lies under"),
        (lambda folder: folder / "a_file" / "x.json", inputs.output_file_problem, "lies under"),
        (lambda folder: "", inputs.output_folder_problem, "--flag is empty; give a folder path"),
        (lambda folder: " ", inputs.output_file_problem, "--flag is empty; give a file path"),
    ],
)
def test_output_paths(tmp_path, make, check, says):
    (tmp_path / "a_file").write_text("")
    problem = check("--flag", make(tmp_path))
    assert problem is None if says is None else (problem is not None and says in problem), problem


@pytest.mark.parametrize("check", [inputs.output_folder_problem, inputs.output_file_problem])
def test_a_path_in_a_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch, check):
    """Checked with access(2), as the run's writes would be; faked here, since this test may run as root."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    problem = check("--flag", locked / "new" / "out.json")
    assert problem is not None and f"{locked} is not writable" in problem
    assert check("--flag", tmp_path / "out.json") is None


def test_golden_update_writes_nothing_where_it_cannot(tmp_path):
    values = GoldenValues({"lm loss": MetricSeries({1: 1.0})})
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"GOLDEN .* lies under"):
        golden.update(tmp_path / "a_file" / "golden.json", values)
    golden.update(tmp_path / "new" / "golden.json", values)
    assert GoldenValues.load(tmp_path / "new" / "golden.json") == values


@pytest.mark.parametrize(
    ("value", "refused"),
    [(None, False), ("/opt/Megatron-LM", False), ("", True), ("  ", True)],
)
def test_a_checkout_variable_set_but_empty_is_refused(value, refused):
    environ = {} if value is None else {"MEGATRON_LM_DIR": value}
    if refused:
        with pytest.raises(inputs.InputError, match="MEGATRON_LM_DIR is set but empty"):
            inputs.checkout_from_environment("MEGATRON_LM_DIR", environ, what="a checkout")
    else:
        assert inputs.checkout_from_environment("MEGATRON_LM_DIR", environ, what="a checkout") == value


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ([1], "the file, row 1 is a list"),
        ({"name": "x"}, "the file, row 1 lacks the field 'steps'"),
        ({"name": "x", "steps": "10"}, "field 'steps' is a string ('10'), not a whole number"),
        ({"name": "x", "steps": True}, "field 'steps' is a bool"),
    ],
)
def test_required_fields_are_named(record, says):
    with pytest.raises(inputs.InputError) as info:
        inputs.require_fields(record, {"name": str, "steps": int}, where="the file, row 1", give="a run's file")
    assert says in str(info.value) and str(info.value).endswith("give a run's file.")
