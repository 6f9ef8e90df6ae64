"""Shared by the GPU functional tests."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def farm_out(tmp_path_factory) -> Path:
    """Where runs write metrics, reports and logs: MEGATRON_CG_FARM_OUT (kept), else a temp dir."""
    configured = os.environ.get("MEGATRON_CG_FARM_OUT")
    return Path(configured) if configured else tmp_path_factory.mktemp("farm")
