"""Where training steps begin and end, as the plugin's ``train_step`` wrapper sees them.

A replay's contract may skip reading parameters and process groups on a step's later microbatches
once the first microbatch found them as captured (``capture/contracts.py``, ``QuickAccept``). That
holds only inside one step: between steps anything may move them. ``StepMarks`` tells a replay
whether it runs inside a step (``depth``) and which one (``count``: it changes as any step begins or
ends). Where no wrapper marks steps, ``depth`` stays 0 and nothing is skipped."""

from __future__ import annotations


class StepMarks:
    """Entered around each ``train_step`` call. Nested entries (the bench's own step inside a wrapped
    one) count too: a count that moves more often only makes replays read more."""

    __slots__ = ("depth", "count")

    def __init__(self) -> None:
        self.depth = 0  # train_step calls under way
        self.count = 0  # entries and exits so far: the same value means the same step

    def __enter__(self) -> "StepMarks":
        self.depth += 1
        self.count += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        self.count += 1

    def step_now(self) -> int | None:
        """The current step's mark, or None outside any step."""
        return self.count if self.depth else None
