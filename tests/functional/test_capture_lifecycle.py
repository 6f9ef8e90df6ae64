"""GPU: rollback, replay contracts, teardown and stale-graph hygiene on a real TE capture.

Each scenario runs tests/functional/_probes/lifecycle_probe.py on one rank (own process, so a
CUDA-level failure in one cannot leak into another) and checks the JSON it writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_cg_plugin.farm.distributed import run_probe

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]
PROBE = Path(__file__).parent / "_probes" / "lifecycle_probe.py"
MiB = 2**20


def _run(scenario: str, out_dir: Path) -> dict:
    return run_probe(PROBE, out_dir, f"lifecycle_{scenario}", args=("--scenario", scenario), timeout_s=600)[0]


def test_contracts_teardown_and_recapture(farm_out: Path) -> None:
    result = _run("lifecycle", farm_out)
    assert result["losses_equal"], (result["eager_losses"], result["graphed_losses"])
    assert result["replays"] > 0 and result["recaptured"]
    assert result["static_inputs_alive_after_capture"] and result["static_inputs_alive_after_replays"], result
    teardown = result["teardown"]
    assert abs(teardown["allocated_delta_bytes"]) <= MiB, teardown
    assert teardown["pool_bytes_left"] == 0, teardown
    assert teardown["pinned_host_delta_bytes"] in (0, None), teardown
    assert result["violations"]["seq_length"]["field"] == "shape", result["violations"]
    assert result["violations"]["dtype"]["field"] == "dtype", result["violations"]
    assert result["rejected"] == 2
    # Recorded, not asserted as a timing (published figures come from benchmarks/).
    assert result["overhead"]["check_us_per_replay"]["full"] > 0


def test_stale_graph_breaks_capture_without_the_check(farm_out: Path) -> None:
    """Regression: an eager `loss` kept alive makes TE capture fail on torch >= 2.9; the
    transaction rolls it back and training continues eagerly."""
    result = _run("stale-unchecked", farm_out)
    assert not result["captured"] and not result["graphs_created"], result
    assert result["error_type"] == "CaptureFailedError", result
    assert "capture" in result["cause"], result  # the CUDA stream-capture error, rolled back
    assert not result["megatron_capture_flag_after"]
    # The invalidated capture left the random generators in capture mode; the rollback takes them
    # out again, so eager training goes on with the losses of a run that never tried to capture.
    assert "eager_step_error" not in result, result["eager_step_error"]
    assert result["losses_equal_eager"], (result["losses"], result["eager_losses"])


def test_stale_graph_is_refused_after_the_failed_capture_naming_its_holder(farm_out: Path) -> None:
    """The default check looks only once a capture failed: rolled back, then the holder named."""
    result = _run("stale-checked", farm_out)
    assert not result["captured"] and not result["graphs_created"], result
    assert result["error_type"] == "StaleAutogradGraphError", result
    assert "failed and was rolled back" in result["error"] and "'loss'" in result["error"], result["error"]
    assert "during capture" in result["cause"], result["cause"]  # CUDA's own error, chained
    assert not result["megatron_capture_flag_after"]
    assert "eager_step_error" not in result, result["eager_step_error"]
    assert result["losses_equal_eager"], (result["losses"], result["eager_losses"])


def test_stale_graph_is_refused_before_capture_with_the_before_check(farm_out: Path) -> None:
    result = _run("stale-before", farm_out)
    assert not result["captured"] and not result["graphs_created"], result
    assert result["error_type"] == "StaleAutogradGraphError", result
    assert result["error"].startswith("CUDA graph capture refused") and "'loss'" in result["error"], result["error"]
    assert result["cause"] is None  # nothing was attempted
    assert not result["megatron_capture_flag_after"]
    assert result["losses_equal_eager"], (result["losses"], result["eager_losses"])


def test_graph_held_by_garbage_never_reaches_the_capture(farm_out: Path) -> None:
    """Megatron's _start_capturing collects garbage before capturing, so the default check, which
    looks only after a failure, has nothing to do (H200: captured at once, losses equal eager)."""
    result = _run("stale-garbage", farm_out)
    assert result["graph_alive_at_capture"] and not result["graph_alive_after_capture"], result  # Megatron collected it
    assert result["captured"] and result["graphs_created"], result
    assert "eager_step_error" not in result, result["eager_step_error"]
    assert result["replays"] > 0, result
    assert result["losses_equal_eager"], (result["losses"], result["eager_losses"])


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_failed_fp8_capture_leaves_the_fp8_state_as_it_was(farm_out: Path, recipe: str) -> None:
    """Injected inside layer 2's capture, after TE's warmup moved every amax history: the rollback
    restores each module's scales and histories and the global amax buffers, and eager FP8
    training goes on equal to a run that never captured."""
    result = _run(f"fp8-failure-{recipe}", farm_out)
    assert "probe_error" not in result, result["probe_error"]
    assert "injected failure" in result["failure"], result["failure"]
    assert not result["graphs_created"]
    if recipe == "delayed":
        assert result["fp8_tensors_compared"] > 0, result  # delayed scaling keeps per-module meta
    else:  # current scaling keeps no FP8 state between steps: the losses are the check
        assert result["fp8_tensors_compared"] == 0, result
    assert result["fp8_state_changed"] == [], result["fp8_state_changed"]
    assert result["losses_equal_eager"], (result["losses"], result["eager_losses"])


def test_without_the_fp8_meta_restore_the_failed_capture_leaves_changed_amax_histories(farm_out: Path) -> None:
    """The guard above is needed: TE restores the FP8 meta only after a capture that succeeded."""
    result = _run("fp8-failure-delayed-unrestored", farm_out)
    assert "probe_error" not in result, result["probe_error"]
    assert "injected failure" in result["failure"], result["failure"]
    assert any(name.endswith("amax_history") for name in result["fp8_state_changed"]), result["fp8_state_changed"]
