"""Rendezvous ports for launches side by side (farm.ports): each handed out once, never from the
kernel's ephemeral range (where a neighbour once took a cell's port), a held one skipped."""

from __future__ import annotations

import concurrent.futures
import socket

import pytest

from megatron_cg_plugin.farm.ports import PortAllocator, ephemeral_start, port_is_free
from megatron_cg_plugin.matrix import runner


def test_ports_handed_out_from_many_threads_are_distinct_and_below_the_ephemeral_range():
    ports = PortAllocator()
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        found = list(pool.map(lambda _: ports(), range(200)))
    assert len(set(found)) == len(found)
    assert all(ports.first <= port < ephemeral_start() for port in found)


def test_a_port_something_holds_is_skipped():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not port_is_free(port)
        ports = PortAllocator(first=port - 5, stop=port + 5, start=port)
        assert ports() == port + 1


def test_the_range_wraps_once_then_says_it_is_spent():
    ports = PortAllocator(first=100, stop=103, start=102, is_free=lambda _port: True)
    assert [ports(), ports(), ports()] == [102, 100, 101]
    with pytest.raises(RuntimeError, match="no free port left"):
        ports()


def test_matrix_cells_side_by_side_launch_on_ports_of_their_own(monkeypatch, tmp_path):
    """run_matrix hands each launch a port from one allocator (no launch picks its own by bind(0))."""
    seen = []

    def run_case(case, *_args, ports=None, **_kwargs):
        seen.extend([ports(), ports()])  # the eager and the graphed launch
        raise OSError("stop here")

    monkeypatch.setattr(runner, "run_case", run_case)
    cells = runner.design(lambda _cell: ((), ""))[:6]
    runner.run_matrix(cells, tmp_path, megatron_lm_dir="/ml", jobs=6, progress=lambda _line: None)
    assert len(seen) == 12 and len(set(seen)) == 12
