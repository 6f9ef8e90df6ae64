"""The host-side THD split of the plugin's hybrid-CP batch function against TE's own kernel.

``packed.layout.partitioned_indices`` replaces ``transformer_engine_torch.thd_get_partitioned_indices``
in ``banks.hybrid_cp_batch`` (the layout is on the host already, so no kernel and no copy back are
needed); both must pick the same tokens for every rank, or a CP-2 microbatch trains on other
tokens. One GPU is enough: the kernel only computes indices.
"""

from __future__ import annotations

import random

import pytest

from megatron_cg_plugin.farm.distributed import gpu_stack_missing
from megatron_cg_plugin.packed.layout import fixed_capacity_layout, partitioned_indices

pytestmark = [pytest.mark.gpu]


def layouts():
    rng = random.Random(7)
    for cp in (1, 2, 4, 8):
        for _ in range(25):
            tokens_per_rank = 2 * rng.randint(8, 256)
            capacity = cp * tokens_per_rank
            lengths = []
            while len(lengths) < 6 and sum(lengths) + 2 * cp * 2 <= capacity:
                lengths.append(rng.randint(1, max(1, (capacity - sum(lengths)) // 2)))
            try:
                yield cp, fixed_capacity_layout(lengths, cp, tokens_per_rank, max_seqs=8)
            except ValueError:  # padding pushed it over the capacity: not a pack
                continue


def test_partitioned_indices_match_transformer_engine() -> None:
    reason = gpu_stack_missing(1)
    if reason:
        pytest.skip(reason)
    import torch
    import transformer_engine.pytorch  # noqa: F401  (loads the extension module that follows)
    import transformer_engine_torch as tex

    compared = 0
    for cp, layout in layouts():
        cu_padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device="cuda")
        for rank in range(cp):
            expected = tex.thd_get_partitioned_indices(cu_padded, layout.tokens, cp, rank).tolist()
            assert partitioned_indices(layout.cu_seqlens_padded, cp, rank) == expected, (cp, rank, layout)
            compared += 1
    assert compared >= 200, compared
