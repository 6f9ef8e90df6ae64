"""slot_sharing.param_grads: parameter-gradient buffers shared by captures that replay one at a time."""

from __future__ import annotations

import torch

from megatron_cg_plugin.slot_sharing.param_grads import ParamGradBuffers


def layer_params(hidden=8):
    return [torch.zeros(hidden, hidden), torch.zeros(hidden, hidden), torch.zeros(hidden)]  # two weights, a bias


def test_each_parameter_of_one_capture_gets_its_own_buffer():
    buffers, new_bytes = ParamGradBuffers().take(layer_params())
    assert len({b.data_ptr() for b in buffers}) == 3  # two same-shape weights are written by one backward
    assert [b.shape for b in buffers] == [(8, 8), (8, 8), (8,)]
    assert new_bytes == (64 + 64 + 8) * 4


def test_a_second_capture_of_the_same_layout_reuses_every_buffer():
    shared = ParamGradBuffers()
    first, first_bytes = shared.take(layer_params())
    second, second_bytes = shared.take(layer_params())
    assert [b.data_ptr() for b in second] == [b.data_ptr() for b in first]
    assert second_bytes == 0 and shared.nbytes == first_bytes


def test_other_layouts_get_buffers_of_their_own():
    shared = ParamGradBuffers()
    dense, _ = shared.take(layer_params())
    other = [
        torch.zeros(8, 8),
        torch.zeros(8, 8, dtype=torch.bfloat16),
        torch.zeros(8, 8).t(),
        torch.zeros(8, 8),
        torch.zeros(8, 8),
    ]
    moe, new_bytes = shared.take(other)
    assert moe[0].data_ptr() == dense[0].data_ptr() and moe[3].data_ptr() == dense[1].data_ptr()
    assert moe[1].dtype == torch.bfloat16 and moe[2].stride() == (1, 8)  # the transposed layout is kept
    assert moe[4].data_ptr() not in {b.data_ptr() for b in dense}  # a third 8x8 in one capture: a new buffer
    assert new_bytes == 64 * 2 + 64 * 4 + 64 * 4


def test_parameters_the_graphs_never_reach_get_no_buffer():
    shared = ParamGradBuffers()
    params = [*layer_params(), torch.zeros(64, 8)]  # an expert weight an attention graph never touches
    buffers, new_bytes = shared.take(params, reached=[True, True, True, False])
    assert buffers[3] is None and new_bytes == (64 + 64 + 8) * 4 == shared.nbytes
    later, _ = shared.take(params)  # a graph that reaches it gets one
    assert later[3].shape == (64, 8)
