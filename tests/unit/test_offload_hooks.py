"""In-graph activation offload's saved-tensor hook (slot_sharing/offload_arenas.py), on CPU with InlineCopies:
the plan made at warmup is followed, offloaded storages leave the GPU arena, come back for backward
with their aliases, and the next group is prefetched while one is unpacked."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from _doubles.copies import InlineCopies

from megatron_cg_plugin.slot_sharing import offload_arenas
from megatron_cg_plugin.slot_sharing.offload_arenas import HostArena, HostArenaError, OffloadingArenaHooks
from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy, plan_offload
from megatron_cg_plugin.slot_sharing.plan import arena_aligned
from megatron_cg_plugin.slot_sharing.saved_tensors import Arena, ArenaSizer

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


def last_index(items, value):
    return len(items) - 1 - items[::-1].index(value)


def warmup_plan(modules, min_elements=0):
    sizer = ArenaSizer(device="cpu", group=lambda: GROUP[0])
    grads(sizer)
    return sizer, plan_offload(sizer.saves, OffloadPolicy.from_flags(modules, min_tensor_elements=min_elements))


def frame(plan, sizer, window=1, transfers=None):
    arena = Arena(sizer.nbytes, "cpu", name="slot 0")
    host = HostArena(plan.host_bytes, pin=False)
    transfers = transfers or InlineCopies()
    return OffloadingArenaHooks(arena, host, plan, transfers, window=window), arena, host, transfers


def test_offloaded_saves_leave_the_gpu_arena_and_backward_equals_eager():
    eager = grads()
    sizer, plan = warmup_plan(["core_attn", "mlp_norm"])
    assert [group for group, _ in plan.groups] == ["core_attn", "mlp_norm"]
    hooks, arena, host, transfers = frame(plan, sizer)
    got = grads(hooks, after_forward=hooks.join_forward)
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    assert arena.used == plan.device_bytes  # only the kept storages are in the GPU arena
    assert host.used == plan.host_bytes and hooks.offloaded_bytes > 0
    # Forward: each group's storages staged on the compute stream and copied to the host; before a
    # group stages, the copies of all but the last ``window`` (1) groups are joined; all at the end.
    forward = transfers.log[: last_index([kind for kind, _ in transfers.log], "join forward") + 1]
    expected = [("reset", 0)]
    for _, storages in plan.groups:
        expected += [("join forward", 1)] + [
            step
            for storage in storages
            for step in (("stage", plan.storage_bytes[storage]), ("d2h", plan.storage_bytes[storage]))
        ]
    assert forward == [*expected, ("join forward", 0)]


def test_backward_reloads_the_group_it_needs_first_and_prefetches_the_next():
    sizer, plan = warmup_plan(["attn_norm", "core_attn", "mlp_norm"])
    hooks, _, _, transfers = frame(plan, sizer)
    grads(hooks, after_forward=hooks.join_forward)
    kinds = [kind for kind, _ in transfers.log]
    backward = kinds[last_index(kinds, "join forward") + 1 :]
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
    assert all(isinstance(p, offload_arenas._Offloaded) for p in packed) and arena.used == 0
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

    monkeypatch.setattr(offload_arenas.torch, "empty", no_pinned)
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

    from megatron_cg_plugin.slot_sharing.offload_groups import OffloadGroupTracker

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


def test_empty_storages_are_neither_numbered_nor_recorded():
    # Every empty storage has address 0: numbering them would shift warmup's ordinals against capture's.
    sizer = ArenaSizer(device="cpu", group=lambda: "core_attn")
    empty = torch.empty(0)
    assert sizer.pack(empty) is empty and sizer.pack(torch.empty(0, 4)) is not None
    assert sizer.storages == 0 and sizer.saves == []


class Decomposed:
    """A TE-style quantized wrapper: saved by its parts."""

    device = torch.device("cpu")

    def __init__(self, data, scale):
        self.data, self.scale = data, scale

    def detach(self):
        return Decomposed(self.data, self.scale)

    def prepare_for_saving(self):
        return [self.data, self.scale], self

    def restore_from_saved(self, parts):
        return Decomposed(*parts)


def test_the_parts_of_a_decomposed_save_are_recorded_for_the_plan():
    sizer = ArenaSizer(device="cpu", group=lambda: "core_attn")
    sizer.pack(Decomposed(torch.rand(8), torch.rand(1)))
    assert [save.storage for save in sizer.saves] == [0, 1]  # both parts: the plan keeps or offloads each
    plan = plan_offload(sizer.saves, OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=4))
    assert plan.offloaded == {0} and plan.kept == (1,)  # the one-element scale stays: below the size


def test_a_ctx_tensor_on_an_offloaded_storage_and_a_changed_save_are_refused():
    x = torch.rand(4, 4)
    sizer = ArenaSizer(device="cpu", group=lambda: "core_attn")
    sizer._measure(x)
    plan = plan_offload(sizer.saves, OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=0))
    hooks, _, _, _ = frame(plan, sizer)
    hooks.pack(x)
    with pytest.raises(offload_arenas.OffloadPlanError, match="shares storage 0 with an offloaded save"):
        hooks._protected(x)
    other, _, _, _ = frame(plan, sizer)
    with pytest.raises(
        offload_arenas.OffloadPlanError, match="storage 0 of the frame holds 32 bytes under capture but 64"
    ):
        other.pack(torch.rand(8))  # the frame's first storage is not the one warmup saw


def test_a_ctx_tensor_is_recorded_outside_every_group_so_its_storage_stays():
    x = torch.rand(4, 4)
    sizer = ArenaSizer(device="cpu", group=lambda: "core_attn")  # a group name that outlives the forward
    sizer._measure(x)
    sizer._protected(x.t())  # the same storage, kept on a ctx
    plan = plan_offload(sizer.saves, OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=0))
    assert plan.offloaded == frozenset() and plan.kept == (0,)


def test_a_reloaded_buffer_is_let_go_after_its_last_save_is_unpacked():
    x = torch.rand(3, 3)
    sizer = ArenaSizer(device="cpu", group=lambda: "core_attn")
    sizer._measure(x)
    sizer._measure(x.t())
    plan = plan_offload(sizer.saves, OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=0))
    hooks, _, _, _ = frame(plan, sizer)
    first, second = hooks.pack(x), hooks.pack(x.t())
    hooks.join_forward()
    hooks.unpack(first)
    assert 0 in hooks._reloaded  # one save of it still to come
    hooks.unpack(second)
    assert hooks._reloaded == {}  # the unpacked tensors alone keep the buffer now


@pytest.mark.parametrize(
    "window, at_start",
    [
        (0, ["mlp_norm"]),
        (1, ["mlp_norm", "core_attn"]),
        (2, ["mlp_norm", "core_attn", "attn_norm"]),
    ],
)
def test_the_backward_starts_the_first_window_of_reloads_before_its_first_unpack(window, at_start):
    eager = grads()
    sizer, plan = warmup_plan(["attn_norm", "core_attn", "mlp_norm"])
    hooks, _, _, transfers = frame(plan, sizer, window=window)
    reloads = []
    request = hooks._request

    def recorded_request(group):
        if group not in hooks._requested:
            reloads.append(group)
        request(group)

    hooks._request = recorded_request
    got = grads(hooks, after_forward=lambda: (hooks.join_forward(), hooks.start_backward(), reloads.append("|")))
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    assert reloads[: reloads.index("|")] == at_start
    # Every group is reloaded once, in the order the backward needs them, each before its first unpack.
    assert [group for group in reloads if group != "|"] == list(plan.reload_order())
    kinds = [kind for kind, _ in transfers.log]
    backward = kinds[last_index(kinds, "join forward") + 1 :]
    assert backward.count("h2d") == len(plan.offloaded)


class RecordingCuda:
    """torch.cuda's streams and events as a log (CPU): the stream each event is recorded on, and what
    each stream waits for."""

    def __init__(self, monkeypatch):
        self.log, self.events = [], 0
        cuda = offload_arenas.torch.cuda
        recorder = self

        class Stream:
            made = 0

            def __init__(self):
                Stream.made += 1
                self.name = f"stream {Stream.made}"

            def wait_stream(self, other):
                recorder.log.append(("wait stream", self.name, other.name))

            def wait_event(self, event):
                recorder.log.append(("wait event", self.name, event.name))

        self.compute = Stream()
        self.compute.name = "compute"
        current = [self.compute]

        class Event:
            def __init__(self):
                recorder.events += 1
                self.name = f"event {recorder.events}"

            def record(self):
                recorder.log.append(("record", current[-1].name, self.name))

        @contextlib.contextmanager
        def stream(chosen):
            current.append(chosen)
            try:
                yield
            finally:
                current.pop()

        monkeypatch.setattr(cuda, "Stream", Stream)
        monkeypatch.setattr(cuda, "Event", Event)
        monkeypatch.setattr(cuda, "current_stream", lambda: current[-1])
        monkeypatch.setattr(cuda, "stream", stream)

    def followed(self, until=None):
        """The events whose work the compute stream waits for in the log up to ``until``: the ones it
        waited for, and every one recorded on a stream before it waited for that stream."""
        followed, recorded = set(), {}
        for kind, stream, name in self.log[:until]:
            if kind == "record":
                recorded.setdefault(stream, []).append(name)
            elif stream == "compute" and kind == "wait event":
                followed.add(name)
            elif stream == "compute" and kind == "wait stream":
                followed |= set(recorded.get(name, ()))
        return followed


@pytest.mark.parametrize(
    "window, followed_at_each_group",
    [
        (0, [set(), {"event 1"}, {"event 1", "event 2"}]),  # each group's copies done before the next stages
        (1, [set(), set(), {"event 1"}]),  # one group's copies may still run while the next stages
        (4, [set(), set(), set()]),  # every copy runs on until the forward's end
    ],
)
def test_in_graph_d2h_copies_run_window_groups_behind_and_are_all_joined_at_the_end(
    monkeypatch, window, followed_at_each_group
):
    cuda = RecordingCuda(monkeypatch)
    sizer, plan = warmup_plan(["attn_norm", "core_attn", "mlp_norm"])
    transfers = offload_arenas.CudaTransfers()
    hooks, _, _, _ = frame(plan, sizer, window=window, transfers=transfers)
    followed = []
    offload_one = hooks._offload

    def offload_recorded(ordinal, tensor):
        starts_group = hooks._group_of[ordinal] != hooks._staging_group
        result = offload_one(ordinal, tensor)  # joins what the window lets go, then stages and copies
        if starts_group:
            followed.append(cuda.followed())  # the group's own copy adds nothing the compute stream waits for
        return result

    hooks._offload = offload_recorded
    grads(hooks, after_forward=lambda: (hooks.join_forward(), cuda.log.append(("joined", "", ""))))
    assert followed == followed_at_each_group
    end = cuda.log.index(("joined", "", ""))
    records = [(stream, name) for kind, stream, name in cuda.log[:end] if kind == "record"]
    assert records == [(transfers.d2h.name, f"event {i}") for i in (1, 2, 3)]  # one per group, on the D2H stream
    assert cuda.followed(end) == {"event 1", "event 2", "event 3"}  # all joined by the forward's end
    assert transfers._in_flight == collections.deque() and transfers._staged == []


@pytest.mark.parametrize("window", [0, 1, 2])
def test_each_first_unpack_keeps_window_groups_reloading_ahead(window):
    sizer, plan = warmup_plan(["attn_norm", "core_attn", "mlp_norm"])
    hooks, _, _, _ = frame(plan, sizer, window=window)
    order = plan.reload_order()
    seen = {}
    unpack = hooks.unpack

    def recorded_unpack(packed):
        result = unpack(packed)
        if isinstance(packed, offload_arenas._Offloaded):
            seen.setdefault(hooks._group_of[packed.storage], set(hooks._requested))
        return result

    hooks.unpack = recorded_unpack
    grads(hooks, after_forward=lambda: (hooks.join_forward(), hooks.start_backward()))
    assert list(seen) == list(order)  # first unpacks in the order the backward needs the groups
    for position, group in enumerate(order):  # by then it and the next `window` groups are reloading
        assert seen[group] == set(order[: position + window + 1]), (group, seen[group])


def test_a_capture_that_raises_still_joins_its_copy_streams():
    from megatron_cg_plugin.slot_sharing.capture import _copies_joined

    sizer, plan = warmup_plan(["core_attn", "mlp_norm"])
    for graph, join in (("forward", "join forward"), ("backward", "join backward")):
        hooks, _, _, transfers = frame(plan, sizer)
        with pytest.raises(RuntimeError, match="inside the graph"), _copies_joined(hooks, graph):
            raise RuntimeError("inside the graph")
        assert transfers.log[-1][0] == join  # the streams joined before the capture ends, the error kept
