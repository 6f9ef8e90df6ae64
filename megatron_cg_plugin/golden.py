"""Read, write and compare Megatron-LM functional-test "golden values" files.

The schema is Megatron's own, so golden files can be shared with Megatron's CI unchanged:
``{metric: {"start_step": int, "end_step": int, "step_interval": int, "values": {"<step>": number}}}``.
Megatron writes a NaN value as the string ``"nan"``; we read and write it that way so the files
stay strict JSON. Pure Python on purpose: the comparison runs in CI jobs without torch or a GPU.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import statistics
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from megatron_cg_plugin.inputs import InputError, read_json, require_output_file

__all__ = [
    "GoldenFormatError",
    "MetricSeries",
    "GoldenValues",
    "MetricsRecorder",
    "Tolerance",
    "default_tolerances",
    "Mismatch",
    "compare",
    "format_report",
    "update",
]

_GOLDEN_FILE = (
    "a golden-values JSON file in Megatron's schema ({metric: {start_step, end_step, step_interval, values}}), "
    "such as a run's --cg-metrics-out"
)
# Non-finite values as spelled in Megatron files (strict JSON has no NaN/Infinity literals).
_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class GoldenFormatError(ValueError):
    """A golden-values file (or dict) does not follow Megatron's schema."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # bool is an int subclass; never a step


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _encode(v: float) -> float | str:
    return v if math.isfinite(v) else "nan" if math.isnan(v) else "inf" if v > 0 else "-inf"


@dataclass(frozen=True)
class MetricSeries:
    """One metric's values by training step. Ints stay ints so byte counts round-trip verbatim."""

    values: Mapping[int, float]
    step_interval: int = 1

    def __post_init__(self) -> None:
        if not self.values:
            raise GoldenFormatError("MetricSeries needs at least one step")  # start/end undefined
        if not _is_int(self.step_interval) or self.step_interval < 1:
            raise GoldenFormatError(f"step_interval must be a positive int, got {self.step_interval!r}")
        for step, value in self.values.items():
            if not _is_int(step):
                raise GoldenFormatError(f"step must be an int, got {step!r}")
            if not _is_number(value):
                raise GoldenFormatError(f"value at step {step} must be a number, got {value!r}")
        # Sorted, read-only copy: the dataclass is frozen, so its mapping should be too.
        object.__setattr__(self, "values", MappingProxyType(dict(sorted(self.values.items()))))

    @property
    def start_step(self) -> int:
        return next(iter(self.values))

    @property
    def end_step(self) -> int:
        return max(self.values)  # the last step: __post_init__ sorts them

    def to_json(self) -> dict[str, Any]:
        """The schema dict; start/end come from the steps actually present."""
        return {
            "start_step": self.start_step,
            "end_step": self.end_step,
            "step_interval": self.step_interval,
            "values": {str(s): _encode(v) for s, v in self.values.items()},
        }

    @classmethod
    def from_json(cls, d: Any, metric: str = "<metric>") -> MetricSeries:
        """Parse and validate one metric's entry; errors name ``metric`` and the bad field."""

        def bad(field: str, why: str) -> GoldenFormatError:
            return GoldenFormatError(f"golden values: metric {metric!r}: field {field!r} {why}")

        if not isinstance(d, Mapping):
            raise bad("<entry>", f"must be an object, got {type(d).__name__}")
        for field in ("start_step", "end_step", "step_interval", "values"):
            if field not in d:
                raise bad(field, "is missing")
            if field != "values" and not _is_int(d[field]):
                raise bad(field, f"must be an int, got {d[field]!r}")
        start, end, interval, raw = d["start_step"], d["end_step"], d["step_interval"], d["values"]
        if interval < 1:
            raise bad("step_interval", f"must be >= 1, got {interval}")
        if start > end:
            raise bad("end_step", f"({end}) is before start_step ({start})")
        if not isinstance(raw, Mapping) or not raw:
            raise bad("values", "must be a non-empty object of step -> number")
        values: dict[int, float] = {}
        for key, value in raw.items():
            try:
                step = int(key)
            except (TypeError, ValueError):
                raise bad(f"values[{key!r}]", "key is not an integer step") from None
            if step in values:
                raise bad(f"values[{key!r}]", f"duplicates step {step}")
            # end_step may exceed the last key when steps are sampled at an interval, so only
            # check the keys lie inside the declared range.
            if not start <= step <= end:
                raise bad(f"values[{key!r}]", f"step is outside start_step..end_step ({start}..{end})")
            if isinstance(value, str) and value.lower() in _SPECIAL:
                value = _SPECIAL[value.lower()]
            elif not _is_number(value):
                raise bad(f"values[{key!r}]", f"must be a number or 'nan', got {value!r}")
            values[step] = value
        return cls(values, interval)


@dataclass(frozen=True)
class GoldenValues:
    """All metrics of one run, as stored in one golden-values file."""

    metrics: Mapping[str, MetricSeries]

    def to_json(self) -> dict[str, Any]:
        return {name: s.to_json() for name, s in self.metrics.items()}

    @classmethod
    def from_json(cls, d: Any) -> GoldenValues:
        if not isinstance(d, Mapping):
            raise GoldenFormatError(f"golden values: top level must be an object, got {type(d).__name__}")
        return cls({str(k): MetricSeries.from_json(v, str(k)) for k, v in d.items()})

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, role: str = "golden values", needs_metrics: bool = False
    ) -> GoldenValues:
        """The file at ``path``; ``GoldenFormatError`` naming it (as ``role``, e.g. the command's EXPECTED) and
        the metric and field where it is missing, empty, not JSON or not Megatron's schema, or (with
        ``needs_metrics``) where it holds no metric to compare or keep."""
        try:
            data = read_json(path, what=role, give=_GOLDEN_FILE)
        except InputError as error:
            raise GoldenFormatError(str(error)) from None
        try:
            values = cls.from_json(data)
        except GoldenFormatError as error:
            raise GoldenFormatError(f"{role} {path}: {error}; give {_GOLDEN_FILE}.") from None
        if needs_metrics and not values.metrics:
            raise GoldenFormatError(f"{role} {path} holds no metrics; give {_GOLDEN_FILE}.")
        return values

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + os.replace) so a crash never leaves a half-written golden."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600, made what open() would have created
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


class MetricsRecorder:
    """Collects per-step metric values during a run and turns them into ``GoldenValues``."""

    def __init__(self) -> None:
        self._values: dict[str, dict[int, float]] = {}

    def record(self, step: int, values: Mapping[str, float]) -> None:
        """Record ``values`` (metric name -> number) at ``step``; steps must increase per metric.

        Everything is checked before anything is stored, so a rejected call changes nothing.
        """
        if not _is_int(step):
            raise TypeError(f"step must be an int, got {step!r}")
        for name, value in values.items():
            if not _is_number(value):
                raise TypeError(f"metric {name!r} at step {step}: value must be a number, got {value!r}")
            seen = self._values.get(name)
            if seen and step <= next(reversed(seen)):
                raise ValueError(
                    f"metric {name!r}: step {step} is not after the last recorded step "
                    f"{next(reversed(seen))}; steps must be strictly increasing"
                )
        for name, value in values.items():
            self._values.setdefault(name, {})[step] = value

    def golden(self) -> GoldenValues:
        """Snapshot; step_interval is the gcd of step gaps (1 with a single step)."""
        metrics = {}
        for name, vals in self._values.items():
            steps = list(vals)
            interval = math.gcd(*(b - a for a, b in itertools.pairwise(steps))) if len(steps) > 1 else 1
            metrics[name] = MetricSeries(vals, interval)
        return GoldenValues(metrics)


@dataclass(frozen=True)
class Tolerance:
    """How one metric is compared: exactly, or within ``rtol`` per step or on a window's median."""

    rtol: float = 0.0
    exact: bool = False
    median_window: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not (self.rtol >= 0 and math.isfinite(self.rtol)):
            raise ValueError(f"rtol must be finite and >= 0, got {self.rtol!r}")
        if self.median_window is not None and self.median_window[0] > self.median_window[1]:
            raise ValueError(f"median_window {self.median_window} is empty")


def default_tolerances(deterministic: bool) -> dict[str, Tolerance]:
    """Megatron's functional-test thresholds. Timing uses a median from step 5 to skip warm-up."""
    return {
        "lm loss": Tolerance(exact=True) if deterministic else Tolerance(rtol=0.05),
        # The evaluations' lm loss (the farm records it under Megatron's TensorBoard tag): held like the training one.
        "lm loss validation": Tolerance(exact=True) if deterministic else Tolerance(rtol=0.05),
        "mtp_1 loss": Tolerance(exact=True) if deterministic else Tolerance(rtol=0.05),
        "num-zeros": Tolerance(rtol=0.20),
        "iteration-time": Tolerance(rtol=0.05, median_window=(5, 20)),
        "mem-allocated-bytes": Tolerance(rtol=0.05),
        "mem-max-allocated-bytes": Tolerance(rtol=0.05),
    }


@dataclass(frozen=True)
class Mismatch:
    """One failed check. ``step`` is None for median checks and whole-metric problems."""

    metric: str
    step: int | None
    expected: float | None
    actual: float | None
    rule: str

    def __str__(self) -> str:
        where = self.metric if self.step is None else f"{self.metric} step {self.step}"
        if self.expected is None and self.actual is None:
            return f"{where}: {self.rule}"
        if self.actual is None:
            return f"{where}: expected {self.expected!r}, {self.rule}"
        return f"{where}: expected {self.expected!r}, actual {self.actual!r} ({self.rule})"


def _within(e: float, a: float, tol: Tolerance) -> bool:
    if tol.exact:
        return a == e or (math.isnan(a) and math.isnan(e))
    # |a-e| <= rtol*|e|: e == 0 demands a == 0; any NaN fails; infinities must be equal
    # (inf <= rtol*inf would otherwise let +inf match -inf).
    if not (math.isfinite(e) and math.isfinite(a)):
        return a == e
    return abs(a - e) <= tol.rtol * abs(e)


def _median(values: list[float]) -> float:
    # statistics.median is meaningless with NaNs (sorting is undefined), so propagate NaN.
    return math.nan if any(math.isnan(v) for v in values) else statistics.median(values)


def compare(
    expected: GoldenValues,
    actual: GoldenValues,
    *,
    deterministic: bool,
    metrics: Iterable[str] | None = None,
    tolerances: Mapping[str, Tolerance] | None = None,
) -> list[Mismatch]:
    """Check ``actual`` against ``expected``; returns every mismatch (empty list = pass).

    Only metrics in ``expected`` (or the ``metrics`` subset) are checked; a subset name absent from
    ``expected`` is reported, since the golden file then needs an update. Steps only in ``actual``
    are ignored (a run may go longer). ``tolerances`` override ``default_tolerances(deterministic)``.
    """
    tols = {**default_tolerances(deterministic), **(tolerances or {})}
    names = list(expected.metrics) if metrics is None else list(dict.fromkeys(metrics))
    unknown = [name for name in names if name not in tols]
    if unknown:  # fail before comparing anything: a partial report would mislead
        raise ValueError(_unknown_metrics(unknown, expected, tols))
    out: list[Mismatch] = []
    for name in names:
        tol, exp, act = tols[name], expected.metrics.get(name), actual.metrics.get(name)
        if exp is None:
            out.append(Mismatch(name, None, None, None, "missing in expected"))
            continue
        if act is None:
            out.append(Mismatch(name, None, None, None, "missing in actual"))
            continue
        rule = "exact" if tol.exact else f"rtol {tol.rtol:g}"
        if tol.median_window is not None:
            lo, hi = tol.median_window
            steps = [s for s in exp.values if lo <= s <= hi and s in act.values]
            if not steps:
                out.append(Mismatch(name, None, None, None, f"no steps {lo}-{hi} in both files"))
                continue
            e = _median([exp.values[s] for s in steps])
            a = _median([act.values[s] for s in steps])
            if not _within(e, a, tol):
                out.append(Mismatch(name, None, e, a, f"median steps {steps[0]}-{steps[-1]}, {rule}"))
            continue
        for step, e in exp.values.items():
            if step not in act.values:
                out.append(Mismatch(name, step, e, None, "missing in actual"))
            elif not _within(e, act.values[step], tol):
                out.append(Mismatch(name, step, e, act.values[step], rule))
    return out


def _unknown_metrics(unknown: list[str], expected: GoldenValues, tolerances: Mapping[str, Tolerance]) -> str:
    known = list(dict.fromkeys([*expected.metrics, *tolerances]))
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        named.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"unknown metric {', '.join(named)}: the expected file has {', '.join(map(repr, expected.metrics))}, "
        f"and there are thresholds for {', '.join(map(repr, tolerances))} (names with spaces need quotes: "
        "'lm loss')."
    )


def format_report(mismatches: Iterable[Mismatch]) -> str:
    """Human-readable summary for CI logs: one line per mismatch under a count header."""
    items = list(mismatches)
    if not items:
        return "golden values match"
    noun = "mismatch" if len(items) == 1 else "mismatches"
    return "\n".join([f"{len(items)} golden value {noun}:", *(f"  {m}" for m in items)])


def update(path: str | os.PathLike[str], actual: GoldenValues, *, role: str = "GOLDEN") -> None:
    """Core of ``golden update``: replace the golden file at ``path`` (the command's ``role``) with ``actual``."""
    require_output_file(role, path)
    actual.save(path)
