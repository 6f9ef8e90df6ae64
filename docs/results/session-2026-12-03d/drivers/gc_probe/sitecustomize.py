"""Loaded at interpreter start when this folder is on PYTHONPATH (s90's drivers only): with CG_GC_LOG=PREFIX
set, every garbage collection's generation and seconds are summed per generation and written to
PREFIX.<pid>.json at exit, to tell whether the host-bound steps' slow modes are the collector's."""
import atexit
import gc
import json
import os
import time

_PREFIX = os.environ.get("CG_GC_LOG")
if _PREFIX:
    _totals: dict = {}
    _started: list = []

    def _on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            _started[:] = [time.perf_counter()]
            return
        if not _started:
            return
        seconds = time.perf_counter() - _started[0]
        entry = _totals.setdefault(str(info["generation"]), {"count": 0, "seconds": 0.0, "max_seconds": 0.0})
        entry["count"] += 1
        entry["seconds"] += seconds
        entry["max_seconds"] = max(entry["max_seconds"], seconds)

    def _write() -> None:
        with open(f"{_PREFIX}.{os.getpid()}.json", "w") as file:
            json.dump({"wall_seconds_since_start": time.perf_counter() - _T0, "by_generation": _totals,
                       "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}, file, indent=1)

    _T0 = time.perf_counter()
    gc.callbacks.append(_on_gc)
    atexit.register(_write)
