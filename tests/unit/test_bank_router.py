"""Bank sizes and selection (pure), and bank/group selection on 4 gloo ranks with Megatron's own
hybrid DP x CP groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_cg_plugin.banks.router import BankRouter, BankSelectionError, GraphBank
from megatron_cg_plugin.banks.sizes import bank_sizes
from megatron_cg_plugin.farm.distributed import launch

SCRIPTS = Path(__file__).parent / "_rank_scripts"


@pytest.mark.parametrize(
    "dp_cp, minimum, sizes", [(1, 1, (1,)), (2, 1, (1, 2)), (8, 1, (1, 2, 4, 8)), (8, 2, (2, 4, 8)), (8, 8, (8,))]
)
def test_bank_sizes(dp_cp, minimum, sizes):
    assert bank_sizes(dp_cp, minimum) == sizes


@pytest.mark.parametrize(
    "dp_cp, minimum, message",
    [(6, 1, "DP x CP to be a power of two, got 6"), (8, 3, "--cg-bank-min-cp 3"), (4, 8, "--cg-bank-min-cp 8")],
)
def test_bank_sizes_refuse_bad_input(dp_cp, minimum, message):
    with pytest.raises(ValueError, match=message):
        bank_sizes(dp_cp, minimum)


def test_router_counts_replays_and_fails_closed():
    groups = {1: None, 2: object(), 4: object()}
    router = BankRouter.build((1, 2, 4), groups.__getitem__)
    assert router.select(2, groups[2]).cp_size == 2
    assert router.select(None, None).cp_size == 1  # no local_cp_size: CP 1
    with pytest.raises(BankSelectionError, match="captured with"):
        router.select(4, groups[2])
    with pytest.raises(BankSelectionError, match="CP size 8, but banks were captured for CP sizes \\[1, 2, 4\\]"):
        router.select(8, None)
    assert router.report() == [
        {"cp_size": 1, "replays": 1, "rejected": 0, "offload_groups_flushed": 0},
        {"cp_size": 2, "replays": 1, "rejected": 0, "offload_groups_flushed": 0},
        {"cp_size": 4, "replays": 0, "rejected": 1, "offload_groups_flushed": 0},
    ]
    assert router.unknown_size_rejections == 1


def test_router_keeps_banks_in_size_order():
    router = BankRouter({4: GraphBank(4, None), 1: GraphBank(1, None)})
    assert list(router.banks) == [1, 4]


@pytest.mark.multirank
def test_bank_and_group_selection_on_four_gloo_ranks(tmp_path):
    result = launch([str(SCRIPTS / "bank_rank.py")], nproc=4, timeout_s=120, log_dir=tmp_path)
    ranks = {}
    for rank, out in result.stdout.items():
        line = next(text for text in out.splitlines() if text.startswith("BANKS "))
        ranks[rank] = json.loads(line[len("BANKS ") :])
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, data in ranks.items():
        assert data["sizes"] == [1, 2, 4]
        block = rank // 2 * 2
        # Each bank's group spans exactly Megatron's block of that size: CP 1 alone, CP 2 a pair, CP 4 all.
        assert data["group_sums"] == {"1": rank, "2": block + block + 1, "4": 0 + 1 + 2 + 3}
        assert "captured with" in data["errors"]["wrong_size_group"]
        assert "banks were captured for CP sizes [1, 2, 4]" in data["errors"]["unknown_size"]
        assert "captured with" in data["errors"]["look_alike_group"]  # same ranks, another object: refused
        assert data["report"] == [
            {"cp_size": 1, "replays": 1, "rejected": 0, "offload_groups_flushed": 0},
            {"cp_size": 2, "replays": 1, "rejected": 2, "offload_groups_flushed": 0},
            {"cp_size": 4, "replays": 1, "rejected": 0, "offload_groups_flushed": 0},
        ]
