"""megatron-cg tune on CPU: the flags each setup runs with (the setups each kind of model gets are
setups.graph_setups', tested in test_setups.py), the rules' refusals carried with their names, the memory
budget, the stopping rule, the ranking and verdicts, the timing through the bench's trainer seam on a
fake trainer, the scope switch of the Megatron-side trainer, and the command's dry run and refusals of
bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import types

import pytest

from megatron_cg_plugin import cli, console, foreign_state, rules
from megatron_cg_plugin.bench import command as bench_command
from megatron_cg_plugin.bench.output import StepRecord
from megatron_cg_plugin.bench.schedule import DeviceTime
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.launch import dry_run
from megatron_cg_plugin.launch.presets import PRESET_FLAGS
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.setups import graph_setups
from megatron_cg_plugin.setups.graph_setups import EAGER, GraphSetup, ModelKind
from megatron_cg_plugin.tune import ranking
from megatron_cg_plugin.tune.candidates import (
    build_time_notes,
    built_setup,
    dispatcher_dtoh_point,
    given_modules,
    given_setup,
    placement,
    setup_flags,
    strip_flags,
)
from megatron_cg_plugin.tune.ranking import Measured, RatioInterval, Row
from megatron_cg_plugin.tune.timing import TimingOptions, steps_needed, time_setups

TE = "transformer_engine"
MIB = 2**20


# -- each setup's flags --------------------------------------------------------------------------

USER = [
    "--num-layers", "2",
    "--cuda-graph-impl", TE,
    "--cuda-graph-modules", "attn", "moe_router",
    "--cg-contract-check=off",
    "--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj",
    "--cg-offload-window", "2",
    "--bf16",
]  # fmt: skip


def test_strip_flags_takes_each_flags_values_with_it():
    assert strip_flags(["--a", "1", "--b", "x", "y", "--c", "--d=4", "--e"], {"--a": 1, "--b": None, "--d": 1}) == [
        "--c",
        "--e",
    ]
    assert strip_flags(["--b", "--c"], {"--b": None}) == ["--c"]  # an empty list


def test_a_graphed_setup_replaces_the_users_graph_flags_and_keeps_the_rest():
    flags = setup_flags(USER, GraphSetup(graphed=True, modules=("attn", "mlp"), slot=True, offload=True))
    assert flags == [
        "--num-layers", "2",
        "--cg-contract-check=off",
        "--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj",
        "--cg-offload-window", "2",
        "--bf16",
        "--cuda-graph-impl", TE, "--cuda-graph-modules", "attn", "mlp", "--cg-slot-capture",
    ]  # fmt: skip


def test_without_offload_megatrons_offload_flags_and_the_slot_knobs_go():
    flags = setup_flags(USER, GraphSetup(graphed=True))
    assert flags == ["--num-layers", "2", "--cg-contract-check=off", "--bf16", "--cuda-graph-impl", TE]


def test_te_graphs_with_offload_keep_megatrons_offload_but_not_the_slot_only_knobs():
    flags = setup_flags(USER, GraphSetup(graphed=True, modules=("attn",), offload=True))
    assert "--offload-modules" in flags and "--cg-offload-window" not in flags
    banks = setup_flags([*USER, "--cg-graph-banks"], GraphSetup(graphed=True, modules=("attn",), offload=True))
    assert "--cg-offload-window" in banks  # graph banks take them


def test_eager_drops_the_plugins_graph_only_flags_and_keeps_the_users_offload():
    flags = setup_flags(USER, GraphSetup(graphed=False))
    assert flags == [
        "--num-layers", "2", "--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj",
        "--bf16",
    ]  # fmt: skip


def test_attention_offload_adds_attentions_groups_to_the_users_offload_modules():
    qkv = [token if token != "core_attn" else "qkv_linear" for token in USER if token != "attn_proj"]
    kept = GraphSetup(graphed=True, modules=("attn",), slot=True, offload=True, attention_offload=True)
    flags = setup_flags(qkv, kept)
    assert flags.count("--fine-grained-activation-offloading") == 1 and flags.count("--offload-modules") == 1
    at = flags.index("--offload-modules")
    assert flags[at + 1 : at + 4] == ["qkv_linear", "core_attn", "attn_proj"]
    assert "--cg-offload-window" in flags  # slot-shared capture offloads: its knobs stay
    alone = setup_flags(["--num-layers", "2"], dataclasses.replace(kept, offload=False))
    assert alone == [
        "--num-layers", "2", "--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj",
        "--cuda-graph-impl", TE, "--cuda-graph-modules", "attn", "--cg-slot-capture",
    ]  # fmt: skip


def test_the_users_own_setup_and_scope_are_read_from_their_flags():
    kind = ModelKind(offload=True)
    assert given_setup(USER, kind) == GraphSetup(graphed=True, modules=("attn", "moe_router"), offload=True)
    assert given_setup(["--cuda-graph-modules", "attn"], kind) == GraphSetup(graphed=False)
    assert given_modules(["--cuda-graph-modules", "attn", "--bf16"]) == ("attn",)
    assert given_modules(["--bf16"]) is None


def test_the_users_setup_is_read_from_megatrons_deprecated_spellings_and_in_any_order():
    kind = ModelKind()
    assert given_modules(["--cuda-graph-scope", "attn"]) == ("attn",)
    assert given_modules(["--cuda-graph-modules", "moe_preprocess", "attn", "moe_router", "attn"]) == (
        "attn",
        "moe_router",
        "moe_preprocess",
    )
    assert given_setup(["--external-cuda-graph", "--cuda-graph-scope", "mlp", "attn"], kind) == GraphSetup(
        graphed=True, modules=("attn", "mlp")
    )
    assert given_setup(["--external-cuda-graph", "--cuda-graph-impl", "local"], kind) == GraphSetup(graphed=False)


# -- where each setup is timed -------------------------------------------------------------------


def settings_of(setup: GraphSetup, **more) -> RunSettings:
    return RunSettings(
        cuda_graph_impl=TE if setup.graphed else "none", modules=setup.modules, slot_capture=setup.slot, **more
    )


@pytest.mark.parametrize(
    "setup, more, kind, schedule",
    [
        (GraphSetup(graphed=False), {}, ModelKind(), "steps"),
        (GraphSetup(graphed=True, modules=("attn",)), {}, ModelKind(), "steps"),
        (GraphSetup(graphed=True, slot=True), {}, ModelKind(), "blocks"),
        (GraphSetup(graphed=True, modules=("attn",)), {"fp8": True}, ModelKind(), "blocks"),
        (
            GraphSetup(graphed=True, modules=("attn",), offload=True),
            {"activation_offloading": True},
            ModelKind(offload=True),
            "blocks",
        ),
        # TE graphs without the offload the model is built with: another build, another process
        (GraphSetup(graphed=True, modules=("attn",)), {}, ModelKind(offload=True), None),
        (GraphSetup(graphed=True, slot=True), {}, ModelKind(offload=True), "blocks"),  # slot keeps the hooks out
    ],
)
def test_placement(setup, more, kind, schedule):
    found = placement(setup, settings_of(setup, **more), kind)
    assert found.schedule == schedule
    assert bool(found.why) == (schedule != "steps")


def test_a_setup_offloading_attention_is_not_timed_in_a_process_built_without_it():
    setup = GraphSetup(graphed=True, modules=("attn",), slot=True, attention_offload=True)
    found = placement(setup, settings_of(setup, activation_offloading=True), ModelKind(), ("NVTE_CPU_OFFLOAD_V1=1",))
    assert found.schedule is None
    assert "with attention offloaded" in found.why and "these flags and NVTE_CPU_OFFLOAD_V1=1 to time it" in found.why


def test_the_timing_process_is_built_with_the_users_scope_under_te_graphs_where_it_is_timed():
    attn, router = GraphSetup(graphed=True, modules=("attn",)), GraphSetup(graphed=True, modules=("attn", "moe_router"))
    slot = GraphSetup(graphed=True, modules=("attn", "moe_router"), slot=True)
    assert built_setup([slot, attn, router], ModelKind(), ("attn", "moe_router")) == router
    assert built_setup([slot, attn], ModelKind(), ("attn", "moe_router")) == attn  # TE's graphs first
    assert built_setup([slot], ModelKind(), None) == slot
    assert built_setup([GraphSetup(graphed=False)], ModelKind(), None) is None


def test_the_dispatchers_copy_point_follows_each_arms_scope_as_megatrons_build_does():
    assert dispatcher_dtoh_point(GraphSetup(graphed=True, modules=("attn", "moe_router", "moe_preprocess"))) == (
        "before_ep_alltoall"
    )
    assert dispatcher_dtoh_point(GraphSetup(graphed=True)) == "before_ep_alltoall"  # the whole layer
    assert dispatcher_dtoh_point(GraphSetup(graphed=True, modules=("attn",))) == "before_permutation_1"
    assert dispatcher_dtoh_point(GraphSetup(graphed=False)) == "before_permutation_1"  # no graphs


def test_what_the_build_fixes_and_an_arm_cannot_set_is_noted():
    router = GraphSetup(graphed=True, modules=("attn", "moe_router"))
    attn = GraphSetup(graphed=True, modules=("attn",))
    assert build_time_notes(router, attn, ModelKind(moe=True, recompute_norms=True))
    assert build_time_notes(router, attn, ModelKind(moe=True)) == ()
    assert build_time_notes(attn, attn, ModelKind(moe=True, recompute_norms=True)) == ()


# -- the plan: the rules' refusals, the predictions ----------------------------------------------


def test_refused_setups_keep_every_rule_and_allowed_ones_their_prediction(monkeypatch):
    from megatron_cg_plugin.tune import command as tune_command

    seen: list[list[str]] = []

    def validate(flags, environment):
        seen.append(list(flags))
        assert environment == (("NVTE_CPU_OFFLOAD_V1=1",) if "--fine-grained-activation-offloading" in flags else ())
        settings = RunSettings(
            cuda_graph_impl=TE if TE in flags else "none",
            modules=tuple(given_modules(flags) or ()),
            slot_capture="--cg-slot-capture" in flags,
            num_layers=2,
            num_experts=4,
        )
        if settings.te_graphs and not settings.modules:
            raise rules.RuleViolation([("whole-layer-moe-needs-drop-and-pad", "add a capacity"), ("other", "x")])
        return settings, PluginConfig()

    monkeypatch.setattr(
        graph_setups, "predict_graph_memory", lambda settings, config: types.SimpleNamespace(
            pool_bytes=10 * MIB, arena_bytes=2 * MIB if settings.slot_capture else None, boundary_bytes=None,
            thd_buffer_bytes=None, host_arena_bytes=None, unpredicted=("tp",),
        ) if settings.te_graphs else None
    )  # fmt: skip
    plan = tune_command.plan_setups(["--num-layers", "2"], validate)
    rows = {row.label: row for row in plan.rows}
    assert rows["whole layer"].refused == (("whole-layer-moe-needs-drop-and-pad", "add a capacity"), ("other", "x"))
    assert ranking.verdicts(plan.rows)["whole layer"] == "refused [whole-layer-moe-needs-drop-and-pad, other]"
    assert rows["attn"].predicted_bytes == 10 * MIB and rows["attn, slot"].predicted_bytes == 12 * MIB
    assert rows["attn"].prediction_leaves_out == ("tp",) and rows["eager"].predicted_bytes is None
    assert rows["eager"].yours  # the user's flags have no graphs
    assert plan.built == GraphSetup(graphed=True, modules=("attn",))
    assert len(seen) == len(plan.rows)  # eager checked once, first, as the model's own check
    assert [row.setup for row in plan.rows] == [GraphSetup(graphed=False), *graph_setups.graph_setups(plan.kind)]


OFFLOADING_RUN = (
    "--cg-preset", "tiny-gpt", "--cuda-graph-impl", TE, "--cuda-graph-modules", "attn", "--cg-slot-capture",
    "--fine-grained-activation-offloading", "--offload-modules", "qkv_linear", "--min-offloaded-tensor-size", "4096",
    "--cg-offload-window", "2", "--cg-contract-check", "shapes",
)  # fmt: skip


def test_a_setups_flags_read_by_megatron_give_the_settings_the_guard_builds_for_it():
    """The tune builds each setup from its flags through Megatron's validation, the memory guard from the run's
    settings (setups.setup_settings): both give the same settings, plugin config and refusals."""
    from megatron_cg_plugin.tune import command as tune_command

    def validated(flags, environment=()):
        extra = dict(item.split("=", 1) for item in ("NVTE_CPU_OFFLOAD_V1=1", *environment))
        with dry_run.scoped_environ(**extra):
            _args, settings, config = dry_run.validated_args(flags, nproc=1, env=extra)
        return settings, config or PluginConfig()

    base = tune_command._expanded(OFFLOADING_RUN)
    run, config = validated(base)
    assert run.activation_offloading and run.slot_capture and config.offload_window == 2
    built = {setup.graph: setup for setup in graph_setups.enumerate_setups(run, config)}
    assert len(built) > 6
    for graph, setup in built.items():
        try:
            settings, flags_config = validated(setup_flags(base, graph), setup.environment)
        except (rules.RuleViolation, dry_run.CheckError) as refusal:
            assert {name for name, _ in refusal.violations} == {name for name, _ in setup.refused}, graph.label
            continue
        assert not setup.refused, graph.label
        ignored = {"graph_only_flags": ()}  # which --cg-* graph-only flags were typed: not a setting of the run
        assert dataclasses.replace(settings, **ignored) == dataclasses.replace(setup.settings, **ignored), graph.label
        assert flags_config == setup.config, graph.label


def test_a_model_whose_own_flags_are_refused_is_not_tuned():
    from megatron_cg_plugin.tune import command as tune_command

    def validate(flags, environment):
        raise rules.RuleViolation([("model-sizes", "--hidden-size 0")])

    with pytest.raises(rules.RuleViolation, match="--hidden-size 0"):
        tune_command.plan_setups(["--hidden-size", "0"], validate)


# -- budget, stopping rule, ranking, verdicts -----------------------------------------------------


def row(label_setup: GraphSetup, *, ratio=None, predicted=None, schedule="steps", **more) -> Row:
    measured = None if ratio is None else Measured("steps", 0.1 * ratio[0], RatioInterval(*ratio, 10, "95% over 10"))
    return Row(label_setup, (), predicted_bytes=predicted, schedule=schedule, measured=measured, **more)


EAGER_ROW = Row(GraphSetup(graphed=False), (), schedule="steps")
ATTN = GraphSetup(graphed=True, modules=("attn",))
MLP = GraphSetup(graphed=True, modules=("attn", "mlp"))
WHOLE = GraphSetup(graphed=True)


def test_a_dense_whole_layer_is_timed_once_as_attn_mlp_where_attn_mlp_is_timed():
    from megatron_cg_plugin.tune.command import _timed_once

    slot_whole, slot_mlp = (dataclasses.replace(s, slot=True) for s in (WHOLE, MLP))
    rows = [EAGER_ROW, row(MLP), row(WHOLE), row(slot_mlp, schedule="blocks"), row(slot_whole, schedule="blocks")]
    found = {r.label: r for r in _timed_once(rows, ModelKind())}
    assert [label for label, r in found.items() if r.timable] == ["eager", "attn mlp", "attn mlp, slot"]
    assert found["whole layer, slot"].why.startswith("the same graphs as attn mlp, slot")
    # MoE layers: the whole layer graphs the MoE block, attn mlp does not
    assert all(r.timable for r in _timed_once(rows, ModelKind(moe=True, dense_layers=True)))
    # attn mlp refused or not placed: the whole layer is timed
    refused = [EAGER_ROW, row(MLP, refused=(("rule", "why"),)), row(WHOLE)]
    assert [r.timable for r in _timed_once(refused, ModelKind())] == [True, False, True]


def test_the_report_gives_eagers_step_in_each_schedule_where_both_ran():
    from megatron_cg_plugin.tune.command import TunePlan, report

    plan = TunePlan(ModelKind(), (), (EAGER_ROW,), {}, None)
    both = report(plan, [EAGER_ROW], budget="-", eager_seconds={"blocks": 0.3205, "steps": 0.2902})
    assert "eager's median step: 320.5 ms in the blocks schedule, 290.2 ms in the steps schedule" in "\n".join(both)
    one = report(plan, [EAGER_ROW], budget="-", eager_seconds={"steps": 0.2902})
    assert not any(line.startswith("eager's median step") for line in one)


def test_the_default_budget_is_the_device_less_eagers_peak_and_the_margin():
    assert ranking.default_budget(80 * 2**30, 30 * 2**30) == 80 * 2**30 - 30 * 2**30 - 4 * 2**30
    assert ranking.default_budget(10 * 2**30, 20 * 2**30) == 0


def test_setups_over_the_budget_are_dropped_with_the_figures():
    rows = [EAGER_ROW, row(ATTN, predicted=100 * MIB), row(WHOLE, predicted=900 * MIB), row(MLP, predicted=None)]
    found = {r.label: r for r in ranking.apply_budget(rows, 500 * MIB, source="--tune-memory-gib")}
    assert found["whole layer"].over_budget == "over budget: predicted 900 MiB > 500 MiB (--tune-memory-gib)"
    assert not found["whole layer"].timable
    assert not found["attn"].over_budget and not found["attn mlp"].over_budget  # not predicted: passes
    assert ranking.apply_budget(rows, None, source="x") == rows
    assert ranking.verdicts(list(found.values()))["whole layer"].startswith("over budget: predicted 900 MiB")


def test_step_arms_that_would_not_fit_alive_together_are_captured_alone():
    rows = [EAGER_ROW, row(ATTN, predicted=300 * MIB), row(MLP, predicted=300 * MIB), row(WHOLE, predicted=None)]
    found = {r.label: r for r in ranking.fit_together(rows, 500 * MIB)}
    assert found["attn"].schedule == "steps"
    assert found["attn mlp"].schedule == "blocks" and "300 MiB would pass the budget" in found["attn mlp"].why
    assert found["whole layer"].schedule == "blocks" and "not predicted" in found["whole layer"].why
    assert ranking.fit_together(rows, None) == rows


@pytest.mark.parametrize(
    "attn, mlp, elapsed, reason",
    [
        ((0.80, 0.78, 0.82), (0.90, 0.88, 0.92), 1.0, "separated"),
        ((0.80, 0.78, 0.91), (0.90, 0.88, 0.92), 1.0, None),  # overlapping: time left
        ((0.80, 0.78, 0.91), (0.90, 0.88, 0.92), 60.0, "out of time"),
        ((1.05, 1.02, 1.08), (1.10, 1.09, 1.12), 1.0, "separated"),  # eager best, separated from the next
        ((1.05, 0.98, 1.08), (1.10, 1.09, 1.12), 1.0, None),
    ],
)
def test_timing_stops_once_the_best_is_separated_from_the_next_or_out_of_time(attn, mlp, elapsed, reason):
    rows = [EAGER_ROW, row(ATTN, ratio=attn), row(MLP, ratio=mlp)]
    assert ranking.stop_reason(rows, elapsed=elapsed, seconds=60.0) == reason


def test_a_timed_setup_without_an_interval_yet_keeps_timing():
    pending = dataclasses.replace(row(MLP), measured=Measured("steps", 0.1, None))
    rows = [EAGER_ROW, row(ATTN, ratio=(0.5, 0.4, 0.6)), pending]
    assert ranking.stop_reason(rows, elapsed=0.0, seconds=1.0) is None


def test_the_winner_beats_eager_beyond_its_interval_and_its_flags_are_given():
    rows = [EAGER_ROW, row(ATTN, ratio=(0.80, 0.78, 0.82)), row(MLP, ratio=(0.70, 0.69, 0.71), yours=True)]
    assert [r.label for r in ranking.rank(rows)] == ["attn mlp", "attn", "eager"]
    found = ranking.verdicts(rows)
    assert found == {"attn mlp": "best", "attn": "slower than the best", "eager": "baseline; slower than the best"}
    lines = ranking.winner_lines(rows, base_has_offload=False)
    assert lines[0].startswith("best setup: attn mlp (0.700 [0.690, 0.710]")
    assert lines[1] == f"  its graph flags: --cuda-graph-impl {TE} --cuda-graph-modules attn mlp"
    assert ranking.graphs_do_not_pay(rows) is None
    table = ranking.table(rows)
    assert table.splitlines()[2].startswith("| attn mlp (yours) |") and "| best |" in table.splitlines()[2]


def test_a_winner_not_separated_from_another_names_it_and_a_dropped_offload_is_said():
    offload = GraphSetup(graphed=True, modules=("attn",), offload=True)
    rows = [EAGER_ROW, row(ATTN, ratio=(0.80, 0.76, 0.84)), row(offload, ratio=(0.82, 0.79, 0.85))]
    found = ranking.verdicts(rows)
    assert found["attn"] == "best (not separated from attn, offload)"
    assert found["attn, offload"] == "within the best's interval"
    lines = "\n".join(ranking.winner_lines(rows, base_has_offload=True))
    assert "without your activation offload flags" in lines and "not told apart from attn, offload" in lines


def test_a_lower_median_whose_interval_reaches_eager_is_not_the_best():
    rows = [EAGER_ROW, row(ATTN, ratio=(0.79, 0.77, 0.83)), row(MLP, ratio=(0.74, 0.26, 2.07))]
    assert ranking.rank(rows)[0].label == "attn mlp" and ranking.winner(rows).label == "attn"
    found = ranking.verdicts(rows)
    assert found["attn"] == "best (not separated from attn mlp)"
    assert found["attn mlp"] == "within the best's interval"
    assert found["eager"] == "baseline; slower than the best"


def test_graphs_do_not_pay_when_no_setup_beats_eager_beyond_its_interval():
    rows = [EAGER_ROW, row(ATTN, ratio=(0.99, 0.97, 1.01)), row(MLP, ratio=(1.10, 1.08, 1.12))]
    assert ranking.winner(rows) is None
    sentence = ranking.graphs_do_not_pay(rows)
    assert sentence is not None and sentence.startswith("Graphs do not pay for this model")
    assert "attn" in sentence and "train it eagerly" in sentence
    assert sentence.endswith("A longer --tune-seconds may yet separate attn from eager.")  # its median is below 1
    slower = ranking.graphs_do_not_pay([EAGER_ROW, row(ATTN, ratio=(1.02, 1.01, 1.03))])
    assert slower is not None and slower.endswith("train it eagerly.")
    assert ranking.winner_lines(rows, base_has_offload=False) == [sentence]
    found = ranking.verdicts(rows)  # eager is the best, and the table says so
    assert found == {
        "eager": "baseline; best (not separated from attn)",
        "attn": "within the best's interval",
        "attn mlp": "slower than the best",
    }
    assert ranking.graphs_do_not_pay([EAGER_ROW, row(ATTN)]) is None  # nothing timed yet: no verdict


def test_the_json_has_every_setup_its_verdict_and_the_winner():
    rows = [EAGER_ROW, row(ATTN, ratio=(0.8, 0.78, 0.82)), Row(WHOLE, ("--x",), refused=(("rule-a", "fix"),))]
    data = json.loads(json.dumps(ranking.to_json(rows, model="dense")))
    assert data["model"] == "dense" and data["winner"]["setup"] == "attn"
    by_label = {entry["setup"]: entry for entry in data["setups"]}
    assert by_label["whole layer"]["refused"] == [{"rule": "rule-a", "message": "fix"}]
    assert by_label["attn"]["measured"]["ratio"]["median"] == 0.8


def test_a_ratio_interval_is_distribution_free_from_six_values_and_approximate_below():
    six = ratio_of([0.9, 0.91, 0.92, 0.93, 0.94, 0.95], "cycles")
    assert six.method == "95% over 6 cycles" and six.low == 0.9 and six.high == 0.95
    three = ratio_of([0.9, 0.92, 0.94], "pairs")
    assert three.method == "~95% over 3 pairs (Student's t)" and three.low < 0.92 < three.high


@pytest.mark.parametrize(
    "values, quantile", [([0.9, 0.95], 12.7062), ([0.9, 0.92, 0.95], 4.3027), ([0.9] * 4 + [0.95], 2.7764)]
)
def test_an_interval_over_a_few_values_takes_students_t_quantile_not_the_normal_one(values, quantile):
    from megatron_cg_plugin.bench.schedule import median_precision

    found = ratio_of(values, "pairs")
    normal_half_width = median_precision(values).half_width
    assert math.log(found.high / found.median) == pytest.approx(normal_half_width * quantile / 1.959964, rel=1e-9)
    assert math.log(found.median / found.low) == pytest.approx(normal_half_width * quantile / 1.959964, rel=1e-9)


def test_timing_goes_on_while_a_slower_median_with_a_wider_interval_still_overlaps_the_best():
    rows = [EAGER_ROW, row(ATTN, ratio=(0.52, 0.50, 0.55)), row(MLP, ratio=(0.72, 0.56, 0.90))]
    assert ranking.stop_reason(rows, elapsed=1.0, seconds=60.0) == "separated"
    rows.append(row(WHOLE, ratio=(0.73, 0.54, 0.95)))
    assert ranking.stop_reason(rows, elapsed=1.0, seconds=60.0) is None
    assert ranking.verdicts(rows)["attn"] == "best (not separated from whole layer)"


def test_a_setup_that_failed_after_timed_rounds_is_no_candidate():
    failed = dataclasses.replace(row(MLP, ratio=(0.50, 0.48, 0.52)), failed="RuntimeError: capture failed")
    rows = [EAGER_ROW, row(ATTN, ratio=(0.80, 0.78, 0.82)), failed]
    assert [r.label for r in ranking.rank(rows)] == ["attn", "eager"]
    assert ranking.winner(rows).label == "attn"
    found = ranking.verdicts(rows)
    assert found["attn"] == "best" and found["attn mlp"] == "failed: RuntimeError: capture failed"
    assert ranking.stop_reason(rows, elapsed=1.0, seconds=60.0) == "separated"
    assert ranking.to_json(rows)["winner"]["setup"] == "attn"
    assert "not told apart" not in "\n".join(ranking.winner_lines(rows, base_has_offload=False))
    assert ranking.ratio_interval([0.9], unit="pairs") is None


def ratio_of(values, unit):
    found = ranking.ratio_interval(values, unit=unit)
    assert found is not None
    return found


# -- timing through the bench's trainer seam ----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlotHelper(str):
    """A slot-shared arm's helper: its label, and two layers' arenas and boundary buffers outside the pool."""

    def __new__(cls, arm: str) -> SlotHelper:
        helper = super().__new__(cls, arm)
        layers = [types.SimpleNamespace(arena_bytes=2 * MIB, host_arena_bytes=0, boundary_bytes=MIB)] * 2
        helper.capture_stats = types.SimpleNamespace(slot_layers=lambda: layers)
        return helper


class FakeTrainer:
    """Steps at its arm's speed with 1% jitter; captures add a pool (slot-shared ones arenas and boundaries
    beside it); an arm in ``failing`` fails to capture."""

    def __init__(self, clock: Clock, speeds: dict[str, float], failing=(), seed=0) -> None:
        self.clock, self.speeds, self.failing = clock, speeds, set(failing)
        self.rng = random.Random(seed)
        self.arm, self.alive, self.pools, self.events = EAGER, set(), {}, []

    def step(self) -> None:
        self.clock.now += self.speeds[self.arm] * self.rng.lognormvariate(0.0, 0.01)

    def capture(self, arm):
        assert self.arm == EAGER, f"captured {arm} over {self.arm}"
        if arm in self.failing:
            raise RuntimeError(f"{arm} capture failed")
        self.events.append(f"capture {arm}")
        self.pools[(len(self.pools), 0)] = 32 * MIB
        self.arm = arm
        self.alive.add(arm)
        return SlotHelper(arm) if ", slot" in arm else arm

    def activate(self, arm):
        assert arm == EAGER or arm in self.alive
        self.arm = arm

    def deactivate(self):
        self.arm = EAGER

    def release(self, helper):
        self.events.append(f"release {helper}")
        self.alive.discard(helper)
        self.arm = EAGER

    def synchronize(self):
        pass

    def peak_allocated(self, reset=False):
        return 1 << 30

    def pool_bytes(self):
        return dict(self.pools)


def timed(rows, speeds, *, seconds=1000.0, failing=(), budget=None, device=None, profile=None):
    clock = Clock()
    trainer = FakeTrainer(clock, speeds, failing)
    lines: list[str] = []
    result = time_setups(
        rows,
        trainer,
        options=TimingOptions(seconds=seconds, max_cycles=80, max_pairs=8, block_steps=4),
        budget_bytes=budget,
        device_bytes=device,
        clock=clock,
        progress=lines.append,
        profile=profile,
    )
    return result, trainer, lines


def test_clearly_different_setups_stop_as_soon_as_the_best_is_separated():
    rows = [EAGER_ROW, row(ATTN, predicted=MIB), row(MLP, predicted=MIB)]
    result, trainer, lines = timed(rows, {EAGER: 0.30, "attn": 0.20, "attn mlp": 0.15})
    assert result.stopped == {"steps": "separated"}
    kept = len(result.results["steps"].steps) // 6 - 2
    assert kept == 6  # the fewest kept cycles with an interval
    found = {r.label: r for r in result.rows}
    assert ranking.winner(result.rows) is found["attn mlp"]
    assert found["attn mlp"].measured.ratio.high < found["attn"].measured.ratio.low
    assert found["attn"].measured.graph_bytes == 32 * MIB and found["attn"].measured.capture_seconds == 0.0
    assert found[EAGER].measured.peak_bytes == 1 << 30
    assert trainer.alive == set()  # every arm torn down


def test_setups_within_noise_of_each_other_run_until_out_of_time():
    rows = [EAGER_ROW, row(ATTN), row(MLP)]
    result, _, lines = timed(rows, {EAGER: 0.30, "attn": 0.20, "attn mlp": 0.20}, seconds=20.0)
    assert result.stopped == {"steps": "out of time"}
    assert any("--tune-seconds 20 reached" in line for line in lines)
    assert "not separated" in ranking.verdicts(result.rows)[ranking.rank(result.rows)[0].label]


def test_a_failed_capture_marks_its_setup_and_the_others_go_on():
    rows = [EAGER_ROW, row(ATTN), row(MLP), row(GraphSetup(graphed=True, slot=True), schedule="blocks")]
    result, trainer, lines = timed(
        rows, {EAGER: 0.30, "attn": 0.20, "attn mlp": 0.15, "whole layer, slot": 0.1}, failing={"attn"}
    )
    found = {r.label: r for r in result.rows}
    assert found["attn"].failed == "RuntimeError: attn capture failed" and found["attn"].measured is None
    assert ranking.verdicts(result.rows)["attn"] == "failed: RuntimeError: attn capture failed"
    assert found["attn mlp"].measured is not None and found["whole layer, slot"].measured.schedule == "blocks"
    assert any("capture of attn failed" in line for line in lines)


def test_slot_setups_are_timed_in_blocks_pair_by_pair_until_separated():
    slot = GraphSetup(graphed=True, modules=("attn",), slot=True)
    rows = [EAGER_ROW, row(slot, schedule="blocks")]
    result, trainer, _ = timed(rows, {EAGER: 0.30, "attn, slot": 0.10}, profile=lambda step, n, arm: None)
    assert result.stopped == {"blocks": "separated"}
    blocks = result.results["blocks"].blocks
    assert len({record.round for record in blocks}) == 4  # two pairs: the first with an interval
    assert trainer.events.count("capture attn, slot") == 4 + 1  # a capture per block, one more to profile
    assert trainer.alive == set()
    measured = {r.label: r for r in result.rows}["attn, slot"].measured
    assert "Student's t" in measured.ratio.method and measured.ratio.high < 1
    assert measured.graph_bytes == 32 * MIB + 2 * (2 * MIB + MIB)  # as predicted: pool, arenas, boundaries


def test_the_block_schedule_runs_two_pairs_before_time_can_stop_it_so_each_ratio_has_an_interval():
    slot = GraphSetup(graphed=True, modules=("attn",), slot=True)
    result, _, _ = timed([EAGER_ROW, row(slot, schedule="blocks")], {EAGER: 0.30, "attn, slot": 0.30}, seconds=0.1)
    assert result.stopped == {"blocks": "out of time"}
    assert len({record.round for record in result.results["blocks"].blocks}) == 4
    assert {r.label: r for r in result.rows}["attn, slot"].measured.ratio is not None


def test_every_step_is_timed_before_the_first_is_profiled():
    """The profiler slows the eager steps timed after it more than graphed ones: no schedule is timed after
    any arm was profiled (without the order, the step schedule's profiling precedes the blocks)."""
    slot = GraphSetup(graphed=True, modules=("attn",), slot=True)
    rows = [EAGER_ROW, row(ATTN), row(slot, schedule="blocks")]
    clock = Clock()
    trainer = FakeTrainer(clock, {EAGER: 0.30, "attn": 0.20, "attn, slot": 0.25})
    profiled: list[str] = []
    timed_after_profiling = []
    step = trainer.step

    def watched_step() -> None:
        if profiled and not profiling:
            timed_after_profiling.append(trainer.arm)
        step()

    trainer.step = watched_step
    profiling = False

    def profile(run, count, arm):
        nonlocal profiling
        profiling = True
        for _ in range(count):
            run()
        profiling = False
        profiled.append(arm)
        return DeviceTime(0.1)

    result = time_setups(
        rows,
        trainer,
        options=TimingOptions(seconds=1000.0, max_cycles=80, max_pairs=8, block_steps=4),
        budget_bytes=None,
        device_bytes=None,
        clock=clock,
        progress=lambda _: None,
        profile=profile,
    )
    assert set(result.results) == {"steps", "blocks"} and timed_after_profiling == []
    assert sorted(profiled) == sorted([EAGER, "attn", EAGER, "attn, slot"])  # each schedule's arms, eager in both
    assert all(r.measured.busy_fraction is not None for r in result.rows if r.measured is not None)


def test_the_default_budget_comes_from_eagers_measured_peak_and_drops_what_exceeds_it():
    rows = [EAGER_ROW, row(ATTN, predicted=100 * MIB), row(MLP, predicted=3 * 2**30)]
    result, trainer, lines = timed(rows, {EAGER: 0.3, "attn": 0.2}, device=4 * 2**30)
    assert result.eager_peak_bytes == 1 << 30 and result.budget_bytes == ranking.default_budget(4 * 2**30, 1 << 30)
    found = {r.label: r for r in result.rows}
    assert found["attn mlp"].over_budget.startswith("over budget: predicted 3072 MiB >")
    assert "capture attn mlp" not in trainer.events


def test_each_arm_is_profiled_with_its_graphs_in_place_for_the_gpu_busy_fraction():
    in_place: list[str] = []

    def profile(step, steps, arm):
        in_place.append(arm)
        return DeviceTime(busy_seconds=0.1)

    rows = [EAGER_ROW, row(ATTN)]
    result, _, _ = timed(rows, {EAGER: 0.30, "attn": 0.20}, profile=profile)
    assert in_place == [EAGER, "attn"]
    found = {r.label: r for r in result.rows}
    assert found["attn"].measured.busy_fraction == pytest.approx(0.1 / found["attn"].measured.step_seconds)


def test_the_train_iters_cover_every_step_the_timing_can_take():
    options = TimingOptions(seconds=1.0, max_cycles=10, max_pairs=2, block_steps=5)
    assert steps_needed(options, 3) >= options.warmup_steps + options.peak_steps + 2 * 10 * 4 + 2 * 2 * 4 * 5


def test_the_bench_step_loop_stops_when_asked_at_a_kept_even_cycle():
    clock = Clock()
    trainer = FakeTrainer(clock, {EAGER: 0.3, "attn": 0.2})
    trainer.alive.add("attn")
    asked: list[int] = []

    def stop(steps: list[StepRecord]) -> str | None:
        asked.append(len(steps))
        return "enough" if len(asked) == 2 else None

    lines: list[str] = []
    steps, peaks = bench_command.run_step_cycles(
        bench_command.StepCycles((EAGER, "attn"), 40, 2), trainer, clock, lines.append, stop=stop
    )
    assert asked == [8 * 4, 10 * 4]  # 6 and 8 kept cycles, 4 steps a cycle
    assert len(steps) == 40 and lines[-1] == "enough: the cycles stop after 10 of 40"


# -- the Megatron-side trainer's scope switch ----------------------------------------------------


def test_the_tune_trainer_sets_every_config_and_dispatcher_to_the_arms_scope():
    from megatron.core.transformer.enums import CudaGraphModule

    from megatron_cg_plugin.tune.trainer import TuneTrainer

    trainer = TuneTrainer.__new__(TuneTrainer)  # its Megatron half needs a built model: only the switch here
    configs = [types.SimpleNamespace(cuda_graph_modules=[CudaGraphModule.attn]) for _ in range(2)]
    dispatcher = types.SimpleNamespace(cuda_dtoh_point="before_permutation_1")
    trainer._configs, trainer._dispatchers = configs, [dispatcher]
    trainer._built = [foreign_state.save(config, "cuda_graph_modules", change="tune-scope") for config in configs]
    moe = GraphSetup(graphed=True, modules=("attn", "moe_router", "moe_preprocess"))
    trainer.setups = {moe.label: (moe, PluginConfig())}
    trainer._scope(moe.label)
    expected = [CudaGraphModule.attn, CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess]
    assert all(config.cuda_graph_modules == expected for config in configs)
    assert dispatcher.cuda_dtoh_point == "before_ep_alltoall"
    trainer._scope(EAGER)
    assert all(config.cuda_graph_modules == [CudaGraphModule.attn] for config in configs)
    assert dispatcher.cuda_dtoh_point == "before_permutation_1"


# -- the command ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, expected, refused",
    [
        (
            "tiny-gpt",
            ["attn", "attn mlp", "attn, slot"],
            {"whole layer": "not timed: the same graphs as attn mlp on layers without MoE"},
        ),
        (
            "tiny-moe",
            ["attn", "attn moe_router moe_preprocess", "attn, slot"],
            {
                "whole layer": "refused [whole-layer-moe-needs-drop-and-pad]",
                "attn moe_router moe_preprocess, slot": "refused [slot-capture-scope]",
            },
        ),
    ],
)
def test_the_dry_run_on_a_preset_prints_the_table_with_refusals_and_predictions(
    capsys, tmp_path, preset, expected, refused
):
    code = cli.main(["tune", "--tune-dry-run", "--tune-out", str(tmp_path), "--cg-preset", preset])
    out, err = capsys.readouterr()
    assert code == console.EXIT_OK, err
    assert "| setup | predicted graph MiB |" in out and "dry run: nothing timed" in out
    table = {
        line.split(" | ")[0].strip("| ").removesuffix(" (yours)"): line
        for line in out.splitlines()
        if line.startswith("| ")
    }
    for label in expected:
        assert "to time" in table[label], table[label]
        assert table[label].split(" | ")[1].isdigit()  # its predicted graph MiB
    for label, verdict in refused.items():
        assert f"| {verdict}" in table[label], table[label]
    data = json.loads((tmp_path / "tune.json").read_text())
    assert {entry["setup"] for entry in data["setups"]} == set(table) - {"setup", "---"}
    assert not list(tmp_path.glob("*.png"))  # nothing timed, nothing plotted


def test_the_dry_run_drops_setups_over_the_given_budget(capsys):
    code = cli.main(["tune", "--tune-dry-run", "--tune-memory-gib", "0.008", "--cg-preset", "tiny-gpt"])
    out = capsys.readouterr().out
    assert code == console.EXIT_OK
    over = [line for line in out.splitlines() if "over budget: predicted" in line]
    assert over and all("> 8 MiB (--tune-memory-gib)" in line for line in over)
    assert "| attn | 6 |" in out and "to time (step schedule)" in out


def test_a_tune_with_nothing_left_to_time_still_writes_its_table_under_the_given_budget(capsys, monkeypatch, tmp_path):
    from megatron_cg_plugin.tune import candidates
    from megatron_cg_plugin.tune import command as tune_command

    monkeypatch.setattr(tune_command, "gpu_stack_missing", lambda _count: "")  # as on a GPU host
    monkeypatch.setattr(tune_command, "placement", lambda *_: candidates.Placement(None, "built otherwise"))
    argv = [
        "tune",
        "--tune-no-plot",
        "--tune-memory-gib",
        "0.008",
        "--tune-out",
        str(tmp_path),
        "--cg-preset",
        "tiny-gpt",
    ]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == console.EXIT_OK and "no graphed setup is left to time" in out
    data = json.loads((tmp_path / "tune.json").read_text())
    assert data["budget_bytes"] == int(0.008 * 2**30) and data["dry_run"] is False
    verdicts = [entry["verdict"] for entry in data["setups"]]
    assert any(verdict.startswith("over budget: predicted") for verdict in verdicts)
    assert "no graphed setup is left to time" in (tmp_path / "tune.md").read_text()


def test_flags_without_a_run_length_are_checked_with_the_timings_own(capsys):
    """As the bench does, the tune sets --train-iters to what its timing takes: flags that give no length
    (a bench's, a script's) pass the optimizer's check and are listed."""
    preset = list(PRESET_FLAGS["tiny-gpt"])
    del preset[preset.index("--train-iters") : preset.index("--train-iters") + 2]
    code = cli.main(["tune", "--tune-dry-run", *preset])
    out, err = capsys.readouterr()
    assert code == console.EXIT_OK, err
    assert "optimizer-setup" not in out + err and "| attn |" in out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--tune-seconds", "0"], "--tune-seconds 0"),
        (["--tune-seconds", "inf"], "--tune-seconds inf"),
        (["--tune-memory-gib", "-1"], "--tune-memory-gib -1"),
        (["--tune-memory-gib", "lots"], "--tune-memory-gib 'lots': give a number"),
        (["--tune-secs", "5"], "unknown tune flag --tune-secs (did you mean --tune-seconds?)"),
        (["--cg-preset", "tiny-gtp"], "--cg-preset 'tiny-gtp' is unknown"),
        (["missing.py", "--num-layers", "2"], "the training script missing.py does not exist"),
        (["--cg-preset", "tiny-gpt", "--num-attention-heads", "0"], "--num-attention-heads 0"),
    ],
)
def test_bad_input_exits_2_naming_the_flag_before_the_host_is_asked_for_a_gpu(capsys, monkeypatch, argv, named):
    monkeypatch.setattr("megatron_cg_plugin.farm.distributed.gpus_available", lambda: 0)
    code = cli.main(["tune", *argv])
    out, err = capsys.readouterr()
    assert code == console.EXIT_BAD_INPUT, (out, err)
    assert named in err and "Traceback" not in err + out
    assert "GPU" not in err and "matplotlib" not in err


def test_timing_on_a_host_without_a_gpu_says_what_needs_one(capsys, monkeypatch):
    monkeypatch.setattr("megatron_cg_plugin.farm.distributed.gpus_available", lambda: 0)
    code = cli.main(["tune", "--cg-preset", "tiny-gpt"])
    err = capsys.readouterr().err
    assert code == console.EXIT_BAD_INPUT
    assert "megatron-cg tune times the setups on a GPU" in err and "needs 1 CUDA GPU(s), found 0" in err
    assert "--tune-dry-run" in err


def test_help_names_the_tune_flags(capsys):
    assert cli.main(["tune", "--help"]) == console.EXIT_OK
    out = capsys.readouterr().out
    for flag in ("--tune-memory-gib", "--tune-seconds", "--tune-out", "--tune-dry-run", "--tune-no-plot"):
        assert flag in out
