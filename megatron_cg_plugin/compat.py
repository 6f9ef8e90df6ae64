"""Version and signature probes for torch, megatron-core and Transformer Engine.

The plugin patches and subclasses internals of megatron-core 0.19.2 and TE 2.20.x; on any other
release those internals may have moved, so ``install()`` refuses to run rather than misbehave.
Pure version logic is separate from the probes so it is testable without the packages.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "SUPPORTED_TRANSFORMER_ENGINE",
    "SignatureMismatchError",
    "UnsupportedVersionError",
    "Versions",
    "apex_fused_wgrad_available",
    "check_parameters",
    "check_versions",
    "device_capability",
    "distribution_version",
    "found_at",
    "installed_versions",
    "parse_version",
    "te_available",
    "torch_cuda_version",
    "unwrapped",
]

_SUPPORTED_MEGATRON_CORE = ((0, 19, 2), (0, 20, 0))  # [min, max)
SUPPORTED_TRANSFORMER_ENGINE = ((2, 20, 0), (2, 21, 0))
_MIN_TORCH = (2, 9, 0)


class UnsupportedVersionError(RuntimeError):
    """A dependency is outside the range this plugin release was built and tested against."""


class SignatureMismatchError(RuntimeError):
    """A Megatron/TE function the plugin hooks no longer has the parameters the plugin relies on."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``'2.20.2+cu130'`` -> ``(2, 20, 2)``; local and pre-release suffixes are ignored."""
    match = re.match(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"cannot read a version number from {text!r}")
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


@dataclasses.dataclass(frozen=True)
class Versions:
    torch: str
    megatron_core: str | None
    transformer_engine: str | None


def check_versions(versions: Versions, *, require_te: bool) -> None:
    """Raises ``UnsupportedVersionError`` naming the supported range of the first offending package."""
    if parse_version(versions.torch) < _MIN_TORCH:
        raise UnsupportedVersionError(
            f"torch {versions.torch} is too old: megatron-cg-plugin needs torch >= {_fmt(_MIN_TORCH)}."
        )
    low, high = _SUPPORTED_MEGATRON_CORE
    if versions.megatron_core is None:
        raise UnsupportedVersionError(
            f"megatron-core is not installed: install megatron-core>={_fmt(low)},<{_fmt(high)}."
        )
    if not low <= parse_version(versions.megatron_core) < high:
        raise UnsupportedVersionError(
            f"megatron-core {versions.megatron_core} is not supported: this plugin release supports "
            f"megatron-core>={_fmt(low)},<{_fmt(high)}. Install a supported megatron-core or a plugin "
            "release built for yours."
        )
    low, high = SUPPORTED_TRANSFORMER_ENGINE
    if versions.transformer_engine is None:
        if require_te:
            raise UnsupportedVersionError(
                "Transformer Engine is not installed, but --cuda-graph-impl transformer_engine needs it: "
                f"pip install 'megatron-cg-plugin[te]' (transformer-engine>={_fmt(low)},<{_fmt(high)})."
            )
        return
    if not low <= parse_version(versions.transformer_engine) < high:
        raise UnsupportedVersionError(
            f"transformer-engine {versions.transformer_engine} is not supported: this plugin release "
            f"supports transformer-engine>={_fmt(low)},<{_fmt(high)}."
        )


def distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_versions() -> Versions:
    """Reads versions from package metadata; never imports Transformer Engine (slow, needs CUDA)."""
    import torch

    return Versions(
        torch=torch.__version__,
        megatron_core=distribution_version("megatron-core", "megatron_core"),
        transformer_engine=distribution_version("transformer-engine", "transformer_engine"),
    )


def te_available() -> bool:
    """Transformer Engine is importable (found without importing it: that is slow and needs CUDA)."""
    return importlib.util.find_spec("transformer_engine") is not None


def device_capability() -> tuple[int, int] | None:
    """The current GPU's compute capability; None where there is none (``megatron-cg check`` on CPU
    describes the sm_90 host it checks for through ``host_stand_ins.gpu_host_stand_ins``)."""
    import torch

    try:
        major, minor = torch.cuda.get_device_capability()
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA driver or device here
        return None
    return int(major), int(minor)


def torch_cuda_version() -> tuple[int, int] | None:
    """The CUDA release torch was built with (None for a CPU build)."""
    import torch

    return None if not torch.version.cuda else parse_version(torch.version.cuda)[:2]


def apex_fused_wgrad_available() -> bool:
    """APEX's fused weight-gradient kernel, which --gradient-accumulation-fusion needs."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


# Where a private function the plugin checks comes from: a ``where`` or ``__module__`` under one of
# these roots is that library's own.
_LIBRARIES = {"megatron": "megatron-core", "transformer_engine": "Transformer Engine", "torch": "torch"}
_MAX_WRAPPERS = 100  # a longer __wrapped__ chain is taken for a loop


def check_parameters(target: Callable, expected: Iterable[str], *, where: str) -> None:
    """Raises ``SignatureMismatchError`` if ``target`` no longer accepts each ``expected`` parameter.

    A wrapper passes when the function at the end of its ``__wrapped__`` chain takes them (a
    ``functools.wraps`` wrapper with ``*args, **kwargs`` forwards them). The error names the object
    found and blames the build only when that object is the library's own (``found_at``)."""
    expected = tuple(expected)
    if not expected:
        return  # nothing is relied on
    inner = unwrapped(target)
    signatures = [
        names for names in map(_parameter_names, (target,) if inner is target else (target, inner)) if names is not None
    ]
    if any(all(name in names for name in expected) for names in signatures):
        return
    has = signatures[-1] if signatures else ()  # the innermost readable one: what really runs
    missing = [name for name in expected if name not in has]
    listed = ", ".join(has) if signatures else "no signature to read"
    raise SignatureMismatchError(
        f"{where} no longer takes parameter(s) {', '.join(missing)} (has: {listed}). {found_at(target, where)}"
    )


def unwrapped(target: Any) -> Any:
    """The object at the end of ``target``'s ``__wrapped__`` chain (``functools.wraps`` sets it);
    ``target`` itself where it wraps nothing. A loop, or an attribute that raises, ends the chain
    where it is."""
    seen = {id(target)}
    for _ in range(_MAX_WRAPPERS):
        inner = _attribute(target, "__wrapped__")
        if inner is None or id(inner) in seen:
            return target
        seen.add(id(inner))
        target = inner
    return target


def found_at(target: Any, where: str) -> str:
    """For a refusal: the object found at ``where`` (and what it wraps), and whether it is the
    library's own (this build differs from the supported release) or defined elsewhere (a wrapper
    another library or the user put there, which a reinstall would not change)."""
    inner = unwrapped(target)
    found = _qualified_name(target) + ("" if inner is target else f", which wraps {_qualified_name(inner)}")
    library = _library_of(where)
    if _is_from(inner, library):
        return (
            f"Found {found}: this {library or 'megatron-core/TE'} build differs from the supported release; "
            "install the supported versions listed in docs/versions.md."
        )
    return (
        f"Found {found}, defined outside {library or 'megatron-core, TE and torch'}: it looks wrapped by another "
        "library or your own patch; apply that patch after megatron_cg_plugin.install(), or remove it (a wrapper "
        "made with functools.wraps(original) is checked through to the function it wraps)."
    )


def _parameter_names(target: Any) -> tuple[str, ...] | None:
    """``target``'s own parameter names (``__wrapped__`` is followed by the caller); None where it
    carries no signature (a builtin)."""
    try:
        return tuple(inspect.signature(target, follow_wrapped=False).parameters)
    except (TypeError, ValueError):
        return None


def _attribute(target: Any, name: str) -> Any:
    """``getattr(target, name, None)``, also for proxies whose attribute access raises."""
    try:
        return getattr(target, name, None)
    except Exception:  # noqa: BLE001 - a proxy that refuses is one that carries nothing to follow
        return None


def _qualified_name(target: Any) -> str:
    module = _attribute(target, "__module__")
    qualname = _attribute(target, "__qualname__") or f"{type(target).__qualname__} instance"
    return f"{module}.{qualname}" if isinstance(module, str) else str(qualname)


def _library_of(where: str) -> str | None:
    """The library ``where`` (``module.attribute`` or ``module:attribute``) names; None if it names no module."""
    return _LIBRARIES.get(re.split(r"[.:]", where, maxsplit=1)[0])


def _is_from(target: Any, library: str | None) -> bool:
    """Whether ``target`` is defined in ``library`` (in any of them where it is None)."""
    module = _attribute(target, "__module__")
    roots = [root for root, name in _LIBRARIES.items() if library in (None, name)]
    return isinstance(module, str) and any(module == root or module.startswith(root + ".") for root in roots)
