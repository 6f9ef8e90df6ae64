"""The in-graph offload plan (its policy, alias rule, reload groups and host arena keying),
on warmup records made by hand."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_cg_plugin.slot_sharing.offload_plan import (
    MEGATRON_OFFLOAD_MODULES,
    OffloadPolicy,
    OffloadStack,
    OffloadStackError,
    Save,
    StackPosition,
    groups_kept,
    host_arena_bytes,
    plan_offload,
)
from megatron_cg_plugin.slot_sharing.plan import arena_aligned, plan_slots

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
    plan = plan_offload(
        [
            save("qkv", "core_attn"),
            save("qkv", "attn_norm"),  # one view outside the policy
            save("out", "core_attn"),
            save("out", "core_attn", numel=BIG // 2, nbytes=2 * BIG),
            save("fc1", "expert_fc1"),
        ],
        POLICY,
    )
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


def megatrons_steady_state_choice(layers, names, fraction):
    """Megatron 0.19.2's choice for a PP = 1 chunk after the first whose layers all offload
    ``names``, written as its code makes it: every group is eligible (post_warmup_callback's margin
    disables the first chunk's only); the fraction disables the last int(N x (1 - fraction))
    eligible groups; should_bulk_offload then skips the last group of each name (here the last
    layer's), the next backward chunk being this one. True: offloaded."""
    groups = [[True] * len(names) for _ in range(layers)]
    flat = [(layer, g) for layer in range(layers) for g in range(len(names))]
    disabled = int(len(flat) * (1 - fraction))
    for layer, g in reversed(flat):
        if disabled <= 0:
            break
        groups[layer][g] = False
        disabled -= 1
    for g in range(len(names)):
        groups[layers - 1][g] = False
    return groups


@given(st.integers(1, 40), st.integers(1, 8), st.floats(0.0, 1.0))
def test_the_stack_keeps_what_megatron_keeps(layers, groups, fraction):
    names = [f"g{i}" for i in range(groups)]
    expected = megatrons_steady_state_choice(layers, names, fraction)
    for layer in range(layers):
        staying = groups_kept(groups, StackPosition(layer, layers), fraction)
        assert expected[layer] == [True] * (groups - staying) + [False] * staying  # the layer's latest groups stay


def layer_saves(layer, groups=("core_attn", "expert_fc1")):
    return [save(f"L{layer}.{group}", group) for group in groups]


def test_the_last_layer_keeps_its_groups_and_the_fraction_the_latest_layers():
    stack = OffloadStack(POLICY, 3)
    assert [stack.plan(layer_saves(i), i).offloaded for i in range(3)] == [
        {"L0.core_attn", "L0.expert_fc1"},
        {"L1.core_attn", "L1.expert_fc1"},
        set(),
    ]
    half = OffloadStack(dataclasses.replace(POLICY, fraction=0.5), 3)  # 6 groups: the last 3 stay
    assert [half.plan(layer_saves(i), i).offloaded for i in range(3)] == [
        {"L0.core_attn", "L0.expert_fc1"},
        {"L1.core_attn"},
        set(),
    ]
    assert plan_offload(layer_saves(2), POLICY).offloaded == {"L2.core_attn", "L2.expert_fc1"}  # a frame alone


def test_a_fraction_below_one_needs_layers_that_offload_the_same_groups():
    mixed = [layer_saves(0), layer_saves(1, ("core_attn",)), layer_saves(2)]
    whole = OffloadStack(POLICY, 3)
    assert [len(whole.plan(saves, i).groups) for i, saves in enumerate(mixed)] == [2, 1, 0]
    half = OffloadStack(dataclasses.replace(POLICY, fraction=0.5), 3)
    half.plan(mixed[0], 0)
    with pytest.raises(
        OffloadStackError,
        match=r"layer 2 offloads the groups \['core_attn'\] and layer 1 "
        r"\['core_attn', 'expert_fc1'\].*--activation-offload-fraction 1.0",
    ):
        half.plan(mixed[1], 1)
    # Banks plan a frame per CP size at each layer: a variant is held to its own first frame, not another variant's.
    banks = OffloadStack(dataclasses.replace(POLICY, fraction=0.5), 2)
    banks.plan(layer_saves(0), 0, variant="cp1")
    banks.plan(layer_saves(0, ("core_attn",)), 0, variant="cp2")  # at CP 2 one group's tensors fall under the minimum
    banks.plan(layer_saves(1, ("core_attn",)), 1, variant="cp2")
    with pytest.raises(OffloadStackError):
        banks.plan(layer_saves(1, ("core_attn",)), 1, variant="cp1")


def test_host_arenas_are_keyed_by_slot_and_sized_by_its_largest_variant():
    slot_plan = plan_slots([1, 1, -1, 1, -1, -1], ["big", "small", "small2"])  # big, small2 share slot 0
    plans = {
        "big": plan_offload([save("x", "core_attn", nbytes=10_000)], POLICY),
        "small": plan_offload([save("y", "core_attn", nbytes=300)], POLICY),
        "small2": plan_offload([save("z", "attn_norm", nbytes=99_999)], POLICY),
    }  # nothing offloaded
    slots_of = {v: tuple(sorted({f.slot for f in slot_plan.frames if f.variant == v})) for v in plans}
    assert host_arena_bytes(slot_plan.ring_size, slots_of, plans) == [arena_aligned(10_000), arena_aligned(300)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(offload_modules=["core_attn", "mlp"]), "--offload-modules mlp: Megatron offloads only"),
        (dict(offload_modules=["core_attn"], fraction=1.5), r"--activation-offload-fraction in \[0, 1\]"),
        (dict(offload_modules=["core_attn"], min_tensor_elements=-1), "--min-offloaded-tensor-size must be >= 0"),
    ],
)
def test_bad_offload_flags_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadPolicy.from_flags(kwargs.pop("offload_modules"), **kwargs)


saves = st.lists(
    st.builds(
        save,
        st.sampled_from("abcdef"),
        st.sampled_from([*sorted(MEGATRON_OFFLOAD_MODULES), None]),
        numel=st.sampled_from([BIG // 2, BIG, 2 * BIG]),
    ),
    max_size=30,
)
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

    args = types.SimpleNamespace(
        fine_grained_activation_offloading=True,
        offload_modules=["core_attn", "attn_proj"],
        min_offloaded_tensor_size=4096,
        activation_offload_fraction=0.5,
    )
    policy = OffloadPolicy.from_config(args)
    assert (policy.modules, policy.min_tensor_elements, policy.fraction) == (
        frozenset({"core_attn", "attn_proj"}),
        4096,
        0.5,
    )
    assert (
        OffloadPolicy.from_config(
            types.SimpleNamespace(fine_grained_activation_offloading=False, offload_modules=["core_attn"])
        )
        is None
    )
    assert (
        OffloadPolicy.from_config(types.SimpleNamespace(fine_grained_activation_offloading=True, offload_modules=[]))
        is None
    )
    with pytest.raises(ValueError, match="--offload-modules mlp: Megatron offloads only"):
        OffloadPolicy.from_config(
            types.SimpleNamespace(fine_grained_activation_offloading=True, offload_modules=["mlp"])
        )


def test_a_storage_saved_in_two_groups_reloads_with_the_later_one():
    # The backward reaches the later group first: reloading with the earlier one would block it.
    policy = OffloadPolicy.from_flags(["attn_norm", "core_attn"])
    plan = plan_offload([save("x", "attn_norm"), save("y", "attn_norm"), save("x", "core_attn")], policy)
    assert plan.groups == (("attn_norm", ("y",)), ("core_attn", ("x",)))
    assert plan.reload_order() == ("core_attn", "attn_norm")
