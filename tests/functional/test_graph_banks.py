"""GPU (2 ranks): dynamic-CP graph banks on megatron-core TE TransformerLayers under hybrid CP.

Probe tests/functional/_probes/banks_probe.py, its scenarios. ``layers``: banks for CP sizes 1 and
2 captured into one pool, a schedule of fixed-capacity THD packs (CP-1 packs per rank, CP-2 packs
over both ranks) replayed and compared bitwise with eager (outputs and all gradients), pool bytes
with one and two banks, and the fail-closed refusals. ``training``: a tiny GPT trains 30 steps with
banks and must reproduce the eager run's per-step loss. ``rope``: one layer with fused RoPE; a
sequence run with CP 2 must reach core attention with the rotated queries and keys of the same
sequence run with CP 1 (with the plugin's dynamic-CP attention; Megatron's stock call with the
static group runs out of bounds there), and banks
captured with the RoPE tables replay bitwise like eager. ``moe``: the ``layers`` schedule through MoE
layers whose MoE block is graphed (drop-and-pad), bitwise like eager. ``dropless-moe``: the same
through a dropless MoE whose graphs end after the dispatcher's preprocess (``attn moe_router
moe_preprocess``), the eager rest of each MoE block taking the replayed bank's routing state; not run
on GPUs yet.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_cg_plugin.farm.distributed import run_probe

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]
PROBE = Path(__file__).parent / "_probes" / "banks_probe.py"


def _scenario(fixture: str, scenario: str, name: str):
    """Module fixture ``fixture``: the probe's ``scenario`` on 2 ranks, one result per rank (files ``name``)."""

    @pytest.fixture(scope="module", name=fixture)
    def results(farm_out: Path) -> list[dict]:
        return run_probe(PROBE, farm_out, name, nproc=2, args=("--scenario", scenario))

    return results


ranks = _scenario("ranks", "layers", "banks")
training = _scenario("training", "training", "banks_training")
rope = _scenario("rope", "rope", "banks_rope")
moe = _scenario("moe", "moe", "banks_moe")
dropless_moe = _scenario("dropless_moe", "dropless-moe", "banks_dropless_moe")


# Rotated queries and keys of one token in two CP layouts: the projections are per token, so only a
# wrong rotation makes them differ beyond bf16 rounding (2**-8 relative).
BF16_ROUNDING = 2**-7


def test_rope_under_cp2_rotates_like_cp1(rope: list[dict]) -> None:
    for result in rope:
        assert max(result["cp2_vs_cp1_relative"].values()) <= BF16_ROUNDING, result


def test_banks_with_rope_tables_replay_bitwise_eager(rope: list[dict]) -> None:
    for result in rope:
        assert all(exact for _, exact in result["graphed_equal_eager"]), result
        banks = {row["cp_size"]: row for row in result["report"]["banks"]}
        assert banks[1]["replays"] == 1 and banks[2]["replays"] == 2 and not any(r["rejected"] for r in banks.values())


def test_banks_graphing_the_moe_block_replay_bitwise_eager(moe: list[dict]) -> None:
    for result in moe:
        assert result["all_exact"], result
        banks = {row["cp_size"]: row for row in result["report"]["banks"]}
        assert set(banks) == {1, 2} and all(r["replays"] > 0 and not r["rejected"] for r in banks.values()), banks


def test_banks_ending_inside_a_dropless_moe_block_replay_bitwise_eager(dropless_moe: list[dict]) -> None:
    """Banks with attn moe_router moe_preprocess: the eager rest gets the replayed bank's routing state."""
    for result in dropless_moe:
        assert result["all_exact"], result
        banks = {row["cp_size"]: row for row in result["report"]["banks"]}
        assert set(banks) == {1, 2} and all(r["replays"] > 0 and not r["rejected"] for r in banks.values()), banks


def test_tiny_gpt_trains_30_steps_with_banks_and_the_eager_losses(training: list[dict]) -> None:
    for result in training:
        assert result["steps"] >= 30
        assert result["losses_equal"], (result["rank"], result["eager_losses"], result["graphed_losses"])
        banks = {row["cp_size"]: row for row in result["report"]["banks"]}
        assert set(banks) == {1, 2} and all(row["replays"] > 0 and row["rejected"] == 0 for row in banks.values())
        assert result["report"]["unknown_size_rejections"] == 0
        # Step times are recorded, not asserted.


def test_banked_replays_are_bitwise_eager_on_every_rank(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["all_exact"], (result["rank"], result["exact"], result["max_abs_diff"])


def test_every_bank_replays_without_rejections(ranks: list[dict]) -> None:
    for result in ranks:
        banks = {row["cp_size"]: row for row in result["training_report"]["banks"]}
        assert set(banks) == {1, 2}
        assert all(row["replays"] > 0 and row["rejected"] == 0 for row in banks.values()), banks
        assert result["training_report"]["unknown_size_rejections"] == 0


def _bank_bytes(report: dict) -> int:
    """What the banks themselves hold: arenas and boundary storage (the pool's temporaries, shared by
    every capture, do not depend on the number of banks)."""
    return report["arena_bytes"] + report["boundary_bytes"]


def test_two_banks_hold_at_most_15_percent_more_arena_and_boundary_bytes_than_one(ranks: list[dict]) -> None:
    for result in ranks:  # without sharing, two banks of one size would hold twice as much
        one, two = _bank_bytes(result["one_bank_report"]), _bank_bytes(result["training_report"])
        assert one > 0 and two <= 1.15 * one, (one, two)


def test_wrong_group_unknown_size_and_overfull_pack_are_refused(ranks: list[dict]) -> None:
    for result in ranks:
        refusals = result["refusals"]
        assert (
            refusals["lookalike_group"].startswith("BankSelectionError") and "very group" in refusals["lookalike_group"]
        )
        assert (
            refusals["unknown_cp_size"].startswith("BankSelectionError") and "CP size 4" in refusals["unknown_cp_size"]
        )
        assert (
            refusals["cu_beyond_capacity"].startswith("ThdCapacityError")
            and "--cg-thd-max-seqs" in refusals["cu_beyond_capacity"]
        )
