"""In-graph activation offload's saved-tensor hook (memory/offload.py), on CPU with InlineTransfers:
the plan made at warmup is followed, offloaded storages leave the GPU arena, come back for backward
with their aliases, and the next group is prefetched while one is unpacked."""

from __future__ import annotations

import pytest
import torch

from megatron_cg_plugin.memory import offload
from megatron_cg_plugin.memory.offload import HostArena, HostArenaError, InlineTransfers, OffloadingArenaHooks
from megatron_cg_plugin.memory.saved_tensors import Arena, ArenaSizer
from megatron_cg_plugin.plan.offload import OffloadPolicy, plan_offload
from megatron_cg_plugin.plan.slots import arena_aligned

GROUP = [None]


def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Three offload groups, in Megatron's names: each saves a storage of its own."""
    GROUP[0] = "attn_norm"
    a = torch.sigmoid(x * w)  # sigmoid saves its output a; mul saves x and w (w is a leaf input here)
    GROUP[0] = "core_attn"
    t = a.t()  # a view: both a and a.t() saved below, one storage
    b = (t @ a).tanh()  # matmul saves t and a; tanh saves b
    GROUP[0] = "mlp_norm"
    c = b.exp()  # exp saves c
    GROUP[0] = None
    return (c * 2).sum()


def grads(hooks=None, after_forward=lambda: None):
    x = torch.arange(16.0).reshape(4, 4).div(10).requires_grad_()
    w = torch.full((4, 4), 0.5, requires_grad=True)
    with hooks.hooks() if hooks else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = layer(x, w)
    after_forward()
    loss.backward()
    return x.grad, w.grad


def warmup_plan(modules, min_elements=0):
    sizer = ArenaSizer(device="cpu", group=lambda: GROUP[0])
    grads(sizer)
    return sizer, plan_offload(sizer.saves, OffloadPolicy.from_flags(modules, min_tensor_elements=min_elements))


def frame(plan, sizer):
    arena = Arena(sizer.nbytes, "cpu", name="slot 0")
    host = HostArena(plan.host_bytes, pin=False)
    transfers = InlineTransfers()
    return OffloadingArenaHooks(arena, host, plan, transfers), arena, host, transfers


def test_offloaded_saves_leave_the_gpu_arena_and_backward_equals_eager():
    eager = grads()
    sizer, plan = warmup_plan(["core_attn", "mlp_norm"])
    assert [group for group, _ in plan.groups] == ["core_attn", "mlp_norm"]
    hooks, arena, host, transfers = frame(plan, sizer)
    got = grads(hooks, after_forward=hooks.join_forward)
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    assert arena.used == plan.device_bytes  # only the kept storages are in the GPU arena
    assert host.used == plan.host_bytes and hooks.offloaded_bytes > 0
    # Forward: every offloaded storage staged on the compute stream, then copied to the host, then joined.
    forward = transfers.log[:transfers.log.index(("join forward", 0)) + 1]
    assert [kind for kind, _ in forward] == ["stage", "d2h"] * len(plan.offloaded) + ["join forward"]


def test_backward_reloads_the_group_it_needs_first_and_prefetches_the_next():
    sizer, plan = warmup_plan(["attn_norm", "core_attn", "mlp_norm"])
    hooks, _, _, transfers = frame(plan, sizer)
    grads(hooks, after_forward=hooks.join_forward)
    backward = [kind for kind, _ in transfers.log[transfers.log.index(("join forward", 0)) + 1:]]
    # mlp_norm is needed first: its reload, its wait, then core_attn's reload starts before core_attn is unpacked.
    first_wait = backward.index("wait")
    assert backward[:first_wait] == ["h2d"]  # mlp_norm: one storage
    assert backward[first_wait + 1] == "h2d"  # the prefetch of core_attn, issued right after
    assert backward.count("h2d") == len(plan.offloaded)  # each storage reloaded once
    assert plan.reload_order() == ("mlp_norm", "core_attn", "attn_norm")


def test_views_of_one_offloaded_storage_come_back_as_views_of_one_buffer():
    x = torch.rand(3, 3)
    sizer = ArenaSizer(device="cpu", group=lambda: "core_attn")
    sizer._measure(x)  # the pack hook: two saves, two views of one storage
    sizer._measure(x.t())
    plan = plan_offload(sizer.saves, OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=0))
    assert plan.groups == (("core_attn", (0,)),)
    hooks, arena, host, _ = frame(plan, sizer)
    packed = [hooks.pack(x), hooks.pack(x.t())]
    assert all(isinstance(p, offload._Offloaded) for p in packed) and arena.used == 0
    hooks.join_forward()
    x.zero_()  # the original changes after the forward: the host copy does not
    first, second = (hooks.unpack(p) for p in packed)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert torch.equal(second, first.t()) and first.abs().sum() > 0


def test_a_frame_that_offloads_more_than_at_warmup_is_refused_by_name():
    host = HostArena(1024, name="host arena of slot 1", pin=False)
    host.reserve(1024)
    with pytest.raises(HostArenaError, match="host arena of slot 1 needs 1536 bytes but holds 1024"):
        host.reserve(512)


def test_pinned_memory_that_cannot_be_had_is_refused_naming_the_bytes(monkeypatch):
    real_empty = torch.empty

    def no_pinned(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(offload.torch, "empty", no_pinned)
    with pytest.raises(HostArenaError, match=f"could not pin {arena_aligned(10 * 2**20)} bytes of host memory"):
        HostArena(10 * 2**20, name="slot 0")


def test_storages_get_new_ordinals_at_reused_addresses_in_warmup_and_in_the_frame():
    # The plan names storages by their order of first save; an address freed and reused in the
    # forward is a new storage in both numberings (ArenaSizer used to give two storages one number).
    sizer = ArenaSizer(device="cpu", group=lambda: "core_attn")
    with sizer.hooks():
        for _ in range(3):
            t = torch.rand(64, requires_grad=True)
            t.exp().sum()  # exp saves its output, freed at the end of the iteration
    assert sorted({s.storage for s in sizer.saves}) == list(range(sizer.storages))


def test_megatrons_offload_interface_only_names_its_group_inside_the_tracker_and_is_restored_after():
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    from megatron_cg_plugin.capture.offload_groups import OffloadGroupTracker

    interface = fgo.FineGrainedActivationOffloadingInterface
    before = (interface.__enter__, interface.__exit__, interface.group_offload)
    tracker = OffloadGroupTracker()
    x = torch.ones(2)
    with tracker.scoped():
        with interface(True, x, "attn_norm") as inside:
            assert inside is x and tracker.current() == "attn_norm"
            with interface(False, x, "core_attn"):  # a module the user does not offload: not a group
                assert tracker.current() == "attn_norm"
            with interface(True, x, "qkv_linear"):
                assert tracker.current() == "qkv_linear"
            assert tracker.current() == "attn_norm"
        assert tracker.current() is None
        assert interface(True, x, "attn_norm").group_offload(x, forced_released_tensors=[x]) is x
    assert (interface.__enter__, interface.__exit__, interface.group_offload) == before
