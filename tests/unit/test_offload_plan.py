"""The in-graph offload plan (issue 14's policy, alias rule, reload groups and host arena keying),
on warmup records made by hand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_cg_plugin.plan.offload import (
    MEGATRON_OFFLOAD_MODULES, OffloadPolicy, Save, host_arena_bytes, plan_offload,
)
from megatron_cg_plugin.plan.slots import arena_aligned, plan_slots

BIG = 1 << 20  # elements: Megatron's default --min-offloaded-tensor-size


def save(storage, group, numel=BIG, nbytes=None, **kw):
    return Save(storage, nbytes or 2 * numel, numel, group, **kw)


POLICY = OffloadPolicy.from_flags(["core_attn", "expert_fc1"])


def test_a_save_qualifies_as_megatrons_would():
    assert POLICY.qualifies(save("q", "core_attn"))
    assert not POLICY.qualifies(save("q", "attn_norm"))  # group not listed
    assert not POLICY.qualifies(save("q", None))  # outside every group
    assert not POLICY.qualifies(save("q", "core_attn", numel=BIG - 1))  # below the minimum size
    assert not POLICY.qualifies(save("q", "core_attn", do_not_offload=True))


def test_a_storage_any_view_of_which_stays_keeps_every_view_on_the_gpu():
    plan = plan_offload([save("qkv", "core_attn"), save("qkv", "attn_norm"),  # one view outside the policy
                         save("out", "core_attn"), save("out", "core_attn", numel=BIG // 2, nbytes=2 * BIG),
                         save("fc1", "expert_fc1")], POLICY)
    assert plan.kept == ("qkv", "out")  # the small view of "out" keeps its whole storage on the GPU
    assert plan.offloaded == {"fc1"}
    assert plan.host_bytes == arena_aligned(2 * BIG) and plan.device_bytes == 2 * arena_aligned(2 * BIG)


def test_groups_reload_in_backward_order_within_the_window():
    plan = plan_offload([save("a", "core_attn"), save("b", "expert_fc1"), save("c", "core_attn")], POLICY)
    assert plan.groups == (("core_attn", ("a", "c")), ("expert_fc1", ("b",)))
    assert plan.reload_order() == ("expert_fc1", "core_attn")
    assert plan.reload_window("expert_fc1", 1) == ("expert_fc1", "core_attn")
    assert plan.reload_window("core_attn", 1) == ("core_attn",)
    assert plan.reload_window("expert_fc1", 0) == ("expert_fc1",)
    assert plan.reload_window(None, 0) == ("expert_fc1",)  # the backward's start: the first group it needs
    assert plan.reload_window(None, 5) == ("expert_fc1", "core_attn")


def test_the_offload_fraction_keeps_the_latest_groups_on_the_gpu():
    policy = OffloadPolicy.from_flags(["core_attn", "expert_fc1", "moe_act"], fraction=0.5)
    plan = plan_offload([save("a", "core_attn"), save("b", "expert_fc1"), save("c", "moe_act")], policy)
    assert [group for group, _ in plan.groups] == ["core_attn", "expert_fc1"]  # int(3 * 0.5) = 1 group kept
    assert plan.kept == ("c",)


def test_host_arenas_are_keyed_by_slot_and_sized_by_its_largest_variant():
    slot_plan = plan_slots([1, 1, -1, 1, -1, -1], ["big", "small", "small2"])  # big, small2 share slot 0
    plans = {"big": plan_offload([save("x", "core_attn", nbytes=10_000)], POLICY),
             "small": plan_offload([save("y", "core_attn", nbytes=300)], POLICY),
             "small2": plan_offload([save("z", "attn_norm", nbytes=99_999)], POLICY)}  # nothing offloaded
    slots_of = {v: tuple(sorted({f.slot for f in slot_plan.frames if f.variant == v})) for v in plans}
    assert host_arena_bytes(slot_plan.ring_size, slots_of, plans) == [arena_aligned(10_000), arena_aligned(300)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(offload_modules=["core_attn", "mlp"]), "--offload-modules mlp: Megatron offloads only"),
    (dict(offload_modules=["core_attn"], fraction=1.5), r"--activation-offload-fraction in \[0, 1\]"),
    (dict(offload_modules=["core_attn"], min_tensor_elements=-1), "--min-offloaded-tensor-size must be >= 0"),
])
def test_bad_offload_flags_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadPolicy.from_flags(kwargs.pop("offload_modules"), **kwargs)


saves = st.lists(st.builds(save, st.sampled_from("abcdef"), st.sampled_from(sorted(MEGATRON_OFFLOAD_MODULES) + [None]),
                           numel=st.sampled_from([BIG // 2, BIG, 2 * BIG])), max_size=30)
modules = st.sets(st.sampled_from(sorted(MEGATRON_OFFLOAD_MODULES)))


@given(saves, modules)
def test_every_storage_is_either_offloaded_whole_or_kept_whole(records, chosen):
    policy = OffloadPolicy.from_flags(sorted(chosen))
    plan = plan_offload(records, policy)
    storages = {r.storage for r in records}
    assert plan.offloaded | set(plan.kept) == storages and not plan.offloaded & set(plan.kept)
    for storage in plan.offloaded:  # offloaded: every one of its views qualified
        assert all(policy.qualifies(r) for r in records if r.storage == storage)
    for storage in plan.kept:  # kept: one view did not (fraction 1.0 disables no group)
        assert not all(policy.qualifies(r) for r in records if r.storage == storage)
    assert sorted(plan.reload_order()) == sorted(group for group, _ in plan.groups)


def test_the_policy_comes_from_megatrons_own_flags():
    import types

    args = types.SimpleNamespace(fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj"],
                                 min_offloaded_tensor_size=4096, activation_offload_fraction=0.5)
    policy = OffloadPolicy.from_args(args)
    assert (policy.modules, policy.min_tensor_elements, policy.fraction) == (frozenset({"core_attn", "attn_proj"}), 4096, 0.5)
    assert OffloadPolicy.from_args(types.SimpleNamespace(fine_grained_activation_offloading=False,
                                                         offload_modules=["core_attn"])) is None
    assert OffloadPolicy.from_args(types.SimpleNamespace(fine_grained_activation_offloading=True,
                                                         offload_modules=[])) is None
    with pytest.raises(ValueError, match="--offload-modules mlp: Megatron offloads only"):
        OffloadPolicy.from_args(types.SimpleNamespace(fine_grained_activation_offloading=True, offload_modules=["mlp"]))


def test_a_storage_saved_in_two_groups_reloads_with_the_later_one():
    # The backward reaches the later group first: reloading with the earlier one would block it.
    policy = OffloadPolicy.from_flags(["attn_norm", "core_attn"])
    plan = plan_offload([save("x", "attn_norm"), save("y", "attn_norm"), save("x", "core_attn")], policy)
    assert plan.groups == (("attn_norm", ("y",)), ("core_attn", ("x",)))
    assert plan.reload_order() == ("core_attn", "attn_norm")
