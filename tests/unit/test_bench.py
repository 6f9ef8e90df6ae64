"""megatron-cg bench on CPU: the block loop with a fake trainer and clock, its outputs, its options,
and the contract-cost measurement on a real plugin check."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from _doubles.installed import plugin_installed

from megatron_cg_plugin import cli
from megatron_cg_plugin.bench import command as bench
from megatron_cg_plugin.bench import output as bench_output
from megatron_cg_plugin.bench.command import BenchError, BenchOptions, parse_bench_argv, run_bench
from megatron_cg_plugin.bench.output import BenchOutputError
from megatron_cg_plugin.bench.schedule import DeviceTime
from megatron_cg_plugin.config import PluginConfig

STEP_SECONDS = {"eager": 0.030, "stock": 0.012, "plugin": 0.0126, "plugin-no-check": 0.0123, "plugin-recording": 0.0127}


class FakeTrainer:
    """Steps take their arm's time on a fake clock that also drifts 1% per block."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.arm = "eager"
        self.events: list[str] = []
        self.pools: dict = {}
        self.blocks = 0
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        self.clock.now += STEP_SECONDS[self.arm] * (1 + 0.01 * self.blocks)

    def capture(self, arm: str):
        self.events.append(f"capture {arm}")
        self.arm = arm
        self.pools[(len(self.events), 0)] = 64 << 20
        self.clock.now += 2.0 if arm == "stock" else 2.1
        return arm

    def release(self, helper) -> None:
        self.events.append(f"release {helper}")
        self.pools.clear()
        self.arm = "eager"
        self.blocks += 1

    def synchronize(self) -> None:
        pass

    def peak_allocated(self, reset: bool = False) -> int:
        return 1 << 30

    def pool_bytes(self) -> dict:
        return dict(self.pools)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def bench_with_fakes(**options):
    clock = Clock()
    trainer = FakeTrainer(clock)
    lines: list[str] = []
    profiled: list[str] = []

    def profile(step, count, arm):
        assert arm == trainer.arm  # the profile is told whose steps it times
        profiled.append(trainer.arm)
        for _ in range(count):
            step()
        return DeviceTime(0.009 if trainer.arm != "eager" else 0.015)  # device seconds per step

    result = run_bench(
        BenchOptions(**({"rounds": 4, "steps": 6, "skip_steps": 1} | options)),
        trainer,
        clock=clock,
        progress=lines.append,
        profile=profile,
        contract_cost=lambda helper: ({"full": 7.0, "shapes": 4.0, "off": 0.5}, 24),
        recording_cost=lambda: (profiled.append(f"recording cost on {trainer.arm}"), 63.0)[1],
    )
    return result, trainer, lines, profiled


def test_every_graphed_block_captures_trains_and_tears_down_in_the_interleaved_order():
    result, trainer, lines, profiled = bench_with_fakes()
    # Round 0 forward, round 1 reversed, ...; then one profiled capture per graphed arm.
    captures = [e for e in trainer.events if e.startswith("capture")]
    assert captures == ["capture stock", "capture plugin", "capture plugin", "capture stock"] * 2 + [
        "capture stock",
        "capture plugin",
    ]
    events = trainer.events
    assert all(events[i + 1] == f"release {e.split()[1]}" for i, e in enumerate(events) if e.startswith("capture"))
    assert [(r.round, r.arm) for r in result.blocks][:6] == [
        (0, "eager"),
        (0, "stock"),
        (0, "plugin"),
        (1, "plugin"),
        (1, "stock"),
        (1, "eager"),
    ]
    assert trainer.steps == 3 + 4 * 3 * 6 + 3 * 3  # warmup, the blocks, the profiles
    assert len(lines) == 12 + 3 and lines[0].startswith("block 1/12: round 0 eager: 6 steps, median 30.")
    assert profiled == ["eager", "stock", "plugin"]
    medians = result.summary().arms
    assert result.busy_fraction["plugin"] == pytest.approx(0.009 / medians["plugin"].median)  # of the unprofiled step
    assert result.busy_fraction["eager"] == pytest.approx(0.5, rel=0.06)
    assert result.contract_check_us["full"] == 7.0 and result.replays_per_step == 24


def test_ratios_come_out_of_the_drift_and_graphed_blocks_record_their_capture():
    result, *_ = bench_with_fakes()
    summary = result.summary()
    assert summary.ratios["plugin", "stock"].median == pytest.approx(1.05, rel=2e-3)  # 12.6 / 12 despite drift
    assert summary.ratios["stock", "eager"].median == pytest.approx(0.4, rel=2e-3)
    for record in result.blocks:
        assert (record.capture_seconds is None) == (record.arm == "eager")
        assert record.pool_bytes in (None, 64 << 20) and record.peak_allocated_bytes == 1 << 30
    assert result.per_arm("capture_seconds")["plugin"].median == pytest.approx(2.1)


def test_the_method_says_when_the_loader_was_left_out():
    live, *_ = bench_with_fakes()
    cached, *_ = bench_with_fakes(cached_batches=2)
    assert "cached" not in live.method and live.method == bench.METHOD
    assert cached.method.startswith(bench.METHOD) and "cycles through 2 global batch(es)" in cached.method


def test_outputs_json_and_markdown(tmp_path):
    result, *_ = bench_with_fakes()
    written = bench_output.write(result, tmp_path, with_plot=False)
    assert [p.name for p in written] == ["bench.json", "bench.md"]
    data = json.loads(written[0].read_text())
    assert data["ratios"]["plugin/stock"]["n"] == 2 and len(data["blocks"]) == 12
    assert data["step_seconds"]["eager"]["median"] == pytest.approx(0.030 * 1.055)  # blocks 0, 5, 6, 11 drifted
    table = written[1].read_text()
    assert "| plugin / stock | 1.05 [" in table and "| stock / eager |" in table
    assert "| full | 7.0 | 0.17 ms (24 replays) |" in table
    assert "| eager |" in table and "| - | - |" in table  # no capture, no pool for eager
    assert bench_output.from_json(data) == result  # bench.json holds the whole result (plotted elsewhere)
    # TE's graph pool is not in "allocated" once captured: the sum is what compares arms.
    assert data["peak_with_pools_bytes"]["plugin"]["median"] == (1 << 30) + (64 << 20)
    assert "| 1.02e+03 [1.02e+03, 1.02e+03] (n=4) | 1.09e+03 [1.09e+03, 1.09e+03] (n=4) |" in table


def test_a_missing_matplotlib_is_said_before_anything_runs(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(BenchOutputError, match=r"pip install 'megatron-cg-plugin\[bench\]', or pass --bench-no-plot"):
        bench_output.plot_available()


def test_a_failing_capture_stops_the_bench_with_its_error():
    class Failing(FakeTrainer):
        def capture(self, arm):
            raise RuntimeError(f"{arm} capture failed")

    clock = Clock()
    with pytest.raises(RuntimeError, match="stock capture failed"):
        run_bench(BenchOptions(rounds=2, steps=3, skip_steps=1), Failing(clock), clock=clock, progress=lambda _: None)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(arms=("eager", "fast")), "--bench-arms eager,fast: use a comma-separated subset of eager,stock,plugin"),
        (dict(arms=()), "--bench-arms"),
        (dict(arms=("slot", "slot-offload-wide")), "--bench-arms slot,slot-offload-wide: use .*slot-offload-w<N>"),
        (dict(arms=("slot-offload-f150",)), "--bench-arms slot-offload-f150: .*-f<P> after either, P from 0 to 100"),
        (dict(arms=("slot-offload-f50-w1",)), "--bench-arms slot-offload-f50-w1: use"),  # the window comes first
        (dict(arms=("slot-offload-w\u0661",)), "--bench-arms slot-offload-w\u0661: use"),  # ASCII digits only
        (dict(steps=2, skip_steps=2), "--bench-steps 2 must exceed --bench-skip-steps 2"),
        (dict(rounds=3), "--bench-rounds 3: rounds must be an even number"),
        (dict(cached_batches=-1), "--bench-cached-batches -1: use 0"),
    ],
)
def test_bad_options_are_refused_naming_the_flag(options, message):
    with pytest.raises(BenchError, match=message):
        BenchOptions(**options)


def test_bench_flags_are_taken_out_and_the_rest_left_for_megatron():
    options, flags = parse_bench_argv(
        [
            "--cg-preset",
            "tiny-gpt",
            "--bench-rounds",
            "6",
            "--bench-arms",
            "stock,plugin",
            "--cuda-graph-impl",
            "transformer_engine",
            "--bench-no-plot",
            "--bench-profile-dir",
            "prof",
            "--bench-cached-batches",
            "3",
        ]
    )
    assert (options.rounds, options.arms, options.plot, options.cached_batches) == (6, ("stock", "plugin"), False, 3)
    assert options.profile_dir == Path("prof")
    assert flags == ["--cg-preset", "tiny-gpt", "--cuda-graph-impl", "transformer_engine"]
    assert options.total_steps == 3 + 6 * 2 * 20 + 2 * 3 * 2  # with a profile dir, the Python profile's steps too


def test_cli_refuses_bad_bench_options_before_any_gpu_work(capsys):
    assert (
        cli.main(["bench", "--bench-rounds", "3", "--bench-no-plot", "--cg-preset", "tiny-gpt"]) == cli.EXIT_BAD_INPUT
    )
    assert "--bench-rounds 3: rounds must be an even number" in capsys.readouterr().err


ARGS = dict(
    cuda_graph_impl="transformer_engine",
    cuda_graph_warmup_steps=3,
    use_distributed_optimizer=False,
    overlap_param_gather=False,
    save=None,
)
DEFAULTS = PluginConfig()  # the plugin's config in force when no --cg-* flag is given


def run_settings(**flags):
    """The run's settings of Megatron's flags ``ARGS | flags``, read as validation reads them."""
    import types

    from megatron_cg_plugin.settings import read_settings

    return read_settings(types.SimpleNamespace(**({"num_layers": 2, "micro_batch_size": 1} | ARGS | flags)))[0]


@pytest.mark.parametrize(
    "changed, message",
    [
        (dict(cuda_graph_impl="none"), "pass --cuda-graph-impl transformer_engine \\(or --bench-arms eager\\)"),
        (dict(cuda_graph_warmup_steps=0), "--cuda-graph-warmup-steps 0 would make Megatron capture its own graphs"),
        (dict(use_distributed_optimizer=True, overlap_param_gather=True), "drop --overlap-param-gather for the bench"),
        (dict(save="/ckpt"), "drop --save for the bench"),
    ],
)
def test_flags_the_bench_cannot_measure_are_refused_after_parsing(changed, message):
    bench.refuse_unbenchable(run_settings(), DEFAULTS, BenchOptions())  # the benchable run
    with pytest.raises(BenchError, match=message):
        bench.refuse_unbenchable(run_settings(**changed), DEFAULTS, BenchOptions())
    if "cuda_graph_impl" in changed:  # an eager-only bench needs no graphs
        bench.refuse_unbenchable(run_settings(**changed), DEFAULTS, BenchOptions(arms=("eager",)))


@pytest.mark.parametrize("packed", [dict(dataloader_inter_document_masking=True), dict(sft=True)])
def test_the_stock_arm_is_refused_on_packed_data(packed):
    """Megatron's own graphs assert on packed batches at their first replay (Megatron-LM #5619): eager and
    plugin arms only."""
    settings = run_settings(**packed)
    with pytest.raises(BenchError, match="bench packed data with --bench-arms eager,plugin"):
        bench.refuse_unbenchable(settings, DEFAULTS, BenchOptions())
    bench.refuse_unbenchable(settings, DEFAULTS, BenchOptions(arms=("eager", "plugin")))
    bench.refuse_unbenchable(
        run_settings(**packed, hybrid_context_parallel=True), DEFAULTS, BenchOptions()
    )  # hybrid CP: the launcher's packs, graph banks


def test_the_driver_runs_the_bench_on_the_first_step_and_ends_megatrons_loop(monkeypatch):
    import types

    args = types.SimpleNamespace(train_iters=500, iteration=0)

    class Trainer:
        def __init__(self, train_step, step_args, step_kwargs, *, cached_microbatches):
            self.args, self.last = args, ("loss dict",)
            cached.append(cached_microbatches)

    from megatron.core import num_microbatches_calculator

    monkeypatch.setattr(num_microbatches_calculator, "get_num_microbatches", lambda: 4)
    monkeypatch.setattr(bench, "MegatronTrainer", Trainer)
    monkeypatch.setattr(bench, "run_bench", lambda options, trainer, **kwargs: "result")
    sink: list = []
    cached: list = []
    checked: list = []
    step = bench.bench_train_step(
        BenchOptions(cached_batches=2), [], train_step=None, sink=sink, before=lambda: checked.append(len(sink))
    )
    assert step("forward", "data", iteration=0) == ("loss dict",)
    assert checked == [0]  # the script's refusals ran before the bench
    assert step.__wrapped__ is None  # what it stands in for (train_step=None here), for install()'s signature check
    assert cached == [2 * 4]  # global batches x microbatches per step
    assert sink == ["result"] and args.train_iters == 1  # the loop's iteration 0 was its last
    with pytest.raises(BenchError, match="went on after the bench"):
        step("forward", "data", iteration=1)


def test_contract_cost_times_every_mode_on_the_first_captured_layers_own_contract(monkeypatch):
    import types

    from megatron_cg_plugin.capture.contracts import CheckedGraph, ReplayContract
    from megatron_cg_plugin.config import ContractCheck

    layer = torch.nn.Linear(4, 4)
    layer.pg_collection = None
    sample = (torch.zeros(8, 2, 4, requires_grad=True),), {"attention_mask": torch.ones(2, 1, 8, 8), "window": 3}
    contract = ReplayContract.record("layer 0", *sample, module=layer)
    layer.cuda_graphs = [CheckedGraph(lambda *args, **kwargs: None, contract, ContractCheck.FULL)]
    helper = types.SimpleNamespace(flattened_callables=[layer] * 3)
    checked = []
    check = ReplayContract.check
    monkeypatch.setattr(
        ReplayContract,
        "check",
        lambda self, args, kwargs, mode: checked.append((args, kwargs)) or check(self, args, kwargs, mode),
    )
    costs, replays = bench.contract_check_cost(helper, microbatches=4, repeats=50)
    assert set(costs) == {"full", "shapes", "off"} and all(us > 0 for us in costs.values())
    assert costs["off"] < costs["full"] and replays == 12
    (hidden,), kwargs = checked[0]  # fresh tensors like the captured ones, the keyword Megatron adds at replay
    assert hidden.shape == (8, 2, 4) and hidden.requires_grad and hidden.data_ptr() != sample[0][0].data_ptr()
    assert kwargs["window"] == 3 and kwargs["is_first_microbatch"] is False


@pytest.mark.parametrize("marked, reads", [(True, 10), (False, 40)])
def test_contract_cost_averages_a_steps_replays_of_the_layer(monkeypatch, marked, reads):
    """Under the run's step marks only a layer's first replay in a step reads its parameters: the cost
    per replay is the mean over a step's, as the per-step figure multiplies it."""
    import types

    from megatron_cg_plugin.capture.contracts import CheckedGraph, HeldState, ReplayContract
    from megatron_cg_plugin.capture.step_marks import StepMarks
    from megatron_cg_plugin.config import ContractCheck

    layer = torch.nn.Linear(4, 4)
    marks = StepMarks() if marked else None
    contract = ReplayContract.record("layer 0", (torch.zeros(2, 4),), {}, module=layer, step_marks=marks)
    layer.cuda_graphs = [CheckedGraph(lambda *args, **kwargs: None, contract, ContractCheck.FULL)]
    read = []
    original = HeldState._read
    monkeypatch.setattr(HeldState, "_read", lambda self, graph: read.append(graph) or original(self, graph))
    monkeypatch.setattr(bench, "ContractCheck", [ContractCheck.FULL])
    costs, replays = bench.contract_check_cost(
        types.SimpleNamespace(flattened_callables=[layer]), microbatches=4, repeats=40
    )
    assert set(costs) == {"full"} and replays == 4
    assert len(read) == reads  # 10 steps of 4 replays: one read a step under the marks, else one a replay


def test_contract_cost_needs_the_plugin_arms_contracts():
    import types

    from megatron_cg_plugin.capture.contracts import CheckedGraph
    from megatron_cg_plugin.config import ContractCheck

    layer = types.SimpleNamespace(cuda_graphs=[CheckedGraph(lambda: None, None, ContractCheck.OFF)])
    with pytest.raises(bench.BenchError, match="--cg-contract-check full"):
        bench.contract_check_cost(types.SimpleNamespace(flattened_callables=[layer]), microbatches=1)


@pytest.mark.parametrize(
    "sample",
    [
        ((torch.zeros(2), [torch.zeros(2), 3]), {}),  # a leaf inside a positional argument
        ((torch.zeros(2),), {"extra": {"k": torch.zeros(2)}}),  # and inside a keyword's
    ],
)
def test_contract_cost_times_only_calls_of_one_leaf_arguments(sample):
    import types

    from megatron_cg_plugin.capture.contracts import CheckedGraph, ReplayContract
    from megatron_cg_plugin.config import ContractCheck

    contract = ReplayContract.record("layer 0", *sample)
    layer = types.SimpleNamespace(cuda_graphs=[CheckedGraph(lambda *a, **k: None, contract, ContractCheck.FULL)])
    with pytest.raises(bench.BenchError, match="no contract of one-leaf arguments"):
        bench.contract_check_cost(types.SimpleNamespace(flattened_callables=[layer]), microbatches=1)


def test_slot_arms_record_their_arenas_and_copies_and_the_table_shows_them(monkeypatch):
    import types

    class SlotTrainer(FakeTrainer):
        def capture(self, arm):
            super().capture(arm)
            layers = (
                types.SimpleNamespace(
                    arena_bytes=3 << 20,
                    host_arena_bytes=(5 << 20) if arm == "slot-offload" else 0,
                    boundary_bytes=1 << 20,
                ),
            ) * 2
            stats = types.SimpleNamespace(slot_layers=lambda: layers) if arm.startswith("slot") else None
            return types.SimpleNamespace(arm=arm, capture_stats=stats)

        def release(self, helper):
            super().release(helper.arm)

    monkeypatch.setitem(STEP_SECONDS, "slot", 0.0125)
    monkeypatch.setitem(STEP_SECONDS, "slot-offload", 0.0130)
    clock = Clock()
    trainer = SlotTrainer(clock)

    def profile(step, count, arm):
        for _ in range(count):
            step()
        return DeviceTime(
            0.01,
            d2h_seconds=0.002 if arm == "slot-offload" else 0.0,
            h2d_seconds=0.002 if arm == "slot-offload" else 0.0,
            copy_overlap_seconds=0.003,
        )

    result = run_bench(
        BenchOptions(rounds=2, steps=3, skip_steps=1, arms=("stock", "slot", "slot-offload")),
        trainer,
        clock=clock,
        progress=lambda _: None,
        profile=profile,
    )
    arenas = {r.arm: (r.arena_bytes, r.host_arena_bytes, r.boundary_bytes) for r in result.blocks}
    assert arenas == {
        "stock": (None, None, None),
        "slot": (6 << 20, 0, 2 << 20),
        "slot-offload": (6 << 20, 10 << 20, 2 << 20),
    }
    table = bench_output.markdown(result)
    copies_table = table.split("| arm | D2H ms per step")[1].split("\n\n")[0]
    assert "| slot-offload | 2.00 | 2.00 | 75% |" in copies_table
    assert "| slot |" not in copies_table and "| stock |" not in copies_table  # only the arms that copied
    assert bench_output.from_json(json.loads(json.dumps(bench_output.to_json(result)))) == result


def test_slot_arms_are_refused_for_flags_slot_capture_cannot_serve():
    offload = dict(fine_grained_activation_offloading=True, offload_modules=["core_attn"])
    args = run_settings(**offload, pipeline_model_parallel_size=2, world_size=2)
    bench.refuse_unbenchable(args, DEFAULTS, BenchOptions(arms=("eager", "stock")))  # TE's graphs serve PP 2
    with pytest.raises(
        BenchError, match=r"slot-offload arm\(s\) capture with --cg-slot-capture.*--pipeline-model-parallel-size 1"
    ):
        bench.refuse_unbenchable(args, DEFAULTS, BenchOptions(arms=("stock", "slot-offload")))
    plain = run_settings()
    bench.refuse_unbenchable(plain, DEFAULTS, BenchOptions(arms=("stock", "slot")))
    with pytest.raises(BenchError, match=r"slot-offload-staged arm\(s\) offload .* add --fine-grained"):
        bench.refuse_unbenchable(plain, DEFAULTS, BenchOptions(arms=("slot", "slot-offload-staged")))


def test_the_trainer_refuses_a_process_the_plugin_is_not_installed_in(monkeypatch):
    from megatron_cg_plugin import installation

    monkeypatch.setattr(installation, "active_session", lambda: None)
    with pytest.raises(BenchError, match="the plugin is not installed in this process; run the bench through"):
        bench.MegatronTrainer(lambda *a, **k: None, (None, None, "model", "optimizer", None, "config", None), {})


def test_the_unchecked_arm_is_the_plugins_helper_with_replay_checks_off(monkeypatch):
    import types

    import megatron.training as megatron_training

    from megatron_cg_plugin.config import PluginConfig
    from megatron_cg_plugin.session import RunSession

    class Base:
        pass

    session = RunSession(PluginConfig(contract_check="full"))
    plugin_installed(monkeypatch, Base, session)
    monkeypatch.setattr(megatron_training, "get_args", lambda: types.SimpleNamespace())
    step_args = (None, None, "model", "optimizer", None, "config", None)
    trainer = bench.MegatronTrainer(lambda *a, **k: None, step_args, {})
    assert trainer.step_args == step_args  # the live loader unless batches are cached
    unchecked = trainer.helpers[bench_output.UNCHECKED_ARM]
    assert unchecked.session.config.contract_check == "off" and unchecked.session is not session
    assert trainer.helpers["plugin"].session.config.contract_check == "full"
    assert unchecked.session.config == dataclasses.replace(session.config, contract_check="off")


def test_the_unchecked_arm_runs_interleaved_and_shows_what_the_check_costs(tmp_path):
    result, trainer, _, profiled = bench_with_fakes(arms=("stock", "plugin", "plugin-no-check"))
    assert profiled == ["stock", "plugin", "plugin-no-check"]
    summary = result.summary()
    assert summary.ratios["plugin", "plugin-no-check"].median == pytest.approx(0.0126 / 0.0123, rel=2e-3)
    table = bench_output.write(result, tmp_path, with_plot=False)[1].read_text()
    assert "| plugin-no-check / plugin |" in table and "| plugin-no-check |" in table  # later arm over earlier


@pytest.mark.parametrize("mode", ["shapes", "off"])
def test_the_unchecked_arm_needs_the_full_check_on_the_plugin_arm(mode):
    args, config = run_settings(), PluginConfig(contract_check=mode)
    with pytest.raises(BenchError, match=f"leave --cg-contract-check at full \\(it is {mode}\\)"):
        bench.refuse_unbenchable(args, config, BenchOptions(arms=("plugin", "plugin-no-check")))
    bench.refuse_unbenchable(args, config, BenchOptions(arms=("stock", "plugin")))
    bench.refuse_unbenchable(
        args, PluginConfig(contract_check="full"), BenchOptions(arms=("plugin", "plugin-no-check"))
    )


def test_cached_batches_are_read_once_and_served_again_and_again_through_megatrons_wrapper():
    from megatron.core.rerun_state_machine import RerunDataIterator

    source = RerunDataIterator(iter(range(100)))
    served = bench.cycled_microbatches(source, 3)
    assert isinstance(served, RerunDataIterator)
    assert [next(served) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert next(source) == 3  # exactly three were read from the live loader


@pytest.mark.parametrize(
    "iterator, message",
    [
        ([iter(range(4)), iter(range(4))], "needs one data iterator \\(no virtual pipeline stages\\)"),
        (iter(range(2)), "the dataset ran out before 3 microbatches"),
    ],
)
def test_cached_batches_that_cannot_be_had_are_refused(iterator, message):
    with pytest.raises(BenchError, match=message):
        bench.cycled_microbatches(iterator, 3)


def test_a_rank_without_a_data_iterator_keeps_none():
    assert bench.cycled_microbatches(None, 3) is None  # TP ranks > 0 get their batches by broadcast


@pytest.mark.parametrize(
    "pipeline",
    [
        dict(pipeline_model_parallel_size=2),
        dict(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2),
    ],
)
def test_cached_batches_are_refused_for_pipelines_before_any_gpu_work(pipeline):
    args = run_settings(**pipeline)
    with pytest.raises(BenchError, match="--bench-cached-batches caches the batches of a PP = 1 run"):
        bench.refuse_unbenchable(args, DEFAULTS, BenchOptions(cached_batches=2))
    bench.refuse_unbenchable(args, DEFAULTS, BenchOptions())  # the live loader serves pipelines
    bench.refuse_unbenchable(run_settings(pipeline_model_parallel_size=1), DEFAULTS, BenchOptions(cached_batches=2))


def test_the_trainer_steps_on_the_cached_batches(monkeypatch):
    import types

    import megatron.training as megatron_training

    from megatron_cg_plugin.config import PluginConfig
    from megatron_cg_plugin.session import RunSession

    plugin_installed(monkeypatch, object, RunSession(PluginConfig()))
    monkeypatch.setattr(megatron_training, "get_args", lambda: types.SimpleNamespace())
    seen = []

    def train_step(forward, data_iterator, *rest, iteration):
        seen.extend(next(data_iterator) for _ in range(2))  # two microbatches a step

    trainer = bench.MegatronTrainer(
        train_step, (None, iter("abcdef"), "model", "optimizer", None, "config", None), {}, cached_microbatches=4
    )
    for _ in range(3):
        trainer.step()
    assert seen == list("abcdabcdab")[:6]


def test_the_bench_runs_each_schedule_inside_the_runs_step_marks(monkeypatch):
    # A script's bench holds the bare train_step: the trainer marks its schedule as the patch does.
    import types

    import megatron.training as megatron_training

    from megatron_cg_plugin.config import PluginConfig
    from megatron_cg_plugin.session import RunSession

    session = RunSession(PluginConfig())
    plugin_installed(monkeypatch, object, session)
    monkeypatch.setattr(megatron_training, "get_args", lambda: types.SimpleNamespace())
    seen = []

    def train_step(forward, data_iterator, model, optimizer, scheduler, config, forward_backward_func, *, iteration):
        seen.append((session.step_marks.step_now(), forward_backward_func()))

    trainer = bench.MegatronTrainer(
        train_step, (None, None, "model", "optimizer", None, "config", session.step_marks.step_now), {}
    )
    for _ in range(2):
        trainer.step()
    (outside, first), (_, second) = seen
    assert outside is None and None not in (first, second) and first != second


def test_the_host_diff_ranks_operators_by_where_two_arms_differ(tmp_path, capsys):
    bench_output.write_host_ops(
        tmp_path / "plugin.host_ops.json",
        3,
        {"aten::copy_": (30, 3000.0), "contract_check": (12, 600.0), "aten::add": (3, 30.0)},
    )
    bench_output.write_host_ops(
        tmp_path / "stock.host_ops.json", 3, {"aten::copy_": (30, 2700.0), "aten::add": (3, 33.0)}
    )
    table = bench_output.host_ops_diff(tmp_path / "plugin.host_ops.json", tmp_path / "stock.host_ops.json")
    assert table.startswith("host ops: host time per step, plugin - stock: +299 us")  # (3630 - 2733) / 3 steps
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `contract_check` | +200.0 | 200.0 | 0.0 | 4 / 0 |",  # only the first arm runs it
        "| `aten::copy_` | +100.0 | 1000.0 | 900.0 | 10 / 10 |",
        "| `aten::add` | -1.0 | 10.0 | 11.0 | 1 / 1 |",
    ]
    assert bench_output.main(["--host-diff", str(tmp_path), "plugin", "stock"]) == 0
    assert "aten::copy_" in capsys.readouterr().out
    assert bench_output.main(["--host-diff", str(tmp_path), "plugin", "eager"]) == 2
    assert "run megatron-cg bench with --bench-profile-dir" in capsys.readouterr().out
    assert bench_output.main([]) == 2


def _replay_wrapper(calls: list) -> None:
    calls[0] += 1  # no call of its own: the wrapper's are the only extra calls


def test_the_python_profile_counts_each_function_per_step_and_the_diff_puts_extra_calls_first(tmp_path, capsys):
    calls, syncs = [0], []

    def plugin_step():
        for _ in range(3):
            _replay_wrapper(calls)

    inside = []

    @contextlib.contextmanager
    def one_thread():
        inside.append(True)
        yield
        inside.append(False)

    def counted_step():
        assert inside == [True]  # the profiled steps run on one thread
        plugin_step()

    bench.python_calls_per_step(
        counted_step,
        2,
        tmp_path / "plugin.python_calls.json",
        synchronize=lambda: syncs.append(1),
        one_thread=one_thread,
    )
    assert inside == [True, False]
    bench.python_calls_per_step(lambda: None, 2, tmp_path / "stock.python_calls.json", synchronize=lambda: None)
    assert calls == [6] and len(syncs) == 2  # the steps ran, the device drained before and after
    per_step = json.loads((tmp_path / "plugin.python_calls.json").read_text())["per_step"]
    wrapper = [row for name, row in per_step.items() if name.endswith("(_replay_wrapper)")]
    assert [row["calls"] for row in wrapper] == [3.0]
    assert "unit/test_bench.py:" in next(name for name in per_step if name.endswith("(_replay_wrapper)"))
    table = bench_output.host_ops_diff(
        tmp_path / "plugin.python_calls.json", tmp_path / "stock.python_calls.json", calls_first=True
    )
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert table.startswith("python calls (the calls are exact") and "host time per step, plugin - stock" in table
    assert "(_replay_wrapper)` |" in rows[0] and rows[0].endswith("| 3 / 0 |")  # three more calls a step: first
    for arm in ("plugin", "stock"):
        bench_output.write_host_ops(tmp_path / f"{arm}.host_ops.json", 1, {"aten::add": (1, 1.0)})
    assert bench_output.main(["--host-diff", str(tmp_path), "plugin", "stock"]) == 0
    assert "python calls (the calls are exact" in capsys.readouterr().out


def test_window_arms_capture_with_their_own_offload_window(monkeypatch):
    import types

    import megatron.training as megatron_training

    from megatron_cg_plugin.config import PluginConfig
    from megatron_cg_plugin.session import RunSession
    from megatron_cg_plugin.slot_sharing.offload_groups import OffloadCopies

    class Base:
        pass

    session = RunSession(PluginConfig(slot_capture=True, offload_window=2))
    plugin_installed(monkeypatch, Base, session)
    monkeypatch.setattr(megatron_training, "get_args", lambda: types.SimpleNamespace())
    trainer = bench.MegatronTrainer(lambda *a, **k: None, (None, None, "model", "optimizer", None, "config", None), {})
    BenchOptions(arms=("slot", "slot-offload", "slot-offload-w0", "slot-offload-staged-w3"))  # all known
    copies = {
        arm: trainer.helper_class(arm).backend.copies
        for arm in ("slot-offload", "slot-offload-w0", "slot-offload-staged", "slot-offload-staged-w3")
    }
    assert copies == {
        "slot-offload": OffloadCopies("in-graph", 2),
        "slot-offload-w0": OffloadCopies("in-graph", 0),
        "slot-offload-staged": OffloadCopies("between-replays", 2),
        "slot-offload-staged-w3": OffloadCopies("between-replays", 3),
    }
    assert trainer.helper_class("slot").backend.offload is False
    assert trainer.helper_class("slot-offload-w0") is trainer.helper_class("slot-offload-w0")  # bound once
    # The frontier over the fraction: -f<P> arms copy as their base arm (the fraction is set at capture).
    BenchOptions(arms=("slot-offload-f0", "slot-offload-w1-f50", "slot-offload-staged-f100"))
    fractions = {
        arm: (trainer.helper_class(arm).backend.offload, trainer.helper_class(arm).backend.copies)
        for arm in ("slot-offload-f0", "slot-offload-w1-f50", "slot-offload-staged-f100")
    }
    assert fractions == {
        "slot-offload-f0": (True, OffloadCopies("in-graph", 2)),
        "slot-offload-w1-f50": (True, OffloadCopies("in-graph", 1)),
        "slot-offload-staged-f100": (True, OffloadCopies("between-replays", 2)),
    }


def test_the_device_timeline_keeps_every_event_with_its_stream_in_start_order(tmp_path):
    events = [
        (5.0, 9.0, "d2h", 21, "Memcpy DtoH (Device -> Pinned)"),
        (1.0, 4.0, "kernel", 7, "k" * 100),
        (3.0, 6.0, "h2d", 22, "Memcpy HtoD (Pinned -> Device)"),
    ]
    path = tmp_path / "slot-offload.device_timeline.json.gz"
    bench_output.write_device_timeline(path, 2, events)
    steps, back = bench_output.read_device_timeline(path)
    assert steps == 2
    assert back == [(1.0, 4.0, "kernel", 7, "k" * 80), events[2], events[0]]


def test_copy_stalls_count_the_copy_time_no_kernel_ran_beside():
    from megatron_cg_plugin.bench.schedule import CopyStalls

    # Two steps: kernels 0-4 and 6-10; a D2H 3-8 (kernels beside it but for 4-6) and an H2D 10-12 (alone).
    events = [
        (0.0, 4.0, "kernel", 7, "a"),
        (6.0, 10.0, "kernel", 9, "b"),
        (3.0, 8.0, "d2h", 21, "c"),
        (10.0, 12.0, "h2d", 22, "d"),
    ]
    stalls = CopyStalls.of(events, steps=2, scale=1.0)
    assert stalls == CopyStalls(span=6.0, kernels=4.0, d2h=2.5, h2d=1.0, exposed_d2h=1.0, exposed_h2d=1.0)


def test_the_timeline_table_reads_each_file_and_names_a_missing_one(tmp_path, capsys):
    path = tmp_path / "slot-offload.device_timeline.json.gz"
    bench_output.write_device_timeline(path, 1, [(0.0, 1000.0, "kernel", 7, "k"), (500.0, 2000.0, "d2h", 21, "c")])
    assert bench_output.main(["--timeline", str(path)]) == 0
    assert "| slot-offload | 2.0 | 1.0 | 1.5 (1.0) | 0.0 (0.0) |" in capsys.readouterr().out
    assert bench_output.main(["--timeline", str(tmp_path / "eager.device_timeline.json.gz")]) == 2
    assert "run megatron-cg bench with --bench-profile-dir" in capsys.readouterr().out


def test_the_recording_arm_is_known_and_taken_by_bench_arms():
    options, _ = parse_bench_argv(["--bench-arms", "plugin,plugin-recording", "--cg-preset", "tiny-gpt"])
    assert options.arms == ("plugin", "plugin-recording")
    assert bench_output.RECORDING_ARM == "plugin-recording" and "plugin-recording" in bench_output.ALL_ARMS
    assert "plugin-recording" not in bench_output.ARMS  # run when asked for, as plugin-no-check


def test_the_recording_arm_runs_interleaved_and_its_ratio_to_plugin_is_in_the_table(tmp_path):
    result, trainer, _, profiled = bench_with_fakes(arms=("stock", "plugin", "plugin-recording"))
    # The recording hooks are timed once, with the recording arm's graphs in place.
    assert profiled == ["stock", "plugin", "plugin-recording", "recording cost on plugin-recording"]
    assert result.summary().ratios["plugin-recording", "plugin"].median == pytest.approx(0.0127 / 0.0126, rel=2e-3)
    written = bench_output.write(result, tmp_path, with_plot=False)
    table = written[1].read_text()
    assert "| plugin-recording / plugin | 1.01 [" in table and "| plugin-recording |" in table
    assert "plugin-recording/plugin" in json.loads(written[0].read_text())["ratio_precision"]
    share = 63.0e-6 / result.summary().arms["plugin-recording"].median
    assert f"| train-step timer and training_log tap | 63.0 | {share:.2%} |" in table
    assert bench_output.from_json(json.loads(written[0].read_text())).recording_us == 63.0
    without, *_ = bench_with_fakes(arms=("stock", "plugin"))
    assert without.recording_us is None and "training_log tap" not in bench_output.markdown(without)


def test_the_recording_cost_times_the_patches_wrappers_on_a_session_of_its_own(monkeypatch, tmp_path):
    """The bench's recording figure runs what a recording run adds to a step: the train-step timer's
    and the training_log tap's own wrappers (binding Megatron's training_log arguments), the probe's
    one read per step, and the session's periodic read of the kept values, on a copy of the arm's
    session: the arm's own records are untouched."""
    from megatron_cg_plugin.config import PluginConfig
    from megatron_cg_plugin.session import RunSession

    reads = []

    class Probe:
        def allocated_bytes(self):
            reads.append("allocated")
            return 1, 2

        def is_rank0(self):
            return True

    monkeypatch.setattr("megatron_cg_plugin.session.CudaProbe", Probe)

    class Loss:  # a device value: detached when kept, read to the host every read_every steps
        def detach(self):
            return self

        def item(self):
            reads.append("loss")
            return 2.0

    bound = []

    def training_log(
        loss_dict,
        total_loss_dict,
        learning_rate,
        iteration,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        num_zeros_in_grad,
        *,
        max_attention_logit=None,
    ):
        raise AssertionError("the tap's wrapped call runs in every arm: it is not timed")

    real_tap = bench.patch_builders.build_training_log_tap
    monkeypatch.setattr(
        bench.patch_builders,
        "build_training_log_tap",
        lambda original, session: (bound.append(inspect.signature(original)), real_tap(original, session))[1],
    )
    arm_session = RunSession(
        PluginConfig(metrics_out=tmp_path / "m.json", report_out=tmp_path / "r.json"), probe=Probe(), read_every=20
    )
    arm_session.helpers.append(_FakeMegatronHelper())
    micros = bench.recording_cost(
        arm_session, ({"lm loss": Loss()}, 0, False, False, 0, 1.5, 3.0, 0.0), training_log, repeats=50
    )
    assert micros > 0 and arm_session.iterations == []
    assert bound == [inspect.signature(training_log)]  # the tap bound Megatron's arguments
    assert reads.count("allocated") == 50 and reads.count("loss") == 40  # two reads of 20 kept losses


class _FakeMegatronHelper:
    """Megatron's TECudaGraphHelper as the bench's trainer drives it, without a model."""

    flattened_callables: ClassVar[list] = []

    def __init__(self, **kwargs) -> None:
        self._created = False

    def create_cudagraphs(self) -> None:
        self._created = True

    def graphs_created(self) -> bool:
        return self._created

    def delete_cuda_graphs(self) -> None:
        self._created = False


def test_only_the_recording_arm_records_each_step_in_a_session_of_its_own(monkeypatch, tmp_path):
    import types

    import megatron.core.transformer.cuda_graphs as cuda_graphs
    import megatron.training as megatron_training

    from megatron_cg_plugin.config import PluginConfig
    from megatron_cg_plugin.session import RunSession

    calls = []

    class Watched(RunSession):
        def mark_iteration_start(self):
            calls.append((self, "mark"))
            super().mark_iteration_start()

        def on_training_log(self, **kwargs):
            calls.append((self, "log", kwargs["iteration"], kwargs["num_zeros_in_grad"]))
            super().on_training_log(**kwargs)

    from megatron_cg_plugin.settings import RunSettings

    run_session = Watched(PluginConfig(metrics_out=tmp_path / "metrics.json"))
    monkeypatch.setattr(bench, "RunSession", Watched)
    plugin_installed(monkeypatch, _FakeMegatronHelper, run_session)
    monkeypatch.setattr(megatron_training, "get_args", types.SimpleNamespace)
    run_session.settings = RunSettings(seq_length=8, micro_batch_size=1)  # as validate_args leaves it
    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", _FakeMegatronHelper)  # the stock arm's
    losses = []

    def train_step(*args, iteration):  # 0.19.2's eight values
        losses.append(torch.tensor(float(iteration)))
        return {"lm loss": losses[-1]}, 0, False, False, 0, 1.5, 7.0 + iteration, 0.0

    trainer = bench.MegatronTrainer(train_step, (None, None, [], "optimizer", None, "config", None), {})
    sessions = {}
    for arm in ("stock", "plugin", "plugin-no-check", "plugin-recording", "plugin", "plugin-recording"):
        helper = trainer.capture(arm)
        for _ in range(2):
            trainer.step()
        sessions.setdefault(arm, []).append(getattr(helper, "session", None))
        trainer.release(helper)
    first, second = sessions["plugin-recording"]
    assert first is not second and run_session not in (first, second)  # a fresh session per block
    # The run's config, with both outputs asked for: the session keeps every value a run with them keeps.
    assert first.config == dataclasses.replace(run_session.config, **bench.MegatronTrainer.RECORDED_OUTPUTS)
    assert first.keeps_values and first.helpers and len(first.helpers) == 1
    # Steps 6, 7 and 10, 11 of the trainer; train() logs each as the iteration after it.
    assert [call[1:] for call in calls] == [
        ("mark",),
        ("log", 7, 13.0),
        ("mark",),
        ("log", 8, 14.0),
        ("mark",),
        ("log", 11, 17.0),
        ("mark",),
        ("log", 12, 18.0),
    ]
    assert {session for session, *_ in calls} == {first, second}  # no other arm records
    assert [(r.iteration, r.graphed) for r in first.iterations] == [(7, True), (8, True)]
    assert trainer.recording is None and trainer.iteration == 12
    assert list(tmp_path.iterdir()) == []  # the recording sessions are never finished: no file


def test_the_recording_arm_takes_the_loss_dict_and_num_zeros_from_train_steps_result():
    assert bench.logged_values(({"lm loss": 2.0}, 0, False, False, 0, 1.5, 42.0, 0.0)) == ({"lm loss": 2.0}, 42.0)
    with pytest.raises(BenchError, match=r"another shape than 0\.19\.2's eight values: install the supported"):
        bench.logged_values(({"lm loss": 2.0}, 0, False, False, 0, 1.5, 42.0))


def test_each_ratio_says_how_closely_its_median_is_known_and_the_rounds_for_one_percent():
    from megatron_cg_plugin.bench.schedule import median_precision

    result, *_ = bench_with_fakes(rounds=6)  # 3 pairs
    ratios = result.summary().ratios["plugin", "stock"]
    found = median_precision(ratios.values, bench_output.RATIO_WIDTH)
    table = bench_output.markdown(result)
    assert (
        "| ratio | median [spread] over pairs of mirrored rounds | median known to (95%) | rounds for +-1% |" in table
    )
    assert f"| plugin / stock | {ratios.format()} | +-{found.half_width:.1%} | ~{found.rounds_needed} |" in table
    assert bench_output.to_json(result)["ratio_precision"]["plugin/stock"]["pairs_needed"] == found.pairs_needed
    one_pair, *_ = bench_with_fakes(rounds=2)
    assert "| - (one pair) | - |" in bench_output.markdown(one_pair)
    assert bench_output.to_json(one_pair)["ratio_precision"] == {}


def test_a_script_as_first_flag_is_benched_through_the_script_and_a_missing_one_is_refused(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert bench.user_script([str(script), "--num-layers", "2"]) == script
    assert bench.user_script(["--cg-preset", "tiny-gpt"]) is None  # the launcher's flags
    with pytest.raises(
        BenchError,
        match=r"the training script .*missing\.py does not exist; give the path of an existing file",
    ):
        bench.user_script([str(tmp_path / "missing.py")])


def test_a_users_script_runs_with_the_bench_in_its_train_step_and_refusals_before_any_block(monkeypatch, tmp_path):
    """The script's own pretrain() reaches the bench through Megatron's train_step, which the bench
    stands in for only while the script runs; its flags end with the bench's iteration count."""
    import types

    from megatron.training import training

    from megatron_cg_plugin.launch import run_script

    script = tmp_path / "train.py"
    script.write_text("")
    real_step, seen = training.train_step, {}

    def run_in_process(path, args):  # what the script's pretrain() does: call train_step
        seen["script"], seen["args"] = path, list(args)
        seen["patched"] = training.train_step is not real_step
        training.train_step("forward", "data", iteration=0)
        return 0

    def driver(options, flags, train_step, sink, before=None):
        def step(*args, **kwargs):
            before()
            sink.append("result")
            loop_args.train_iters = loop_args.curr_iteration = 1  # as the bench's first step leaves them

        return step

    monkeypatch.setattr(run_script, "run_in_process", run_in_process)
    monkeypatch.setattr(bench, "bench_train_step", driver)
    monkeypatch.setattr(bench_output, "write", lambda result, out, with_plot: [])
    monkeypatch.setattr(bench_output, "markdown", lambda result: "")
    import megatron.training

    from megatron_cg_plugin import installation
    from megatron_cg_plugin.config import PluginConfig

    session = types.SimpleNamespace(  # the flags validated: nothing left for ensure_checked
        config=PluginConfig(), settings=run_settings(), ensure_checked=lambda: None
    )
    monkeypatch.setattr(installation, "active_session", lambda: session)  # what install() leaves
    loop_args = types.SimpleNamespace(train_iters=7)
    monkeypatch.setattr(megatron.training, "get_args", lambda: loop_args)
    assert (
        bench.main(["--bench-no-plot", "--bench-rounds", "2", "--bench-steps", "3", str(script), "--num-layers", "2"])
        == 0
    )
    assert seen["script"] == script and seen["patched"] and training.train_step is real_step
    assert seen["args"][:2] == ["--num-layers", "2"] and seen["args"][2:4] == [
        "--train-iters",
        str(BenchOptions(rounds=2, steps=3).total_steps),
    ]
    assert vars(loop_args) == {"train_iters": 7}  # Megatron's loop args back as they were before the bench
    session.settings = run_settings(save="/ckpt")
    with pytest.raises(BenchError, match="drop --save for the bench"):
        bench.main(["--bench-no-plot", "--bench-rounds", "2", "--bench-steps", "3", str(script)])
    assert training.train_step is real_step  # put back after a refusal too


def test_a_run_whose_flags_were_never_checked_is_refused_by_the_bench():
    """Nothing parsed for the session to check itself (RunSession.ensure_checked): the bench names the way in."""
    from megatron_cg_plugin.session import RunSession

    session = RunSession(PluginConfig(), parsed_args=lambda: None)
    with pytest.raises(BenchError, match=r"not validated with the plugin installed.*megatron-cg tune"):
        bench._run_settings(session, "tune")
