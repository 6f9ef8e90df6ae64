"""Tests for megatron_cg_plugin.setups.memory_guard (the guard's pure decision: does the predicted
capture fit what is free, and which other setups would) and for the readings of free memory in
megatron_cg_plugin.capture.accounting. The guard in the capture lifecycle is tested in test_helper.py;
the setups it filters, in test_setups.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin import rules
from megatron_cg_plugin.capture import accounting
from megatron_cg_plugin.config import PluginConfig
from megatron_cg_plugin.planner.graph_memory import GraphMemoryPlan, plan_for_run
from megatron_cg_plugin.settings import RunSettings
from megatron_cg_plugin.setups.graph_setups import GraphSetup, enumerate_setups
from megatron_cg_plugin.setups.memory_guard import (
    CLOSE_HEADROOM_BYTES,
    GIB,
    CaptureNeed,
    Fit,
    FreeMemory,
    alternative_setups,
    check_capture_memory,
    device_parts,
    fitting_setups,
    gib,
    judge,
)

DEFAULTS = PluginConfig()


def dense(**changes) -> RunSettings:
    """A dense GPT the rules accept, graphed whole by TE (16 x 1024, 2 x 2048 tokens, RoPE)."""
    base = dict(
        cuda_graph_impl="transformer_engine",
        num_layers=4,
        hidden_size=1024,
        ffn_hidden_size=4096,
        num_attention_heads=16,
        seq_length=2048,
        max_position_embeddings=2048,
        micro_batch_size=2,
        position_embedding_type="rope",
    )
    return RunSettings(**(base | changes))


def moe(**changes) -> RunSettings:
    """Its MoE sibling: 8 drop-and-pad experts on every layer, alltoall."""
    return dense(
        num_experts=8,
        moe_ffn_hidden_size=1024,
        dispatcher="alltoall",
        capacity_factor=1.0,
        pad_to_capacity=True,
        **changes,
    )


def need_of(settings: RunSettings, config: PluginConfig = DEFAULTS) -> CaptureNeed:
    return CaptureNeed.of(plan_for_run(settings, config=config))


# ====================================================================== judge


def test_judge_fits_close_and_does_not_fit_on_the_gpu():
    need = CaptureNeed(graph_pool=8 * GIB)
    assert judge(need, FreeMemory(device=20 * GIB)) is Fit.FITS
    assert judge(need, FreeMemory(device=int(8.5 * GIB))) is Fit.CLOSE  # within 10%
    assert judge(CaptureNeed(graph_pool=2 * GIB), FreeMemory(device=int(2.9 * GIB))) is Fit.CLOSE  # < 1 GiB left
    assert judge(CaptureNeed(graph_pool=2 * GIB), FreeMemory(device=int(3.1 * GIB))) is Fit.FITS
    assert judge(need, FreeMemory(device=8 * GIB)) is Fit.CLOSE  # exactly full still fits
    assert judge(need, FreeMemory(device=8 * GIB - 1)) is Fit.DOES_NOT_FIT


def test_every_gpu_part_counts():
    need = CaptureNeed(graph_pool=GIB, gpu_arenas=GIB, static_buffers=GIB, pinned_host=100 * GIB)
    assert need.device_bytes == 3 * GIB
    assert judge(need, FreeMemory(device=3 * GIB - 1)) is Fit.DOES_NOT_FIT  # the host is not known: unchecked
    assert device_parts(need) == "graph pool 1.00 GiB, GPU arenas 1.00 GiB, static buffers 1.00 GiB"
    assert device_parts(CaptureNeed(graph_pool=0)) == "graph pool 0.00 GiB"


def test_pinned_arenas_count_once_per_rank_of_the_host():
    need = CaptureNeed(graph_pool=GIB, pinned_host=4 * GIB)
    assert judge(need, FreeMemory(device=100 * GIB, host=40 * GIB, host_ranks=1)) is Fit.FITS
    assert judge(need, FreeMemory(device=100 * GIB, host=40 * GIB, host_ranks=8)) is Fit.FITS  # 32 of 40 GiB
    assert judge(need, FreeMemory(device=100 * GIB, host=35 * GIB, host_ranks=8)) is Fit.CLOSE  # 32 of 35 GiB
    assert judge(need, FreeMemory(device=100 * GIB, host=31 * GIB, host_ranks=8)) is Fit.DOES_NOT_FIT
    assert judge(need, FreeMemory(device=100 * GIB, host=None, host_ranks=8)) is Fit.FITS  # not known: unchecked


def test_nothing_to_reserve_always_fits_and_unknown_free_memory_is_not_checked():
    assert judge(CaptureNeed(graph_pool=0), FreeMemory(device=0, host=0)) is Fit.FITS
    assert judge(CaptureNeed(graph_pool=10**15), FreeMemory(device=None)) is Fit.FITS


_bytes = st.integers(min_value=0, max_value=1 << 42)
_needs = st.builds(CaptureNeed, graph_pool=_bytes, gpu_arenas=_bytes, static_buffers=_bytes, pinned_host=_bytes)
_frees = st.builds(
    FreeMemory,
    device=st.one_of(st.none(), _bytes),
    host=st.one_of(st.none(), _bytes),
    host_ranks=st.integers(min_value=1, max_value=16),
)


@settings(max_examples=400, deadline=None)
@given(_needs, _frees, _bytes, _bytes)
def test_more_free_memory_never_makes_the_verdict_worse(need, free, more_device, more_host):
    richer = dataclasses.replace(
        free,
        device=None if free.device is None else free.device + more_device,
        host=None if free.host is None else free.host + more_host,
    )
    assert judge(need, richer) <= judge(need, free)


@settings(max_examples=400, deadline=None)
@given(_needs, _frees, _bytes, _bytes)
def test_a_larger_capture_never_makes_the_verdict_better(need, free, more_pool, more_host):
    larger = dataclasses.replace(need, graph_pool=need.graph_pool + more_pool, pinned_host=need.pinned_host + more_host)
    assert judge(larger, free) >= judge(need, free)


@settings(max_examples=400, deadline=None)
@given(_needs, _frees)
def test_the_verdict_follows_the_bytes(need, free):
    """Does not fit exactly where a known free amount is below what it must hold; close only where it fits
    with less than 10% or 1 GiB to spare."""
    checks = [(need.device_bytes, free.device), (need.pinned_host * free.host_ranks, free.host)]
    checked = [(n, f) for n, f in checks if f is not None and n > 0]
    verdict = judge(need, free)
    assert (verdict is Fit.DOES_NOT_FIT) == any(n > f for n, f in checked)
    if verdict is Fit.CLOSE:
        assert any(n > 0.9 * f or f - n < CLOSE_HEADROOM_BYTES for n, f in checked)
    if verdict is Fit.FITS:
        assert all(n <= 0.9 * f and f - n >= CLOSE_HEADROOM_BYTES for n, f in checked)


def test_the_need_comes_from_the_plans_parts():
    plan = GraphMemoryPlan(
        pool_bytes=5,
        peak_live_bytes=4,
        graphs=1,
        arena_bytes=7,
        boundary_bytes=11,
        host_arena_bytes=13,
        thd_buffer_bytes=17,
    )
    assert CaptureNeed.of(plan) == CaptureNeed(graph_pool=5, gpu_arenas=7, static_buffers=28, pinned_host=13)
    assert CaptureNeed.of(GraphMemoryPlan(pool_bytes=5, peak_live_bytes=4, graphs=1)) == CaptureNeed(graph_pool=5)


def test_gib_has_two_decimals():
    assert gib(0) == "0.00 GiB" and gib(GIB + GIB // 50) == "1.02 GiB" and gib(123 * GIB) == "123.00 GiB"


def test_a_negative_reading_is_an_invariant_broken():
    with pytest.raises(AssertionError):
        FreeMemory(device=-1)
    with pytest.raises(AssertionError):
        FreeMemory(device=1, host_ranks=0)


# ====================================================================== alternative setups


def test_a_dense_whole_layer_run_gets_slot_capture_offload_and_the_other_scopes_most_graphed_first():
    setups = alternative_setups(dense(), DEFAULTS)
    offload = "--fine-grained-activation-offloading --offload-modules core_attn attn_proj"
    assert [setup.command_line for setup in setups] == [
        "--cg-slot-capture",
        f"--cg-slot-capture {offload}",
        "--cuda-graph-modules attn mlp",
        "--cuda-graph-modules attn mlp --cg-slot-capture",
        f"--cuda-graph-modules attn mlp --cg-slot-capture {offload}",
        "--cuda-graph-modules attn",
        "--cuda-graph-modules attn --cg-slot-capture",
        f"--cuda-graph-modules attn --cg-slot-capture {offload}",
    ]
    offloading = [setup for setup in setups if setup.settings.activation_offloading]
    assert offloading and all(setup.environment == ("NVTE_CPU_OFFLOAD_V1=1",) for setup in offloading)
    assert all(setup.environment == () for setup in setups if not setup.settings.activation_offloading)


@pytest.mark.parametrize("run", [dense(), moe(), dense(modules=("attn",), slot_capture=True)], ids=str)
def test_each_setup_is_the_planners_prediction_of_flags_the_rules_accept(run):
    setups = alternative_setups(run, DEFAULTS)
    assert setups
    for setup in setups:
        assert rules.violations(setup.settings) == []
        assert setup.config.slot_capture == setup.settings.slot_capture
        assert setup.need == need_of(setup.settings, setup.config)
        assert setup.settings != run and setup.graph != GraphSetup.of(run)  # never the run itself
    # the filter of the one enumeration: every other setup the rules pass, none they refuse
    every = enumerate_setups(run, DEFAULTS)
    assert set(setups) == {setup for setup in every if not setup.refused and setup.graph != GraphSetup.of(run)}


def test_a_slot_capture_run_is_offered_tes_graphs_where_they_take_less():
    # Slot capture's arenas and static buffers can take more of the GPU than TE's pool of the same scope.
    run = dense(modules=("attn",), slot_capture=True)
    by_flags = {setup.command_line: setup for setup in alternative_setups(run, DEFAULTS)}
    te = by_flags["without --cg-slot-capture"]
    assert not te.settings.slot_capture and te.settings.modules == ("attn",)
    assert te.need.device_bytes < need_of(run, dataclasses.replace(DEFAULTS, slot_capture=True)).device_bytes
    assert by_flags["without --cuda-graph-modules"].settings.modules == ()  # the whole layer, slot-shared


def test_offload_moves_attentions_saves_to_the_host():
    by_flags = {setup.command_line: setup.need for setup in alternative_setups(dense(), DEFAULTS)}
    slot = by_flags["--cuda-graph-modules attn --cg-slot-capture"]
    offloaded = by_flags[
        "--cuda-graph-modules attn --cg-slot-capture --fine-grained-activation-offloading --offload-modules "
        "core_attn attn_proj"
    ]
    assert offloaded.pinned_host > 0 and slot.pinned_host == 0
    assert offloaded.gpu_arenas == slot.gpu_arenas - offloaded.pinned_host


def test_an_moe_run_narrows_to_the_moe_block_the_router_and_preprocess_and_attention():
    commands = [setup.command_line for setup in alternative_setups(moe(), DEFAULTS)]
    assert commands[:2] == [
        "--cg-slot-capture",
        "--cg-slot-capture --fine-grained-activation-offloading --offload-modules core_attn attn_proj",
    ]  # the run's own scope first
    scopes = [command.split(" --")[0] for command in commands[2:]]
    assert list(dict.fromkeys(scopes)) == [
        "--cuda-graph-modules attn moe",
        "--cuda-graph-modules attn moe_router moe_preprocess",
        "--cuda-graph-modules attn",
    ]  # then the others, most graphed first
    assert not any("mlp" in command for command in commands)
    # Slot capture refuses partial MoE scopes (rule slot-capture-partial-moe): not offered there.
    assert "--cuda-graph-modules attn moe_router moe_preprocess --cg-slot-capture" not in commands


def test_the_moe_scope_is_never_offered_with_offload():
    # Megatron's TransformerConfig refuses fine-grained offload with --cuda-graph-modules ... moe
    # (rule offload-moe-scope).
    run = moe(modules=("attn", "moe"))
    setups = alternative_setups(run, DEFAULTS)
    assert "--cg-slot-capture" in [setup.command_line for setup in setups]
    assert any(setup.settings.activation_offloading for setup in setups)  # other scopes offload
    assert not any(setup.settings.activation_offloading and "moe" in setup.settings.modules for setup in setups)
    offloading = moe(modules=("attn",), slot_capture=True, activation_offloading=True, offload_modules=("core_attn",))
    assert rules.violations(offloading) == []
    moe_block = [setup for setup in alternative_setups(offloading, DEFAULTS) if "moe" in setup.settings.modules]
    assert moe_block and not any(setup.settings.activation_offloading for setup in moe_block)  # only without it


def test_setups_the_rules_refuse_are_left_out():
    # Slot capture needs PP = 1 (rule slot-capture-pipeline); offload needs RoPE (offload-learned-positions).
    pipelined = dense(pipeline_parallel=2, world_size=2)
    assert rules.violations(pipelined) == []
    assert [setup.command_line for setup in alternative_setups(pipelined, DEFAULTS)] == [
        "--cuda-graph-modules attn mlp",
        "--cuda-graph-modules attn",
    ]
    learned = dense(position_embedding_type="learned_absolute")
    assert not any(setup.settings.activation_offloading for setup in alternative_setups(learned, DEFAULTS))
    assert any(setup.settings.slot_capture for setup in alternative_setups(learned, DEFAULTS))


def test_a_run_that_offloads_already_keeps_its_modules_and_needs_no_environment_note():
    run = dense(modules=("attn",), slot_capture=True, activation_offloading=True, offload_modules=("qkv_linear",))
    setups = alternative_setups(run, DEFAULTS)
    offloading = [setup for setup in setups if setup.graph.attention_offload]
    assert offloading
    for setup in offloading:
        assert setup.settings.offload_modules == ("qkv_linear", "core_attn", "attn_proj")
        assert "--fine-grained-activation-offloading" not in setup.command_line and setup.environment == ()
    without = [setup for setup in setups if not setup.settings.activation_offloading]
    assert without and all(
        setup.command_line.endswith("--fine-grained-activation-offloading --offload-modules") for setup in without
    )


def test_no_setups_without_te_graphs_or_with_graph_banks():
    assert alternative_setups(dense(cuda_graph_impl="none"), DEFAULTS) == ()
    assert alternative_setups(dense(graph_banks=True), DEFAULTS) == ()


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=4 * GIB), st.integers(min_value=0, max_value=4 * GIB))
def test_fitting_setups_are_those_that_fit_and_grow_with_the_free_memory(device, more):
    run = dense()
    fitting = fitting_setups(run, DEFAULTS, FreeMemory(device=device))
    assert all(judge(setup.need, FreeMemory(device=device)) < Fit.DOES_NOT_FIT for setup in fitting)
    richer = fitting_setups(run, DEFAULTS, FreeMemory(device=device + more))
    assert set(fitting) <= set(richer)
    everything = alternative_setups(run, DEFAULTS)
    left_out = [setup for setup in everything if setup not in fitting]
    assert all(judge(setup.need, FreeMemory(device=device)) is Fit.DOES_NOT_FIT for setup in left_out)
    assert [setup for setup in everything if setup in fitting] == list(fitting)  # in the same order


# ====================================================================== the verdict and its message


def test_a_capture_that_does_not_fit_names_the_bytes_the_parts_and_the_setups_that_fit():
    run = dense(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, micro_batch_size=4)
    plan = plan_for_run(run, config=DEFAULTS)
    attn = need_of(dataclasses.replace(run, modules=("attn",)))
    free = FreeMemory(device=attn.device_bytes + 2 * GIB)  # TE's attn graphs fit with room
    assert judge(CaptureNeed.of(plan), free) is Fit.DOES_NOT_FIT
    verdict = check_capture_memory(plan, free, settings=run, config=DEFAULTS)
    assert verdict.fit is Fit.DOES_NOT_FIT and verdict.setups == fitting_setups(run, DEFAULTS, free)
    text = verdict.message("CUDA graph capture (layer)")
    lines = text.splitlines()
    assert lines[0] == (
        "CUDA graph capture (layer) would not fit in memory, so nothing was captured: the planner predicts "
        f"{gib(plan.pool_bytes)} on the GPU (graph pool {gib(plan.pool_bytes)}) against "
        f"{gib(free.device)} free (torch.cuda.mem_get_info)."
    )
    assert f"  --cuda-graph-modules attn  ({gib(attn.device_bytes)} on the GPU)" in lines
    assert all(f"  {setup.command_line}  (" in text for setup in verdict.setups)
    assert "--cuda-graph-impl none" not in text


def test_when_nothing_fits_the_message_says_eager():
    run = dense()
    plan = plan_for_run(run, config=DEFAULTS)
    free = FreeMemory(device=1024, device_source="--cg-memory-budget-gib 1e-06")
    verdict = check_capture_memory(plan, free, settings=run, config=DEFAULTS)
    assert verdict.setups == ()
    text = verdict.message("CUDA graph capture (layer)")
    assert "against 0.00 GiB free (--cg-memory-budget-gib 1e-06)" in text
    assert "train eagerly with --cuda-graph-impl none" in text


def test_host_shortfall_is_said_with_the_ranks_of_the_host():
    run = dense(modules=("attn",), slot_capture=True, activation_offloading=True, offload_modules=IN_GRAPH)
    plan = plan_for_run(run, config=DEFAULTS)
    need = CaptureNeed.of(plan)
    assert need.pinned_host > 0
    free = FreeMemory(device=100 * GIB, host=need.pinned_host * 3, host_ranks=4)
    verdict = check_capture_memory(plan, free, settings=run, config=DEFAULTS)
    assert verdict.fit is Fit.DOES_NOT_FIT
    text = verdict.message("CUDA graph capture (attn (slot-shared))")
    assert f"pinned host arenas {gib(need.pinned_host)} x 4 ranks on this host = {gib(4 * need.pinned_host)}" in text
    assert f"against {gib(3 * need.pinned_host)} available" in text
    # The GPU has room: what fits pins no more than the host has, the run's scope without its offload first.
    assert all(judge(setup.need, free) < Fit.DOES_NOT_FIT for setup in verdict.setups)
    assert "  without --cg-slot-capture  (" in text  # TE's graphs keep Megatron's offload out of pinned arenas
    assert "  without --fine-grained-activation-offloading --offload-modules  (" in text


IN_GRAPH = ("core_attn", "attn_proj")


def test_a_capture_close_to_the_limit_is_one_line_and_looks_for_no_setups():
    run = dense()
    plan = plan_for_run(run, config=DEFAULTS)
    free = FreeMemory(device=plan.pool_bytes + GIB // 2)
    verdict = check_capture_memory(plan, free, settings=run, config=DEFAULTS)
    assert verdict.fit is Fit.CLOSE and verdict.setups == ()
    text = verdict.message("CUDA graph capture (layer)")
    assert "\n" not in text and "close to the memory limit" in text and "capture goes ahead" in text


def test_what_the_prediction_leaves_out_is_in_the_message():
    run = dense(tensor_parallel=2, world_size=2)
    plan = plan_for_run(run, config=DEFAULTS)
    assert plan.unpredicted
    verdict = check_capture_memory(plan, FreeMemory(device=0), settings=run, config=DEFAULTS)
    assert f"The prediction leaves out: {'; '.join(plan.unpredicted)}." in verdict.message("capture")


# ====================================================================== reading free memory


def test_meminfo_available_is_read_in_bytes():
    meminfo = "MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    8192000 kB\n"
    assert accounting.meminfo_available_bytes(meminfo) == 8192000 * 1024
    assert accounting.meminfo_available_bytes("MemTotal: 5 kB\n") is None


def test_host_memory_falls_back_to_the_free_pages(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    2048 kB\n")
    assert accounting.host_available_bytes(str(meminfo)) == 2048 * 1024  # no CUDA: no cached pinned blocks
    pages = {"SC_AVPHYS_PAGES": 10, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(accounting.os, "sysconf", pages.__getitem__)
    assert accounting.host_available_bytes(str(tmp_path / "missing")) == 40960


def test_cached_free_pinned_blocks_count_as_available(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    1 kB\n")
    stats = {"allocated_bytes": {"current": 5000}, "active_bytes": {"current": 1000}}  # 4000 held, handed out to none
    monkeypatch.setattr(torch.cuda, "host_memory_stats_as_nested_dict", lambda: stats)
    assert accounting.host_available_bytes(str(meminfo)) == 1024 + 4000


@pytest.mark.parametrize("value, ranks", [("8", 8), ("1", 1), ("", 1), ("0", 1), ("-2", 1), ("x", 1)])
def test_ranks_on_this_host(value, ranks):
    assert accounting.ranks_on_this_host({"LOCAL_WORLD_SIZE": value}) == ranks
    assert accounting.ranks_on_this_host({}) == 1


def test_without_cuda_the_gpu_is_not_read():
    assert accounting.device_free_bytes() is None
