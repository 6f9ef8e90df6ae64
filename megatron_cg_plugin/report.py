"""The run report: what was captured and replayed, what it cost, and what it bought.

Built on rank 0 at the end of training from the session's records; printed as a table and
written as JSON (field meanings: docs/report.md).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

__all__ = ["RunReport", "ScopeReport"]


@dataclasses.dataclass(frozen=True)
class ScopeReport:
    """One captured scope (a set of ``--cuda-graph-modules``, or the whole layer)."""

    scope: str
    layers: int
    graphs_captured: int
    replays: int
    capture_seconds: float
    pool_bytes: int
    replays_per_layer: tuple[int, ...] = ()
    rejected: int = 0  # replays refused by their contract
    failure: str | None = None  # set when capture failed and was rolled back
    teardown_allocated_delta_bytes: int | None = None  # after delete_cuda_graphs, vs before capture
    teardown_pool_bytes_left: int | None = None
    teardown_pool_holders: tuple[str, ...] = ()  # what keeps those pool bytes allocated
    banks: tuple[dict[str, int], ...] = ()  # graph banks: per CP size, replays and rejections
    capture_phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per phase of capture_seconds
    arena_bytes: int | None = None  # --cg-slot-capture: the layers' GPU saved-tensor arenas (outside the pool)
    host_arena_bytes: int | None = None  # their pinned host arenas (in-graph offload)
    boundary_bytes: int | None = None  # their graphs' outputs, gradients, copied inputs, parameter-gradient buffers
    offloaded_bytes: int | None = None  # moved to the host by the replays counted (per-replay bytes x replays)
    offload_groups_flushed: int | None = None  # Megatron's delayed offload groups seen flushed after the replays


@dataclasses.dataclass(frozen=True)
class RunReport:
    preset: str | None
    iterations: int
    scopes: tuple[ScopeReport, ...]
    eager_steps: int
    graphed_steps: int
    eager_step_ms: float | None
    graphed_step_ms: float | None
    predicted_pool_bytes: int | None = None  # megatron-cg plan's graph-pool prediction for these flags
    prediction_leaves_out: tuple[str, ...] = ()
    predicted_host_arena_bytes: int | None = None  # --cg-slot-capture with offload: megatron-cg plan's pinned bytes
    predicted_arena_bytes: int | None = None  # --cg-slot-capture: megatron-cg plan's GPU arenas
    predicted_boundary_bytes: int | None = None  # --cg-slot-capture: megatron-cg plan's boundary buffers
    moe_dropped_fraction: float | None = None  # --cg-moe-drop-stats: assignments the routers dropped
    moe_planned_capacity: int | None = None  # slots per expert per source rank (moe.capacity)
    moe_uniform_dropped_fraction: float | None = None  # what the plan expects a uniform router to drop
    evaluations: int = 0  # Megatron's evaluations during training (--eval-interval)
    evaluation_eager_layer_calls: int = 0  # calls of graphed layers inside them: eager (eval mode), not replays
    evaluation_replays: int = 0  # graph replays inside them (none: a graph trains, it never evaluates)

    @property
    def measured_pool_bytes(self) -> int:
        return sum(scope.pool_bytes for scope in self.scopes if not scope.failure)

    @property
    def step_time_reduction(self) -> float | None:
        """Fraction of the eager steady-state step time that graphs removed (0.25 = 25% faster)."""
        if not self.eager_step_ms or self.graphed_step_ms is None:
            return None
        return 1.0 - self.graphed_step_ms / self.eager_step_ms

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["step_time_reduction"] = self.step_time_reduction
        return data

    def scalars(self) -> dict[str, float]:
        """The report's figures as TensorBoard scalars (``--cg-log-to-tensorboard``), under ``cuda-graphs/``;
        figures the run has none of are left out."""
        figures = {
            "graphs-captured": sum(scope.graphs_captured for scope in self.scopes),
            "replays": sum(scope.replays for scope in self.scopes),
            "replays-refused": sum(scope.rejected for scope in self.scopes),
            "capture-seconds": sum(scope.capture_seconds for scope in self.scopes),
            "pool-bytes": self.measured_pool_bytes,
            "predicted-pool-bytes": self.predicted_pool_bytes,
            "eager-step-ms": self.eager_step_ms,
            "graphed-step-ms": self.graphed_step_ms,
            "evaluation-eager-layer-calls": self.evaluation_eager_layer_calls,
            "evaluation-replays": self.evaluation_replays,
        }
        return {f"cuda-graphs/{name}": float(value) for name, value in figures.items() if value is not None}

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def format_table(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        rows = [("scope", "layers", "graphs", "replays", "rejected", "capture s", "pool MiB")]
        for scope in self.scopes:
            rows.append(
                (
                    scope.scope,
                    str(scope.layers),
                    str(scope.graphs_captured),
                    str(scope.replays),
                    str(scope.rejected),
                    f"{scope.capture_seconds:.2f}",
                    f"{scope.pool_bytes / 2**20:.1f}",
                )
            )
        if not self.scopes:
            rows.append(("(no graphs captured)", "-", "-", "-", "-", "-", "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["megatron-cg-plugin run report"]
        lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
        for scope in self.scopes:
            if scope.failure:
                lines.append(f"  {scope.scope}: capture failed and was rolled back: {scope.failure}")
            if scope.capture_phases:
                lines.append(
                    f"  {scope.scope}: capture phases: "
                    + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in scope.capture_phases.items())
                )
            if scope.arena_bytes is not None:
                assert scope.host_arena_bytes is not None  # the session sets both arena figures together
                per_step = (
                    f", {scope.offloaded_bytes / self.graphed_steps / 2**20:.1f} MiB per graphed step"
                    if scope.offloaded_bytes and self.graphed_steps
                    else ""
                )
                lines.append(
                    f"  {scope.scope}: GPU arenas {scope.arena_bytes / 2**20:.1f} MiB, pinned host arenas "
                    f"{scope.host_arena_bytes / 2**20:.1f} MiB, offloaded "
                    f"{(scope.offloaded_bytes or 0) / 2**20:.1f} MiB in all{per_step}"
                    + (
                        f"; {scope.offload_groups_flushed} delayed offload groups seen flushed after the replays"
                        if scope.offload_groups_flushed
                        else ""
                    )
                )
            for bank in scope.banks:
                flushed = bank.get("offload_groups_flushed")
                lines.append(
                    f"  {scope.scope}: bank CP {bank['cp_size']}: {bank['replays']} replays, "
                    f"{bank['rejected']} rejected"
                    + (f", {flushed} delayed offload groups flushed after them" if flushed else "")
                )
            if scope.teardown_allocated_delta_bytes is not None:
                assert scope.teardown_pool_bytes_left is not None  # both come from the one teardown record
                lines.append(
                    f"  {scope.scope}: after teardown, "
                    f"allocated {scope.teardown_allocated_delta_bytes / 2**20:+.2f} MiB "
                    f"vs before capture, {scope.teardown_pool_bytes_left / 2**20:.2f} MiB left in graph pools"
                    + (f" ({'; '.join(scope.teardown_pool_holders)})" if scope.teardown_pool_holders else "")
                )
        if self.predicted_pool_bytes is not None and self.measured_pool_bytes:
            lines.append(
                f"  graph pool: predicted {self.predicted_pool_bytes / 2**20:.0f} MiB, measured "
                f"{self.measured_pool_bytes / 2**20:.0f} MiB "
                f"({self.predicted_pool_bytes / self.measured_pool_bytes:.2f}x)"
                + (
                    f"; the prediction leaves out {', '.join(self.prediction_leaves_out)}"
                    if self.prediction_leaves_out
                    else ""
                )
            )
        for label, predicted, field in (
            ("GPU arenas", self.predicted_arena_bytes, "arena_bytes"),
            ("boundary buffers", self.predicted_boundary_bytes, "boundary_bytes"),
            ("pinned host arenas", self.predicted_host_arena_bytes, "host_arena_bytes"),
        ):
            measured = sum(getattr(scope, field) or 0 for scope in self.scopes if not scope.failure)
            if predicted is not None and measured:
                lines.append(f"  {label}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
        if self.moe_dropped_fraction is not None:
            plan = (
                ""
                if self.moe_planned_capacity is None
                else f"; the plan: {self.moe_planned_capacity} slots per expert per source rank, "
                f"{100 * (self.moe_uniform_dropped_fraction or 0):.2f}% dropped by a uniform router"
            )
            lines.append(
                f"  MoE routers dropped {100 * self.moe_dropped_fraction:.2f}% of token-to-expert assignments "
                f"at their capacity{plan}"
            )
        if self.evaluations:
            lines.append(
                f"  evaluations: {self.evaluations}, graphed layers ran {self.evaluation_eager_layer_calls} times "
                f"eagerly in them ({self.evaluation_replays} replays)"
            )
        reduction = self.step_time_reduction
        lines.append(
            f"  steady-state step time: eager {ms(self.eager_step_ms)} ms ({self.eager_steps} steps), "
            f"graphed {ms(self.graphed_step_ms)} ms ({self.graphed_steps} steps)"
            + ("" if reduction is None else f", {abs(100 * reduction):.1f}% {'less' if reduction >= 0 else 'more'}")
        )
        return "\n".join(lines)
