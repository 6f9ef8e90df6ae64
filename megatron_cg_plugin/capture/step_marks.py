"""Where each run of Megatron's schedule (``forward_backward_func``: a step's microbatches) begins
and ends, as the plugin's ``train_step`` wrapper hands it the schedule.

A layer's replay contracts read its parameters and process groups once per run, at the first replay
of any of its graphs in it (``capture/contracts.py``, ``HeldState``). That holds only inside one run: before and after
it (the optimizer, an evaluation, a checkpoint load, anything a train_step of one's own does)
anything may move them. ``StepMarks`` tells a replay whether it runs inside a schedule run
(``depth``) and which one (``count``: it changes as any run begins or ends). Where nothing marks
the schedule, ``depth`` stays 0 and every replay reads them."""

from __future__ import annotations

__all__ = ["StepMarks"]


class StepMarks:
    """Entered around each schedule run. Nested entries (the bench's own marks and the patch's around
    one run) count too: a count that moves more often only makes replays read more."""

    __slots__ = ("depth", "count")

    def __init__(self) -> None:
        self.depth = 0  # schedule runs under way
        self.count = 0  # entries and exits so far: the same value means the same run

    def __enter__(self) -> StepMarks:
        self.depth += 1
        self.count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        self.count += 1

    def step_now(self) -> int | None:
        """The current run's mark, or None outside any run."""
        return self.count if self.depth else None
