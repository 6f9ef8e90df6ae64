"""The checks every command makes of what a user hands it, one helper per kind: an output path (a file or
a folder the run will write), a JSON input file and the fields of its records, a number that must be
positive, a checkout named by an environment variable, and the environment variables that torch, NCCL and
CUDA read where a run starts. Each says, in one line, which flag, file or variable is wrong, how, and what
to give instead: a command raises it (``InputError``, a ``ValueError``) before any long work starts, and
the rules (``rules.RULES``) report the environment's and the output folders' problems.

Pure Python (no torch): the golden-values commands and the rules run without it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ALLOCATOR_VARIABLES",
    "InputError",
    "PROCESS_VARIABLES",
    "allocator_config_problems",
    "checkout_from_environment",
    "environment_problems",
    "expandable_segments",
    "input_path_problem",
    "output_file_problem",
    "output_folder_problem",
    "positive",
    "read_json",
    "require_fields",
    "require_output_file",
    "require_output_folder",
]


_Path = str | os.PathLike[str]


class InputError(ValueError):
    """A flag, file or variable a command cannot use; the message names it and what to give."""


# -- output paths --------------------------------------------------------------------------------


def _blocking_file(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` that is a file (nothing can be created under it)."""
    return next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)


def _unwritable(path: Path) -> Path | None:
    """``path`` itself where it exists and cannot be written, else its nearest existing folder where that
    cannot be written (the run would create what is missing in it); None where writing can start."""
    existing = next((candidate for candidate in (path, *path.parents) if candidate.exists()), None)
    if existing is None or os.access(existing, os.W_OK | (os.X_OK if existing.is_dir() else 0)):
        return None
    return existing


def input_path_problem(what: str, path: _Path, *, folder: bool) -> str | None:
    """What keeps a command from reading the file (or with ``folder`` the folder) the user named as ``what``
    (None: nothing): an empty path, which a Path reads as the current folder, a path that does not exist, or
    one of the other kind."""
    text = os.fspath(path)
    if not text.strip():
        return f"{what} is empty; give its path."
    path = Path(text)
    if not path.exists():
        return f"{what} {path} does not exist; give the path of an existing {'folder' if folder else 'file'}."
    if folder and not path.is_dir():
        return f"{what} {path} is a file; give the folder that holds it ({path.parent})."
    if not folder and not path.is_file():
        return f"{what} {path} is a folder; give the path of a file in it."
    return None


def output_file_problem(flag: str, path: _Path | None) -> str | None:
    """What keeps a run from writing the file ``flag`` names (None: nothing): an empty path, a folder, a
    path under a file or in a folder it cannot write. Missing folders on the way are created."""
    if path is None:
        return None
    if os.fspath(path).strip() in ("", "."):
        return f"{flag} is empty; give a file path such as out.json."
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path} is a directory; give a file path such as {path / 'out.json'}."
    return _place_problem(flag, path, "a path in a folder you can write")


def output_folder_problem(flag: str, path: _Path | None) -> str | None:
    """What keeps a run from writing into the folder ``flag`` names (None: nothing): an empty path, an
    existing file, a path under a file or where it cannot write. A missing folder is created."""
    if path is None:
        return None
    if not os.fspath(path).strip():
        return f"{flag} is empty; give a folder path such as {flag.lstrip('-').split('-')[-1]}-out."
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{flag} {path} is a file; give a folder path (a new folder, or an existing one)."
    return _place_problem(flag, path, "a folder you can write")


def _place_problem(flag: str, path: Path, writable: str) -> str | None:
    """Where ``path`` cannot be made: under a file, or in a folder it cannot write (``writable``: what to give)."""
    blocking = _blocking_file(path)
    if blocking is not None:
        return f"{flag} {path} lies under {blocking}, which is a file; give a path in a folder."
    unwritable = _unwritable(path)
    if unwritable is not None:
        return f"{flag} {path}: {unwritable} is not writable; give {writable}."
    return None


def require_output_file(flag: str, path: _Path | None) -> None:
    problem = output_file_problem(flag, path)
    if problem is not None:
        raise InputError(problem)


def require_output_folder(flag: str, path: _Path | None) -> None:
    problem = output_folder_problem(flag, path)
    if problem is not None:
        raise InputError(problem)


# -- input files and their records ---------------------------------------------------------------


def read_json(path: _Path, *, what: str, give: str) -> Any:
    """The JSON in ``path``; an ``InputError`` naming the file (``what``: its role, such as "the cells file")
    when it is missing, a folder, empty or not JSON, and saying what to ``give`` instead."""
    path = Path(path)
    if not os.fspath(path).strip():
        raise InputError(f"{what} is an empty path; give {give}.")
    if not path.exists():
        raise InputError(f"{what} {path} does not exist; give {give}.")
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder; give {give}.")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise InputError(f"{what} {path} is empty; give {give}.")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(
            f"{what} {path} is not JSON ({error.msg}, line {error.lineno} column {error.colno}); give {give}."
        ) from None


_KIND_WORDS = {dict: "an object", list: "a list", str: "a string", int: "a whole number", float: "a number"}


def require_fields(record: Any, fields: Mapping[str, type | tuple[type, ...]], *, where: str, give: str) -> Any:
    """``record`` when it is an object holding each of ``fields`` with a value of its type; else an
    ``InputError`` naming ``where`` (the file and the record) and the field, and saying what to ``give``."""
    if not isinstance(record, Mapping):
        raise InputError(
            f"{where} is {_kind_of(record)}, not an object with the fields {', '.join(fields)}; give {give}."
        )
    for name, kind in fields.items():
        if name not in record:
            raise InputError(f"{where} lacks the field {name!r}; give {give}.")
        value = record[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
            words = " or ".join(_KIND_WORDS.get(k, k.__name__) for k in _kinds(kind))
            raise InputError(f"{where}: field {name!r} is {_kind_of(value)}, not {words}; give {give}.")
    return record


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_of(value: Any) -> str:
    kind = type(value)
    return "null" if value is None else _KIND_WORDS.get(kind, f"a {kind.__name__}") + f" ({value!r})"[:60]


# -- numbers -------------------------------------------------------------------------------------


def positive(flag: str, value: float, meaning: str) -> None:
    """A count or a duration that must be above 0 (and finite); ``meaning`` says what it counts."""
    if not (math.isfinite(value) and value > 0):
        raise InputError(f"{flag} {value:g} must be a positive number ({meaning}).")


# -- environment ---------------------------------------------------------------------------------


def checkout_from_environment(name: str, environ: Mapping[str, str], *, what: str) -> str | None:
    """The folder the variable ``name`` names (None: unset). Set but empty it is refused, where a path joined
    to it would silently be one in the current folder."""
    value = environ.get(name)
    if value is None:
        return None
    if not value.strip():
        raise InputError(f"{name} is set but empty; set it to {what}, or unset it.")
    return value


# Variables a process-group launcher (torchrun, the farm's, the plugin's one-process rendezvous) sets: what
# each must be, as torch.distributed and Megatron read them with int().
PROCESS_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")
_WHOLE_NUMBERS = {
    "WORLD_SIZE": (1, None, "the number of ranks, 1 or more"),
    "RANK": (0, None, "this process's rank, from 0"),
    "LOCAL_RANK": (0, None, "this process's rank on its host, from 0"),
    "MASTER_PORT": (1, 65535, "the rendezvous port, 1 to 65535"),
    # CUDA reads it as a whole number of hardware work queues (Megatron sets 1 for its overlaps).
    "CUDA_DEVICE_MAX_CONNECTIONS": (1, None, "a whole number of connections, 1 or more"),
}
# The allocator settings torch reads, in the order it reads them (PYTORCH_ALLOC_CONF, torch 2.9's name, and
# the CUDA one it still takes).
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _whole_number(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def environment_problems(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Each variable of ``environ`` that torch, NCCL, CUDA or Megatron would refuse or misread where a run
    starts, as ``NAME=value`` and what to give: the rendezvous numbers, CUDA's connection count and the
    caching allocator's settings (``allocator_config_problems``)."""
    problems = []
    for name, (least, most, meaning) in _WHOLE_NUMBERS.items():
        if name not in environ:
            continue
        value = _whole_number(environ[name])
        if value is None or value < least or (most is not None and value > most):
            problems.append(f"{name}={environ[name]!r} (give {meaning})")
    rank, world = _whole_number(environ.get("RANK", "0")), _whole_number(environ.get("WORLD_SIZE", "1"))
    if rank is not None and world is not None and world >= 1 and rank >= world:
        problems.append(f"RANK={rank} with WORLD_SIZE={world} (give a rank below the world size)")
    for name in ALLOCATOR_VARIABLES:
        problems += [f"{name}={environ[name]!r}: {problem}" for problem in allocator_config_problems(environ.get(name))]
    return tuple(problems)


# The caching allocator's keys (torch 2.9 to 2.14: c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp)
# and what each value must be; torch stops at the first CUDA allocation with an error for anything else.
_ALLOCATOR_SWITCHES = frozenset(
    {
        "expandable_segments",
        "pinned_use_background_threads",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",  # torch takes ROCm's names on CUDA too
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "graph_capture_record_stream_reuse",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    }
)
_ALLOCATOR_KEYS = _ALLOCATOR_SWITCHES | {
    "backend",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "per_process_memory_fraction",
    "large_segment_size_mb",
}
_ALLOCATOR_BACKENDS = ("native", "cudaMallocAsync")
_LARGE_BUFFER_MB = 20  # torch's kLargeBuffer: the smallest split sizes it takes
_MAX_REGISTER_THREADS = 128  # torch's pinned_max_register_threads
_TOKEN = re.compile(r"[,:\[\]]|[^,:\[\]]+")


def _tokens(config: str) -> list[str]:
    """torch's ConfigTokenizer: the separators , : [ ] as tokens of their own, whitespace dropped."""
    return [token for token in _TOKEN.findall("".join(config.split())) if token]


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _allocator_value_problem(key: str, value: str) -> str | None:
    """What torch would say of ``key:value`` (None: it takes it)."""
    number = _whole_number(value) if value.isdigit() else None
    if key in _ALLOCATOR_SWITCHES:
        return None if value in ("True", "False") else f"{key} takes True or False, not {value!r}"
    if key == "backend":
        return (
            None if value in _ALLOCATOR_BACKENDS else f"backend takes {' or '.join(_ALLOCATOR_BACKENDS)}, not {value!r}"
        )
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        if number is None or number < _LARGE_BUFFER_MB:
            return f"{key} takes a whole number of MiB, {_LARGE_BUFFER_MB} or more, not {value!r}"
    elif key == "garbage_collection_threshold":
        try:
            threshold = float(value)
        except ValueError:
            threshold = math.nan
        if not 0 < threshold < 1:
            return f"garbage_collection_threshold takes a fraction between 0 and 1 (both excluded), not {value!r}"
    elif key == "roundup_power2_divisions":  # the single-value form; the [size:divisions,...] form is apart
        if number is None or not _is_power_of_two(number):
            return f"roundup_power2_divisions takes a power of two, or [size:divisions,...], not {value!r}"
    elif key == "pinned_num_register_threads":
        if number is None or not _is_power_of_two(number) or number > _MAX_REGISTER_THREADS:
            return f"pinned_num_register_threads takes a power of two up to {_MAX_REGISTER_THREADS}, not {value!r}"
    elif key in ("pinned_reserve_segment_size_mb", "large_segment_size_mb"):
        if number is None or number < 1:
            return f"{key} takes a whole number of MiB, 1 or more, not {value!r}"
    elif key == "per_process_memory_fraction":
        try:
            float(value)
        except ValueError:
            return f"per_process_memory_fraction takes a number, not {value!r}"
    return None


def _roundup_list_problem(items: list[str]) -> str | None:
    """roundup_power2_divisions:[size:divisions,...,>:divisions]: sizes powers of two (or >), divisions 0 or
    powers of two."""
    for index in range(0, len(items), 4):
        entry = items[index : index + 4]
        size, colon, divisions = [*entry, "", "", ""][:3]
        if colon != ":" or (len(entry) == 4 and entry[3] != ","):
            return "roundup_power2_divisions lists size:divisions pairs separated by commas"
        size_ok = size == ">" or (size.isdigit() and _is_power_of_two(int(size)))
        divisions_ok = divisions.isdigit() and (int(divisions) == 0 or _is_power_of_two(int(divisions)))
        if not (size_ok and divisions_ok):
            return (
                f"roundup_power2_divisions [{size}:{divisions}]: sizes are powers of two (or >) and divisions 0 "
                "or powers of two"
            )
    return None


def allocator_config_problems(config: str | None) -> list[str]:
    """What torch's caching allocator refuses in ``config`` (``key:value,key:value``), one line each."""
    if config is None:
        return []
    tokens, problems, index = _tokens(config), [], 0
    while index < len(tokens):
        key = tokens[index]
        if key not in _ALLOCATOR_KEYS:
            problems.append(f"{key!r} is not a key torch's allocator takes ({', '.join(sorted(_ALLOCATOR_KEYS))})")
            break
        if tokens[index + 1 : index + 2] != [":"] or index + 2 >= len(tokens):
            problems.append(f"{key} needs a value: {key}:VALUE")
            break
        if tokens[index + 2] == "[":
            end = tokens.index("]", index) if "]" in tokens[index:] else None
            if end is None or key != "roundup_power2_divisions":
                problems.append(f"{key} takes a single value, not a list" if end else f"{key}: a [ list is not closed")
                break
            problem = _roundup_list_problem(tokens[index + 3 : end])
            index = end + 1
        else:
            problem = _allocator_value_problem(key, tokens[index + 2])
            index += 3
        if problem is not None:
            problems.append(problem)
        if index < len(tokens) and tokens[index] != ",":
            problems.append(f"settings are separated by commas (key:value,key:value), not {tokens[index]!r}")
            break
        index += 1
    return problems


def expandable_segments(environ: Mapping[str, str]) -> bool:
    """An allocator setting asks for growing segments (``expandable_segments:True``, however spaced)."""
    for name in ALLOCATOR_VARIABLES:
        tokens = _tokens(environ.get(name, ""))
        if any(tokens[i : i + 3] == ["expandable_segments", ":", "True"] for i in range(len(tokens))):
            return True
    return False
