"""--cg-moe-drop-stats: the router tap counts kept and asked assignments on the device (CPU here)."""

from __future__ import annotations

import torch

from megatron_cg_plugin.moe.drop_stats import RouterDropTap


class FakeRouter(torch.nn.Module):
    """Returns (probs, routing_map) as Megatron's TopKRouter does, the map after capacity dropping."""

    topk = 2

    def __init__(self, routing_map: torch.Tensor) -> None:
        super().__init__()
        self.routing_map = routing_map

    def forward(self, hidden):
        probs = self.routing_map.float() * 0.5
        if self.padded is not None:  # drop-and-pad: padded slots are in the map with probability 0
            probs = probs * ~self.padded
        return probs, self.routing_map

    padded = None


def test_the_tap_counts_what_the_routers_kept_of_what_they_were_asked(monkeypatch):
    from megatron.core.transformer.moe import router

    monkeypatch.setattr(router, "TopKRouter", FakeRouter)
    # 4 tokens x top-2 = 8 asked; 6 kept (two tokens lost one expert each).
    kept = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    chunk = torch.nn.Sequential(
        FakeRouter(kept), torch.nn.Linear(1, 1), FakeRouter(torch.ones(4, 3, dtype=torch.bool)[:, :2])
    )
    tap = RouterDropTap()
    assert tap.dropped_fraction() is None
    assert tap.attach([chunk]) == 2
    chunk[0](None)
    assert tap.dropped_fraction() == 1 - 6 / 8
    chunk[2](None)  # all 8 kept
    assert tap.dropped_fraction() == 1 - 14 / 16
    tap.remove()
    chunk[0](None)  # no hook left: nothing more counted
    assert tap.dropped_fraction() == 1 - 14 / 16
    assert not chunk[0]._forward_hooks


def test_padded_capacity_slots_are_not_counted_as_kept(monkeypatch):
    # Seen on GPU: with --moe-pad-expert-input-to-capacity the map marks every capacity slot, and the
    # tap read 150% kept (-50% dropped) before it required a probability.
    from megatron.core.transformer.moe import router

    monkeypatch.setattr(router, "TopKRouter", FakeRouter)
    padded_router = FakeRouter(torch.ones(4, 3, dtype=torch.bool))  # 12 slots in the map
    padded_router.padded = torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)
    tap = RouterDropTap()
    tap.attach([torch.nn.Sequential(padded_router)])
    padded_router(None)
    assert tap.dropped_fraction() == 0.0  # 8 routed of 8 asked; the 4 padded slots do not count


def test_train_reports_the_dropped_fraction_and_leaves_no_hook_even_when_it_crashes(monkeypatch):
    import pytest
    from megatron.core.transformer.moe import router

    from megatron_cg_plugin.config import PluginConfig
    from megatron_cg_plugin.patching import builders
    from megatron_cg_plugin.session import RunSession

    class Probe:
        def synchronize(self): ...
        def allocated_bytes(self):
            return 0, 0

        def is_rank0(self):
            return True

    monkeypatch.setattr(router, "TopKRouter", FakeRouter)
    model = [torch.nn.Sequential(FakeRouter(torch.tensor([[1, 0], [0, 0]], dtype=torch.bool)))]  # 1 of 4 kept

    def train(forward_step, model, *rest):
        model[0](None)
        return "trained"

    session = RunSession(PluginConfig(print_report=False, moe_drop_stats=True), probe=Probe())
    assert builders.build_train_end_report(train, session)(None, model) == "trained"
    assert session._finished.moe_dropped_fraction == 0.75
    assert "MoE routers dropped 75.00% of token-to-expert assignments" in session._finished.format_table()
    assert not model[0][0]._forward_hooks

    def crashes(forward_step, model):
        model[0](None)
        raise RuntimeError("CUDA error")

    session = RunSession(PluginConfig(print_report=False, moe_drop_stats=True), probe=Probe())
    with pytest.raises(RuntimeError):
        builders.build_train_end_report(crashes, session)(None, model)
    assert not model[0][0]._forward_hooks
    off = RunSession(PluginConfig(print_report=False), probe=Probe())
    builders.build_train_end_report(train, off)(None, model)
    assert off._finished.moe_dropped_fraction is None  # not asked: no tap


def test_the_report_sets_the_measured_drops_beside_the_capacity_plan():
    from megatron_cg_plugin.report import RunReport

    report = RunReport(
        preset=None,
        iterations=4,
        scopes=(),
        eager_steps=4,
        graphed_steps=0,
        eager_step_ms=1.0,
        graphed_step_ms=None,
        moe_dropped_fraction=0.05,
        moe_planned_capacity=384,
        moe_uniform_dropped_fraction=0.0,
    )
    assert (
        "MoE routers dropped 5.00% of token-to-expert assignments at their capacity; the plan: 384 slots per "
        "expert per source rank, 0.00% dropped by a uniform router"
    ) in report.format_table()
