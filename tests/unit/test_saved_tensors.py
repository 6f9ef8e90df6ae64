"""Saved-tensor arenas on CPU autograd: the backward reads the arena copies, whatever happens to the
originals, with aliasing, strides, offsets and version counters as they were."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cg_plugin.slot_sharing.plan import ARENA_ALIGNMENT as ALIGNMENT
from megatron_cg_plugin.slot_sharing.saved_tensors import (
    Arena,
    ArenaHooks,
    ArenaOverflowError,
    ArenaSizer,
    storage_keys,
)


class SaveAndSeen(torch.autograd.Function):
    """Saves the given tensors; its backward records what it got back and uses their values."""

    seen: tuple = ()

    @staticmethod
    def forward(ctx, x, *saved):
        ctx.save_for_backward(*saved)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        restored = ctx.saved_tensors
        SaveAndSeen.seen = restored
        total = sum(t.float().sum() for t in restored if t is not None)
        return (grad * total,) + (None,) * len(restored)


def run(saved, corrupt=None, hooks_for=None):
    x = torch.ones(2, requires_grad=True)
    hooks = hooks_for(saved) if hooks_for else None
    if hooks is None:
        y = SaveAndSeen.apply(x, *saved)
    else:
        with hooks.hooks():
            y = SaveAndSeen.apply(x, *saved)
    if corrupt:
        corrupt()
    y.sum().backward()
    return x.grad.clone(), SaveAndSeen.seen


def arena_for(saved):
    sizer = ArenaSizer()
    with sizer.hooks():
        SaveAndSeen.apply(torch.ones(2, requires_grad=True), *saved)
    return ArenaHooks(Arena(sizer.nbytes, "cpu"))


# Writing through ``.data`` bumps no version counter: a silent overwrite, as when another graph's
# replay writes into reused pool memory.


def test_backward_reads_the_copies_after_the_originals_are_overwritten():
    base = torch.arange(12.0).reshape(3, 4)
    views = (base.t(), base[1:], base[:, 2])
    expected, _ = run(views)
    got, _ = run(views, corrupt=lambda: base.data.fill_(float("nan")), hooks_for=arena_for)
    assert torch.equal(got, expected)


def test_without_the_arena_the_corruption_shows():
    base = torch.arange(12.0).reshape(3, 4)
    got, _ = run((base.t(),), corrupt=lambda: base.data.fill_(-1.0))
    assert torch.equal(got, torch.full((2,), -12.0))  # backward saw the overwritten values


def test_aliases_strides_offsets_and_versions_survive():
    base = torch.arange(24.0).reshape(4, 6)
    base.add_(0)  # bump the version counter
    a, b, c = base.t(), base[1:, 2:], torch.ones(3)
    _, restored = run((a, b, c), corrupt=lambda: base.zero_(), hooks_for=arena_for)
    ra, rb, rc = restored
    assert ra.untyped_storage().data_ptr() == rb.untyped_storage().data_ptr()  # one storage copied once
    assert rc.untyped_storage().data_ptr() == ra.untyped_storage().data_ptr()  # same arena, other region
    assert (ra.shape, ra.stride(), ra.storage_offset() % (ALIGNMENT // 4)) == (a.shape, a.stride(), 0)
    assert (rb.shape, rb.stride()) == (b.shape, b.stride())
    assert torch.equal(ra, torch.arange(24.0).reshape(4, 6).t()) and torch.equal(rc, torch.ones(3))
    assert (a._version, ra._version) == (2, 1)  # the original moved on (zero_); the copy keeps save time


def test_parameters_are_not_copied():
    weight = torch.nn.Parameter(torch.ones(3))
    hooks = ArenaHooks(Arena(ALIGNMENT, "cpu"))
    assert hooks.pack(weight) is weight and hooks.unpack(weight) is weight
    assert hooks.arena.used == 0


class Decomposable(torch.Tensor):
    """Stands in for TE's quantized tensors (Float8Tensor): ``prepare_for_saving`` empties the object
    it is called on and returns its parts and itself; ``restore_from_saved`` fills it again and
    returns the parts left over; ``detach`` makes an alias sharing the parts."""

    @staticmethod
    def __new__(cls, data, scale):
        obj = torch.Tensor._make_subclass(cls, data)
        obj.data_part, obj.scale = data, scale
        return obj

    def detach(self):
        return Decomposable(self.data_part, self.scale)

    def prepare_for_saving(self):
        parts = [self.data_part, self.scale]
        self.data_part = self.scale = None
        return parts, self

    def restore_from_saved(self, parts):
        self.data_part, self.scale = parts[:2]
        return parts[2:]

    def value(self):
        return self.data_part * self.scale


def test_decomposing_wrappers_are_saved_by_parts_and_rebuilt_leaving_the_original_whole():
    data, scale = torch.arange(4.0), torch.tensor(3.0)
    original = Decomposable(data, scale)
    hooks = ArenaHooks(Arena(4 * ALIGNMENT, "cpu"))
    packed = hooks.pack(original)
    # A module's cached FP8 workspace is saved whole and used again after the save.
    assert original.data_part is data and original.scale is scale
    data.fill_(0)
    scale.fill_(0)
    rebuilt = hooks.unpack(packed)
    assert isinstance(rebuilt, Decomposable) and rebuilt is not original
    assert torch.equal(rebuilt.value(), torch.arange(4.0) * 3)


def test_shared_storages_are_saved_as_they_are_and_not_counted_also_as_parts():
    """FP8 weight workspaces: every frame shares them, so neither the sizer nor the arena takes
    them, also when they come as the parts of a decomposed wrapper; other saves still go in."""
    workspace, scale, activation = torch.arange(4.0), torch.tensor(3.0), torch.ones(8)
    shared = storage_keys([workspace, scale])
    sizer = ArenaSizer().sharing(shared)
    sizer.pack(Decomposable(workspace, scale))
    sizer.pack(activation)
    assert sizer.nbytes == ALIGNMENT and sizer.storages == 1
    hooks = ArenaHooks(Arena(ALIGNMENT, "cpu")).sharing(shared)
    packed, kept = hooks.pack(Decomposable(workspace, scale)), hooks.pack(activation)
    workspace.fill_(2)  # a first microbatch's refresh: the backward reads the workspace itself
    activation.fill_(0)
    assert torch.equal(hooks.unpack(packed).value(), torch.full((4,), 6.0)) and torch.equal(
        hooks.unpack(kept), torch.ones(8)
    )
    assert hooks.arena.used == ALIGNMENT


def test_overflow_names_need_and_capacity():
    hooks = ArenaHooks(Arena(ALIGNMENT, "cpu", name="slot 1"))
    with pytest.raises(ArenaOverflowError, match=f"arena slot 1 needs {4 * 100} bytes but holds {ALIGNMENT}"):
        hooks.pack(torch.ones(100))


def test_sizer_counts_each_storage_once_aligned():
    base = torch.ones(10)  # 40 bytes -> one aligned block
    sizer = ArenaSizer()
    for view in (base, base[2:], base[:3]):
        sizer.pack(view)
    sizer.pack(torch.ones(100))  # 400 bytes -> two blocks
    assert sizer.nbytes == ALIGNMENT + 2 * ALIGNMENT


@st.composite
def saved_views(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    base = torch.randn(rows, cols, generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    views = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["whole", "t", "rows", "col", "other"]))
        r = draw(st.integers(0, rows - 1))
        c = draw(st.integers(0, cols - 1))
        views.append(
            {
                "whole": base,
                "t": base.t(),
                "rows": base[r:],
                "col": base[:, c],
                "other": torch.randn(draw(st.integers(1, 5))),
            }[kind]
        )
    return base, tuple(views)


@settings(max_examples=150, deadline=None)
@given(saved_views())
def test_property_arena_backward_equals_uncorrupted_backward(case):
    base, views = case
    expected, _ = run(views)
    originals = [v.clone() for v in views]
    got, restored = run(views, corrupt=lambda: [v.data.fill_(float("nan")) for v in views], hooks_for=arena_for)
    assert torch.equal(got, expected)
    for original, back, view in zip(originals, restored, views):
        assert torch.equal(back, original) and back.stride() == view.stride()


# ---------------------------------------------------------------- storages reused within a forward


def test_a_storage_freed_and_reallocated_at_the_same_address_is_copied_again():
    """With hooks the originals are not kept, so the allocator may hand a freed storage's address to
    the next tensor; that is a different storage and needs its own copy (a regression: keyed by
    address alone, the later tensors came back with the first one's values). Storages over one
    numpy buffer reproduce the reuse deterministically."""
    buffer = np.zeros(1024, dtype=np.float32)

    def at_the_same_address(value):
        buffer[:] = value
        return torch.from_numpy(buffer)

    def chain(make_saved, hooks):
        x = torch.ones(2, requires_grad=True)
        y = x
        with hooks.hooks() if hooks else contextlib.nullcontext():
            for value in range(1, 5):
                saved = make_saved(value)
                y = SaveAndSeen.apply(y, saved)
                del saved
        y.sum().backward()
        return x.grad.clone()

    expected = chain(lambda value: torch.full((1024,), float(value)), None)
    got = chain(at_the_same_address, ArenaHooks(Arena(8 * 1024 * 4, "cpu")))
    assert torch.equal(got, expected)


# ---------------------------------------------------------------- tensors kept on ctx


@dataclasses.dataclass
class PerCallArgs:
    kept: torch.Tensor | None = None


class SharedState:
    """Stands for module-owned objects (quantizers): not entered, its tensors not rebound."""

    def __init__(self, tensor):
        self.tensor = tensor


class KeepOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, c, d, shared):
        ctx.direct = a
        ctx.nested = [(b,), {"c": c}]
        ctx.args = PerCallArgs(kept=d)
        ctx.shared = shared
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        total = ctx.direct.sum() + ctx.nested[0][0].sum() + ctx.nested[1]["c"].sum() + ctx.args.kept.sum()
        return (grad * total,) + (None,) * 5


def test_ctx_attributes_are_copied_and_rebound_but_shared_objects_are_not():
    def run_once(protect, corrupt):
        x = torch.ones(3, requires_grad=True)
        tensors = [torch.full((4,), float(v)) for v in (1, 2, 3, 4)]
        shared = SharedState(torch.zeros(2))
        sizer = ArenaSizer()
        with sizer.hooks():
            KeepOnCtx.apply(torch.ones(3, requires_grad=True), *tensors, shared)
        hooks = ArenaHooks(Arena(sizer.nbytes + 4 * ALIGNMENT, "cpu"))
        with hooks.hooks():
            y = KeepOnCtx.apply(x, *tensors, shared)
        found = hooks.protect_ctx_tensors([y]) if protect else 0
        if corrupt:
            for tensor in tensors:
                tensor.data.fill_(-100.0)
        y.sum().backward()
        return x.grad.clone(), found, shared

    clean, _, _ = run_once(protect=False, corrupt=False)
    corrupted, _, _ = run_once(protect=False, corrupt=True)
    protected, found, shared = run_once(protect=True, corrupt=True)
    assert not torch.equal(corrupted, clean)  # the test can fail: ctx tensors are not saved tensors
    assert torch.equal(protected, clean)
    assert found == 4
    assert torch.equal(shared.tensor, torch.zeros(2))


class QuantizerCopy:
    """Stands for TE's per-call quantizer copy on ctx (FusedAttnFunc's S quantizer): its scale is a
    snapshot the backward reads; its amax is the module's, which the forward writes."""

    def __init__(self, scale, amax):
        self.scale, self.amax = scale, amax


class KeepQuantizerOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, quantizer):
        ctx.args = PerCallArgs(kept=quantizer)  # in the per-call args, as in FusedAttnBwdArgs
        ctx.quantizer = quantizer  # and directly on ctx, as the CP functions keep theirs
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.quantizer.scale.sum() * ctx.args.kept.scale.sum(), None


@pytest.mark.parametrize("entered", [True, False])
def test_per_call_objects_named_by_entering_have_those_tensors_protected_and_no_others(entered):
    x = torch.ones(3, requires_grad=True)
    scale, amax = torch.full((1,), 2.0), torch.zeros(1)
    quantizer = QuantizerCopy(scale, amax)
    hooks = ArenaHooks(Arena(4 * ALIGNMENT, "cpu"))
    if entered:
        hooks.entering(lambda value: ("scale",) if isinstance(value, QuantizerCopy) else ())
    with hooks.hooks():
        y = KeepQuantizerOnCtx.apply(x, quantizer)
    found = hooks.protect_ctx_tensors([y])
    scale.data.fill_(-1.0)  # another variant's replay reuses the block of the in-graph scale clone
    y.sum().backward()
    assert found == (2 if entered else 0)  # one object reached twice: copied once, then left as it is
    assert hooks.arena.used == (ALIGNMENT if entered else 0)
    assert torch.equal(x.grad, torch.full((3,), 4.0 if entered else 1.0))
    assert quantizer.amax is amax  # the module's amax stays the module's


def test_sizer_counts_ctx_tensors_not_already_saved():
    x = torch.ones(3, requires_grad=True)
    tensors = [torch.full((4,), float(v)) for v in (1, 2, 3, 4)]
    sizer = ArenaSizer()
    with sizer.hooks():
        y = KeepOnCtx.apply(x, *tensors, SharedState(torch.zeros(2)))
    assert sizer.nbytes == 0  # nothing went through save_for_backward
    assert sizer.protect_ctx_tensors([y]) == 4
    assert sizer.nbytes == 4 * ALIGNMENT


def test_warmup_records_each_save_with_its_offload_group_for_the_plan():
    from megatron_cg_plugin.slot_sharing.offload_plan import OffloadPolicy, plan_offload

    running = {"group": None}
    sizer = ArenaSizer(group=lambda: running["group"])
    x = torch.randn(64, 32, requires_grad=True)
    with sizer.hooks():
        running["group"] = "attn_norm"
        h = x * 2.0  # saves x (a leaf that requires grad: a parameter-like input, kept)
        normed = torch.nn.functional.layer_norm(h, (32,))  # saves h and the statistics
        running["group"] = "core_attn"
        scores = normed @ normed.t()  # saves normed twice: one storage, two saves
        running["group"] = None
        out = scores.sin()  # saves scores outside every group
    storages = {save.storage for save in sizer.saves}
    assert storages == set(range(len(storages)))  # ordinals in the order storages were first saved
    by_group = {}
    for save in sizer.saves:
        by_group.setdefault(save.group, set()).add(save.storage)
    assert by_group.keys() == {"attn_norm", "core_attn", None}
    plan = plan_offload(sizer.saves, OffloadPolicy.from_flags(["core_attn"], min_tensor_elements=0))
    # normed is saved only inside core_attn: it goes; what attn_norm or no group saved stays.
    assert plan.offloaded == by_group["core_attn"] - by_group["attn_norm"] - by_group[None]
    assert plan.offloaded and not plan.offloaded & set(plan.kept)
    out.sum().backward()  # warmup's backward runs normally
