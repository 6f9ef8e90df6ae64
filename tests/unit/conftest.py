"""Shared CPU fakes for the plugin's unit tests (a device probe, a hand-driven clock), and temp files in tmp_path."""

from __future__ import annotations

import sys
import tempfile

import pytest


@pytest.fixture(autouse=True)
def temp_files_in_tmp_path(tmp_path):
    """A refused launcher run keeps Megatron's printout in a temp file (``console.megatron_printout_held``),
    as other code keeps its scratch files: in a test they go to its ``tmp_path``, not /tmp. (Not through
    ``monkeypatch``: a test's own fixtures must see its monkeypatching undone before they check.)"""
    saved, tempfile.tempdir = tempfile.tempdir, str(tmp_path)
    yield
    tempfile.tempdir = saved


@pytest.fixture(autouse=True)
def no_megatron_args_left_behind():
    """A test that runs a script in this process (``megatron-cg run``, the launcher) leaves Megatron's parsed
    arguments set, and ``install()`` enforces the rules on parsed arguments it finds: a later test must not
    inherit another's flags."""
    yield
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is not None and getattr(global_vars, "_GLOBAL_ARGS", None) is not None:
        global_vars.unset_global_variables()


class FakeProbe:
    """Stands in for ``session.CudaProbe``: reports fixed memory, and counts synchronize calls (the
    session must make none: it records without waiting for the device)."""

    def __init__(self, allocated: int = 1_339_286_016, max_allocated: int = 3_418_015_744, rank0: bool = True) -> None:
        self.allocated = allocated
        self.max_allocated = max_allocated
        self.rank0 = rank0
        self.synchronize_calls = 0

    def synchronize(self) -> None:
        self.synchronize_calls += 1

    def allocated_bytes(self) -> tuple[int, int]:
        return self.allocated, self.max_allocated

    def is_rank0(self) -> bool:
        return self.rank0


class FakeClock:
    """A clock that only moves when the test says so (dyadic steps keep float sums exact)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def probe() -> FakeProbe:
    return FakeProbe()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def offload_manager(monkeypatch):
    """Megatron's own offload manager singleton, made without its CUDA streams (CPU)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    manager = object.__new__(PipelineOffloadManager)
    manager._delayed_offload_groups = []
    monkeypatch.setattr(PipelineOffloadManager, "OFFLOAD_MGR", manager)
    return manager
