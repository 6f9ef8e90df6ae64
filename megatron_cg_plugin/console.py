"""What the plugin's own entry points print: the cause of a failure first, not Megatron's noise.

- Megatron warns at import about every optional package it lacks (APEX, absl, TE on a CPU host:
  about 10 warnings), and torch logs that a CPU host has no CUDA runtime; none of that is a
  cause. ``hide_optional_package_warnings`` hides those only: every other warning still shows.
- Megatron's ``validate_args`` prints every argument (about 850 lines) before the plugin's rules
  run. ``megatron_printout_held`` holds that printout back: printed as usual when the flags pass,
  written to a log file when the run stops there, so the refusal is what the terminal shows.
- ``failure_cause`` finds the line worth reading in a failed rank's output (the farm prints it
  before and after the rank's log tail).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_BUG",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "failure_cause",
    "group_label",
    "hide_optional_package_warnings",
    "megatron_printout_held",
]

# Megatron's import-time notes about optional packages (megatron-core 0.19.2's wording); on a
# CPU host TE's version reads 0.0.0, which only says TE is missing.
_OPTIONAL_PACKAGE_WARNING = r".*(is not installed|are not installed|Falling back to|your version is 0\.0\.0)"
_NO_CUDA_RUNTIME = "No CUDA runtime is found"  # torch.utils.cpp_extension on a host without a GPU
_PLUGIN_PREFIX = "megatron-cg-plugin:"
# The entry points' exit codes: done, a mismatch or failure found, input refused (the flag named), a bug of the
# plugin's own (its traceback shown, and said to be one).
EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_BUG = 0, 1, 2, 3


def group_label(group: object) -> str:
    """A process group named in a message by identity (two groups of equal ranks are different
    communicators)."""
    return "None" if group is None else f"{type(group).__name__}@{id(group):#x}"


# The last line of a Python traceback: ``ValueError: ...``, ``torch.OutOfMemoryError: ...``.
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)?(Error|Exception|Exit|Interrupt|Failure|Violation)\b(: .*)?$")


class _HideNoCudaRuntime(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_NO_CUDA_RUNTIME)


def hide_optional_package_warnings() -> None:
    """Hides Megatron's warnings about optional packages it lacks, and torch's note that this host
    has no CUDA runtime, for the rest of the process (idempotent)."""
    warnings.filterwarnings("ignore", message=_OPTIONAL_PACKAGE_WARNING, category=UserWarning, module=r"megatron\.")
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _HideNoCudaRuntime) for f in logger.filters):
        logger.addFilter(_HideNoCudaRuntime())


def _keep_log(text: str) -> str | None:
    if not text.strip():
        return None
    with tempfile.NamedTemporaryFile("w", prefix="megatron-cg-args-", suffix=".log", delete=False) as log:
        log.write(text)
    return log.name


@contextlib.contextmanager
def megatron_printout_held() -> Iterator[None]:
    """Holds back what the block prints (Megatron's argument printout) and warns: all of it comes out
    as it would have when the block succeeds. When it fails (a refusal, a parse error), stdout and the
    warnings go to a log file instead, and the block's stderr (the cause) is printed, then one line
    naming the log; an exception the caller reports (not a ``SystemExit``) carries that line as a note
    instead, so that its own message stays the first line. Nested blocks hold nothing of their own: the
    outermost decides (the launcher holds its own checks after Megatron's validation, which the plugin's
    validate-args hook holds in any script)."""
    global _holding
    if _holding:
        yield
        return
    _holding = True
    out, err = io.StringIO(), io.StringIO()
    caught: list[warnings.WarningMessage] = []
    try:
        with (
            _root_log_streams_held(out, err),
            warnings.catch_warnings(record=True) as caught,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            yield
    except BaseException as error:
        if not (isinstance(error, SystemExit) and error.code in (None, 0)):
            _report_failure(out.getvalue(), err.getvalue(), caught, error)
            raise
        _release(out.getvalue(), err.getvalue(), caught)
        raise
    finally:
        _holding = False
    _release(out.getvalue(), err.getvalue(), caught)


_holding = False  # a megatron_printout_held block is open


@contextlib.contextmanager
def _root_log_streams_held(out: io.StringIO, err: io.StringIO) -> Iterator[None]:
    """The root logger's console handlers write to ``out`` / ``err`` inside the block (Megatron's training
    module logs its set-up to the stdout it found at import, which ``redirect_stdout`` does not reach)."""
    held = {sys.stdout: out, sys.__stdout__: out, sys.stderr: err, sys.__stderr__: err}
    saved = []
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.StreamHandler) and stream in held:
            saved.append((handler, handler.setStream(held[stream])))
    try:
        yield
    finally:
        for handler, stream in saved:
            handler.setStream(stream)


def _release(out: str, err: str, caught: list[warnings.WarningMessage]) -> None:
    sys.stdout.write(out)
    sys.stdout.flush()
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    sys.stderr.write(err)


def _report_failure(out: str, err: str, caught: list[warnings.WarningMessage], error: BaseException) -> None:
    notes = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    log = _keep_log(out + notes)
    sys.stderr.write(err)
    if log is None:
        return
    line = f"{_PLUGIN_PREFIX} Megatron's printout of the arguments and its warnings: {log}"
    if isinstance(error, SystemExit):  # the refusal is printed above (err): the log comes after it
        print(line, file=sys.stderr, flush=True)
    else:
        error.add_note(line)


def failure_cause(text: str) -> str | None:
    """The line worth reading in a failed process's output: the plugin's refusal (with its rule
    lines), else the last exception line of a traceback; None when neither is there."""
    lines = [line.rstrip() for line in text.splitlines()]
    refusals = [i for i, line in enumerate(lines) if line.startswith(_PLUGIN_PREFIX)]
    if refusals:
        start = refusals[0]
        return "\n".join([lines[start], *_indented_after(lines, start)])
    exceptions = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return exceptions[-1] if exceptions else None


def _indented_after(lines: list[str], start: int) -> Iterator[str]:
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            return
        yield line
