"""Slot-shared capture, the parts that run without a GPU: layouts by span, boundary surfaces,
I/O-branch checks and argument validation. Capture and replay are checked on an H200 by
tests/functional/test_slot_memory.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_cg_plugin.capture.contracts import ContractViolation, HeldState
from megatron_cg_plugin.config import ContractCheck
from megatron_cg_plugin.slot_sharing.branches import BranchMismatchError
from megatron_cg_plugin.slot_sharing.capture import (
    Surface,
    Variant,
    _as_tuple,
    _Measure,
    _validate,
    capture_slotted,
    io_branches,
    planned_slots,
    slot_arena_bytes,
)
from megatron_cg_plugin.slot_sharing.layout import span_elements, span_of
from megatron_cg_plugin.slot_sharing.plan import exclusive_plan, plan_slots

BASE = torch.arange(24.0).reshape(4, 6)
LAYOUTS = {
    "contiguous": BASE,
    "transposed": BASE.t(),
    "strided": BASE[::2, 1::2],
    "offset": BASE[1:],
    "expanded": torch.arange(4.0).reshape(4, 1).expand(4, 6),
    "scalar": torch.tensor(3.0),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_span_covers_exactly_the_addressed_elements(name):
    tensor = LAYOUTS[name]
    span = span_of(tensor)
    addressed = (
        {
            tensor.storage_offset() + sum(i * s for i, s in zip(index, tensor.stride()))
            for index in torch.cartesian_prod(*[torch.arange(n) for n in tensor.shape])
            .reshape(-1, tensor.dim())
            .tolist()
        }
        if tensor.dim()
        else {tensor.storage_offset()}
    )
    assert span_elements(tensor) == max(addressed) - min(addressed) + 1
    assert span.data_ptr() == tensor.data_ptr() and span.is_contiguous()


def test_empty_tensors_have_no_span():
    assert span_elements(torch.empty(0, 5)) == 0


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_surface_keeps_layout_and_values(name):
    tensor = LAYOUTS[name]
    surface = Surface(tensor)
    surface.load(tensor)
    assert surface.view.shape == tensor.shape and surface.view.stride() == tensor.stride()
    assert torch.equal(surface.view, tensor)
    assert surface.nbytes == span_elements(tensor) * tensor.element_size()


def test_surface_loads_a_differently_strided_tensor_by_value():
    surface = Surface(BASE)
    surface.load(BASE.t().contiguous().t())  # same shape, column-major
    assert torch.equal(surface.view, BASE) and surface.view.is_contiguous()


def test_outputs_must_be_tensors():
    assert _as_tuple(BASE, "v") == (BASE,)
    with pytest.raises(TypeError, match="variant 'v': fn must return a tensor or a tuple of tensors"):
        _as_tuple((BASE, 3), "v")


def _measure(*outputs, input_grads=(), saved_bytes=0):
    return _Measure(
        saved_bytes=saved_bytes, ctx_tensors=0, outputs=tuple(outputs), input_grads=tuple(input_grads), params_used=()
    )


def test_variants_naming_one_io_branch_must_match_layouts():
    a = Variant("a", lambda x: x, (torch.zeros(4, 6),), io_branch="shared")
    b = Variant("b", lambda x: x, (torch.zeros(4, 6),), io_branch="shared")
    both_slots = {"a": (0, 1), "b": (0, 1)}
    branches = io_branches([a, b], {"a": _measure(BASE), "b": _measure(BASE.clone())}, both_slots)
    assert branches["a"] == branches["b"]
    transposed = {"a": _measure(BASE), "b": _measure(BASE.t().contiguous().t())}
    with pytest.raises(BranchMismatchError, match=r"slot 1: .*outputs\[0\]\.stride"):
        io_branches([a, b], transposed, {"a": (0, 1), "b": (1,)})
    io_branches([a, b], transposed, {"a": (0,), "b": (1,)})  # never in one slot: nothing is shared


def test_unnamed_variants_share_storage_exactly_when_layouts_match():
    same = [Variant(name, lambda x: x, (torch.zeros(4, 6),)) for name in ("a", "b")]
    other = Variant("c", lambda x: x, (torch.zeros(2, 6),))
    measures = {"a": _measure(BASE), "b": _measure(BASE.clone()), "c": _measure(BASE[:2])}
    branches = io_branches([*same, other], measures, {"a": (0,), "b": (0,), "c": (0,)})
    assert branches["a"] == branches["b"] != branches["c"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(plan=2), "pass the SlotPlan of plan_slots"),
        (dict(warmup_iterations=0), "warmup_iterations must be >= 1"),
        (dict(variants=[]), "no variants given"),
        (dict(variants=[Variant("a", abs, ()), Variant("a", abs, ())]), "variant names repeat"),
        (dict(plan=exclusive_plan(["cpu", "other"])), r"frames of variants not given \['other'\]"),
        (
            dict(variants=[Variant("cpu", abs, (torch.zeros(2),)), Variant("b", abs, ())]),
            r"variants in no frame of the plan \['b'\]",
        ),
        (dict(variants=[Variant("cpu", abs, (torch.zeros(2),))]), "sample_args must be CUDA tensors"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_allocated(kwargs, message):
    args = (
        dict(variants=[Variant("cpu", abs, (torch.zeros(2),))], plan=exclusive_plan(["cpu"]), warmup_iterations=1)
        | kwargs
    )
    error = TypeError if isinstance(args["plan"], int) else ValueError
    with pytest.raises(error, match=message):
        _validate(args["variants"], args["plan"], args["warmup_iterations"])
    with pytest.raises(error, match=message):
        capture_slotted(args["variants"], args["plan"], [], warmup_iterations=args["warmup_iterations"])


def test_the_plan_places_variants_and_sizes_each_slot_by_its_own_variants():
    """Megatron's 1F1B with two microbatches in flight: frames A, B overlap, C reuses A's slot."""
    plan = plan_slots([1, 1, -1, 1, -1, -1], ["big", "small", "small2"])
    assert plan.ring_size == 2
    names = ["big", "small", "small2"]
    slots_of = planned_slots(plan, names)
    assert slots_of == {"big": (0,), "small": (1,), "small2": (0,)}
    measures = {
        "big": _measure(saved_bytes=1000),
        "small": _measure(saved_bytes=10),
        "small2": _measure(saved_bytes=30),
    }
    # A slot only small variants use gets a small arena (a ring of the largest would be 2000 bytes).
    assert slot_arena_bytes(plan.ring_size, slots_of, measures) == [1000, 10]
    assert slot_arena_bytes(1, planned_slots(exclusive_plan(names), names), measures) == [1000]


class FakeGraph:
    def __init__(self):
        self.resets = 0
        self.replays = 0

    def reset(self):
        self.resets += 1

    def replay(self):
        self.replays += 1


def _one_entry_stats(boundary):
    """The stats of one variant's one slot, its two graphs and nothing else in the pool."""
    from megatron_cg_plugin.slot_sharing.capture import SlottedStats

    return SlottedStats(
        ring_size=1,
        variants=1,
        graphs=2,
        capture_seconds=0.0,
        pool_bytes=0,
        arena_bytes=0,
        slot_arena_bytes=(),
        boundary_bytes=boundary.nbytes,
        saved_bytes={},
        ctx_tensors={},
        retained_bytes=0,
        uncovered_bytes=0,
    )


def _slotted_graphs(contract_check=ContractCheck.FULL, step_marks=None, parameters=None):
    """One captured-looking entry on the CPU: its graphs are fakes, its boundary and contract real,
    its parameters held as capture_slotted holds them: ``parameters``, a layer or its parameters;
    by default one parameter (returned)."""
    from megatron_cg_plugin.slot_sharing.capture import SlottedGraphs, _Boundary, _Entry, _trained_and_held

    sample = torch.zeros(4, 6, requires_grad=True)
    variant = Variant("v", lambda x: x * 2, (sample,))
    boundary = _Boundary(variant, _measure(BASE, input_grads=(BASE,)))
    param = torch.nn.Parameter(torch.ones(3))
    params, held = _trained_and_held([param] if parameters is None else parameters, step_marks)
    grads = [torch.zeros_like(p) for p in params]
    entry = _Entry(variant, 0, boundary, params, grads, None, contract_check, held)
    entry.forward_graph, entry.backward_graph = FakeGraph(), FakeGraph()
    entry.output_requires_grad = (False,)
    stats = _one_entry_stats(boundary)
    return SlottedGraphs({("v", 0): entry}, stats, [boundary]), entry, param


def test_slot_replays_are_held_to_the_replay_contract():
    graphs, entry, param = _slotted_graphs()
    replay = graphs.callable("v", 0)
    fresh = torch.full((4, 6), 3.0)
    replay(fresh)
    assert torch.equal(entry.boundary.inputs[0], fresh) and entry.forward_graph.replays == 1  # copied in
    with pytest.raises(
        ContractViolation,
        match=r"variant 'v' in slot 0: shape \(arg0\) was \(4, 6\) at capture, "
        r"is \(2, 6\) now\. graphs replay fixed shapes",
    ):
        replay(torch.zeros(2, 6))
    with pytest.raises(ContractViolation, match=r"dtype \(arg0\) was torch.float32"):
        replay(torch.zeros(4, 6, dtype=torch.float64))
    with pytest.raises(ContractViolation, match=r"alias .*overwrite before it is read"):
        replay(entry.boundary.inputs[0].detach().as_strided((4, 6), (0, 1), 1))  # inside the static buffer
    with pytest.raises(ContractViolation, match=r"stride \(arg0\) was \(6, 1\) at capture, is \(1, 4\)"):
        replay(entry.boundary.inputs[0].detach().as_strided((4, 6), (1, 4)))  # read in place, other layout
    with pytest.raises(ContractViolation, match="arguments was \\['arg0'\\] at capture, is \\['arg0', 'arg1'\\]"):
        replay(fresh, fresh)
    param.data = torch.ones(3)  # reallocated, as a checkpoint load into new tensors does
    with pytest.raises(ContractViolation, match="parameter storage \\(parameter 0\\)"):
        replay(fresh)
    assert entry.forward_graph.replays == 1  # nothing refused was replayed


def test_shapes_mode_checks_shapes_only_and_off_checks_only_the_count():
    graphs, entry, param = _slotted_graphs(ContractCheck.SHAPES)
    param.data = torch.ones(3)
    graphs.callable("v", 0)(torch.zeros(4, 6))  # parameter storage is a ``full`` check
    with pytest.raises(ContractViolation, match="shape"):
        graphs.callable("v", 0)(torch.zeros(2, 6))
    graphs, entry, _ = _slotted_graphs(ContractCheck.OFF)
    with pytest.raises(TypeError, match="take 1 tensors, got 2"):  # inputs and parameters are told apart by count
        graphs.callable("v", 0)(torch.zeros(4, 6), torch.zeros(4, 6))


def test_with_step_marks_slot_replays_read_parameters_once_a_step():
    """As TE's graphs under Megatron's DDP: within one schedule run the parameters are read at the
    first replay only; the next run (after the optimizer, an evaluation, a load) reads them again."""
    from megatron_cg_plugin.capture.step_marks import StepMarks

    marks = StepMarks()
    graphs, entry, param = _slotted_graphs(step_marks=marks)
    replay = graphs.callable("v", 0)
    with marks:
        replay(torch.zeros(4, 6))
        param.data = torch.ones(3)  # inside a run nothing moves them: not read again
        replay(torch.zeros(4, 6))
    with marks, pytest.raises(ContractViolation, match="parameter storage \\(parameter 0\\)"):
        replay(torch.zeros(4, 6))
    with pytest.raises(ContractViolation, match="parameter storage"):  # outside any run: every replay
        replay(torch.zeros(4, 6))


REPLACED = {  # a parameter given anew to its module, in new memory: (how, the first parameter found moved)
    "assigned": (lambda layer: setattr(layer[1], "bias", torch.nn.Parameter(torch.zeros(3))), "1.bias"),
    "loaded with assign=True": (
        lambda layer: layer.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()}, assign=True),
        "0.weight",
    ),
}


@pytest.mark.parametrize("replaced", sorted(REPLACED))
@pytest.mark.parametrize("stepped", [False, True])
def test_a_parameter_its_layer_was_given_anew_is_refused_at_the_next_replay(replaced, stepped):
    """Given the layer (as the graph banks and SlotBackend give it), the contracts look its
    parameters up where they live, as a TE graph's contract does: a parameter replaced in its
    module by a new one (a checkpoint loaded with ``assign=True``) is refused, not replayed
    against the memory the graph reads (with step marks: at the next run's first replay)."""
    from megatron_cg_plugin.capture.step_marks import StepMarks

    marks = StepMarks()
    layer = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    layer[1].weight.requires_grad_(False)  # read in place too, though not trained
    graphs, entry, _ = _slotted_graphs(step_marks=marks if stepped else None, parameters=layer)
    assert len(entry.params) == 3  # those needing a gradient get one
    replay = graphs.callable("v", 0)
    with marks if stepped else contextlib.nullcontext():
        replay(torch.zeros(4, 6))
    replace, name = REPLACED[replaced]
    old = hex(dict(layer.named_parameters())[name].data_ptr())
    replace(layer)
    refused = rf"parameter storage \({name}\) was '{old}' at capture"
    with marks if stepped else contextlib.nullcontext(), pytest.raises(ContractViolation, match=refused):
        replay(torch.zeros(4, 6))
    assert entry.forward_graph.replays == 1  # nothing refused was replayed


def test_reset_frees_graphs_and_buffers_even_while_callables_are_held():
    """Reports keep routers and callables alive after teardown; the buffers must go anyway."""
    graphs, entry, _ = _slotted_graphs()
    graphs_before = (entry.forward_graph, entry.backward_graph)
    replay = graphs.callable("v", 0)
    graphs.reset()
    assert [g.resets for g in graphs_before] == [1, 1]
    assert entry.boundary is None and entry.param_grads == () and entry.forward_graph is None
    with pytest.raises(RuntimeError, match=r"were reset .* capture again"):
        replay(torch.zeros(4, 6))
    with pytest.raises(KeyError, match="no graph for variant 'v' in slot 0"):
        graphs.callable("v", 0)


def test_teardown_leaves_no_tensor_of_the_capture_to_the_report_that_keeps_the_layer_graphs():
    """The run report reads each layer's slot stats after teardown (capture_lifecycle._slot_layer_stats holds the
    layer graphs, which hold their replay callables and entries): the adopted static inputs (Megatron's
    sample arguments) and TE's FP8 weight-update flag must go with the graphs all the same (GPU runs
    once left 1.5 activations a layer allocated: a layer's hidden states and its attention mask)."""
    import gc
    import types
    import weakref

    from megatron_cg_plugin.capture_lifecycle import _slot_layer_stats
    from megatron_cg_plugin.slot_sharing.capture import SlottedGraphs, _Boundary, _Entry
    from megatron_cg_plugin.slot_sharing.megatron_backend import SlotLayerGraph

    hidden, mask = torch.zeros(4, 6, requires_grad=True), torch.ones(1, 6, dtype=torch.bool)
    variant = Variant("layer", lambda x, m: x * m, (hidden, mask))
    boundary = _Boundary(variant, _measure(BASE, input_grads=(BASE, None)), adopt_inputs=True)
    entry = _Entry(variant, 0, boundary, [], [], None, "off", HeldState())
    entry.forward_graph, entry.backward_graph = FakeGraph(), FakeGraph()
    flag = torch.zeros(1, dtype=torch.bool)
    entry.fp8 = types.SimpleNamespace(flag=flag)
    stats = _one_entry_stats(boundary)
    layer_graph = SlotLayerGraph(SlottedGraphs({("layer", 0): entry}, stats, [boundary]), "layer 1", 1, ("mask",))
    read_stats = _slot_layer_stats([layer_graph])  # what the report keeps
    gone = [weakref.ref(t) for t in (hidden, mask, flag, boundary.outputs[0].buffer)]
    del hidden, mask, flag, variant, boundary, entry
    layer_graph.reset()  # Megatron's delete_cuda_graphs
    del layer_graph
    gc.collect()
    assert [ref() is None for ref in gone] == [True] * 4
    assert read_stats()[0].boundary_bytes == stats.boundary_bytes  # the report still reads what the layer held


# ---------------------------------------------------------------- the coverage refusal


def _coverage_entry():
    import types

    return types.SimpleNamespace(name="variant 'v' in slot 0", uncovered_bytes=None)


def test_coverage_refuses_pool_blocks_alive_besides_the_outputs_naming_their_holder():
    from megatron_cg_plugin.slot_sharing.capture import SlotCoverageError, _check_coverage

    output = torch.zeros(16)
    kept = torch.zeros(8)  # backward state a module kept outside save_for_backward (say)
    out_block, kept_block = output.untyped_storage().data_ptr(), kept.untyped_storage().data_ptr()
    before = {1: 4}  # a block that was there before the capture is no one's business
    after = {1: 4, out_block: 64, kept_block: 32}
    entry = _coverage_entry()
    with pytest.raises(SlotCoverageError) as info:
        _check_coverage(entry, before, after, [output], strict=True)
    message = str(info.value)
    assert "1 pool block(s), 32 bytes" in message and "(8,) torch.float32" in message
    assert "kept" in message  # the holder: this test's local variable
    assert entry.uncovered_bytes == 32


def test_coverage_passes_when_only_the_outputs_are_alive_and_measures_when_not_strict():
    from megatron_cg_plugin.slot_sharing.capture import _check_coverage

    output, kept = torch.zeros(16), torch.zeros(8)
    after = {output.untyped_storage().data_ptr(): 64}
    entry = _coverage_entry()
    _check_coverage(entry, {}, after, [output], strict=True)
    assert entry.uncovered_bytes == 0
    after[kept.untyped_storage().data_ptr()] = 32
    _check_coverage(entry, {}, after, [output], strict=False)  # measured, not refused
    assert entry.uncovered_bytes == 32


def test_returned_parameter_gradients_are_copies_of_the_shared_buffer():
    """Layers share the buffers their backward graphs write (slot_sharing.param_grads): what a backward
    replay returns must not change when the next layer's backward writes the same buffer."""
    graphs, entry, param = _slotted_graphs()
    (buffer,) = entry.param_grads
    entry.params_used = (True,)
    entry.backward_graph.replay = lambda: buffer.fill_(3.0)  # this layer's gradient, written by its graph
    graphs.callable("v", 0)(torch.zeros(4, 6))
    returned = entry.replay_backward((None,))[-1]
    buffer.fill_(5.0)  # the next layer's backward replay
    assert returned.data_ptr() != buffer.data_ptr() and torch.equal(returned, torch.full((3,), 3.0))


def test_an_adopted_boundary_reads_the_samples_in_place_and_counts_only_what_it_allocated():
    from megatron_cg_plugin.slot_sharing.capture import _Boundary, _Entry

    sample, table = torch.zeros(4, 6, requires_grad=True), torch.arange(6.0)  # a RoPE-like table shared by graphs
    variant = Variant("v", lambda x, t: x * t, (sample, table))
    measure = _measure(BASE, input_grads=(BASE, None))
    adopted, copied = _Boundary(variant, measure, adopt_inputs=True), _Boundary(variant, measure)
    assert adopted.inputs[0] is sample and adopted.inputs[1] is table  # as TE's graphs do: no second copy
    assert copied.inputs[0].data_ptr() != sample.data_ptr() and copied.inputs[0].requires_grad
    input_bytes = (24 + 6) * 4
    assert copied.nbytes - adopted.nbytes == input_bytes  # the caller's samples are not this boundary's bytes
    # A replay copies in whatever is not at the static input's address, so a shared sample serves each graph.
    entry = _Entry(variant, 0, adopted, [], [], None, "off", HeldState())
    entry.forward_graph = FakeGraph()
    other = torch.ones(6)
    entry.replay_forward(torch.ones(4, 6), other)
    assert torch.equal(table, other) and torch.equal(sample.detach(), torch.ones(4, 6))


def test_only_samples_that_own_their_storage_alone_are_adopted():
    from megatron_cg_plugin.slot_sharing.capture import _Boundary

    base = torch.zeros(64, 6)
    twice = torch.zeros(4, 6)
    samples = (torch.zeros(4, 6), base[:4], twice, twice, torch.nn.Parameter(torch.zeros(6)), torch.zeros(6, 4).t())
    boundary = _Boundary(Variant("v", lambda *a: a[0], samples), _measure(BASE), adopt_inputs=True)
    # Own compact storage: adopted (a transposed tensor spans its storage too); a view of a larger
    # tensor, one tensor passed twice and a parameter get copies.
    assert boundary.adopted == [True, False, False, False, False, True]
    assert boundary.inputs[1].untyped_storage().nbytes() == 4 * 6 * 4  # the copy is compact
    assert boundary.inputs[2].data_ptr() != boundary.inputs[3].data_ptr()  # two arguments, two static inputs
    copied = _Boundary(Variant("v", lambda *a: a[0], samples), _measure(BASE))
    assert copied.nbytes - boundary.nbytes == 4 * (24 + 24)  # the two adopted samples are the caller's bytes


def test_generators_come_back_after_a_block_that_drew_from_them():
    from megatron_cg_plugin.capture.te_backend import generators_preserved

    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    expected = [torch.rand(4, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    with generators_preserved(generators):
        for generator in generators:  # warmup and capture draw (dropout masks)
            torch.rand(100, generator=generator)
    assert all(torch.equal(torch.rand(4, generator=g), e) for g, e in zip(generators, expected))


def test_a_failed_block_leaves_the_generators_to_the_rollback():
    from megatron_cg_plugin.capture.te_backend import generators_preserved

    generator = torch.Generator().manual_seed(3)
    with pytest.raises(RuntimeError, match="capture"), generators_preserved([generator]):
        torch.rand(10, generator=generator)
        raise RuntimeError("capture failed")
    assert not torch.equal(generator.get_state(), torch.Generator().manual_seed(3).get_state())
