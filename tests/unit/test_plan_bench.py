"""The in-process bench's block schedule and statistics, with a fake step whose speed drifts."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_cg_plugin.plan.bench import Block, Spread, busy_seconds, interleaved_blocks, run_schedule, summarize


@given(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=7, unique=True), st.integers(1, 6))
def test_every_round_runs_every_arm_once_forward_then_reversed(arms, pairs):
    schedule = interleaved_blocks(arms, 2 * pairs)
    assert len(schedule) == len(arms) * 2 * pairs
    for r in range(2 * pairs):
        this_round = [b.arm for b in schedule if b.round == r]
        assert this_round == (arms if r % 2 == 0 else arms[::-1])


@pytest.mark.parametrize("arms, rounds", [([], 4), (["a", "a"], 2), (["a"], 0), (["a", "b"], 3)])
def test_bad_schedules_are_refused(arms, rounds):
    with pytest.raises(ValueError):
        interleaved_blocks(arms, rounds)


def fake_run(base: dict, drift_per_block: float, steps: int = 20):
    """A machine that slows down steadily: step time = base[arm] x (1 + drift x blocks so far)."""
    clock = {"blocks": 0}

    def run_block(block: Block) -> list[float]:
        factor = 1 + drift_per_block * clock["blocks"]
        clock["blocks"] += 1
        return [base[block.arm] * factor] * steps

    return run_block


@pytest.mark.parametrize("plugin_ms", [10.0, 10.2])  # no difference at all, and a 2% one
def test_interleaved_ratios_cancel_linear_drift_that_separate_runs_would_not(plugin_ms):
    base = {"eager": 0.020, "stock": 0.010, "plugin": plugin_ms / 1e3}
    lines = []
    schedule = interleaved_blocks(list(base), 8)
    summary = summarize(run_schedule(schedule, fake_run(base, drift_per_block=0.03), progress=lines.append))
    true = base["plugin"] / base["stock"]
    for pair in (("plugin", "stock"), ("stock", "plugin"), ("eager", "plugin")):
        measured = summary.ratios[pair].median
        expected = base[pair[0]] / base[pair[1]]
        assert abs(measured - expected) / expected < 0.005, (pair, measured, expected)
    # Run one arm after the other instead, and the same drift swamps a 2% difference.
    sequential = [Block(r, arm) for arm in ("stock", "plugin") for r in range(8)]
    apart = summarize(run_schedule(sequential, fake_run(base, drift_per_block=0.03)))
    assert apart.ratios[("plugin", "stock")].median / true > 1.15
    assert len(lines) == len(schedule) and lines[0].startswith("block 1/24: round 0 eager: 20 steps")
    assert summary.arms["eager"].low < summary.arms["eager"].median < summary.arms["eager"].high


def test_skipped_warmup_steps_and_the_spread():
    blocks = {Block(0, "a"): [9.0, 1.0, 1.0], Block(1, "a"): [9.0, 3.0, 3.0],
              Block(0, "b"): [9.0, 2.0, 2.0], Block(1, "b"): [9.0, 2.0, 2.0]}
    summary = summarize(blocks, skip_steps=1)
    assert summary.arms["a"] == Spread(2.0, 1.0, 3.0, (1.0, 3.0))
    (ratio,) = summary.ratios[("a", "b")].values  # one pair of rounds: the geometric mean of 0.5 and 1.5
    assert ratio == pytest.approx((0.5 * 1.5) ** 0.5)
    lines = []
    run_schedule(list(blocks), lambda block: blocks[block], lines.append, skip_steps=1)
    assert "median 1000.00 ms" in lines[0]  # the first (warm-up) step left out, as summarize does
    with pytest.raises(ValueError, match="no step left"):
        summarize(blocks, skip_steps=3)


def test_spread_format():
    assert Spread.of([0.010, 0.012, 0.011]).format(" ms", 1e3) == "11 ms [10, 12] (n=3)"
    with pytest.raises(ValueError):
        Spread.of([])


def test_busy_time_is_the_union_of_overlapping_activity():
    # A graph replay listed beside its two kernels, a kernel on a second stream, a gap, a last kernel.
    assert busy_seconds([(0, 10), (1, 4), (5, 9), (8, 12), (20, 25)]) == 17
    assert busy_seconds([]) == 0


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(1, 30)), max_size=30))
def test_busy_time_is_at_most_the_sum_and_at_least_the_longest(pairs):
    intervals = [(start, start + length) for start, length in pairs]
    total = busy_seconds(intervals)
    assert total <= sum(length for _, length in pairs)
    assert total >= max((length for _, length in pairs), default=0)
    covered = {t for start, end in intervals for t in range(start, end)}
    assert total == len(covered)  # integer intervals: the covered unit steps


def test_device_time_splits_copies_from_kernels_and_measures_their_overlap():
    from megatron_cg_plugin.plan.bench import DeviceTime

    kernels = [(0, 10), (12, 20)]
    d2h, h2d = [(8, 14)], [(25, 27)]  # 8-10 and 12-14 under kernels, 10-12 and 25-27 alone
    time = DeviceTime.of(kernels, d2h, h2d, steps=2, scale=1.0)
    assert time == DeviceTime(busy_seconds=(18 + 2 + 2) / 2, d2h_seconds=3, h2d_seconds=1, copy_overlap_seconds=2)
