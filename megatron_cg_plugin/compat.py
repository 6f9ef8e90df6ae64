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
from typing import Callable, Iterable

SUPPORTED_MEGATRON_CORE = ((0, 19, 2), (0, 20, 0))  # [min, max)
SUPPORTED_TRANSFORMER_ENGINE = ((2, 20, 0), (2, 21, 0))
MIN_TORCH = (2, 9, 0)


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
    if parse_version(versions.torch) < MIN_TORCH:
        raise UnsupportedVersionError(
            f"torch {versions.torch} is too old: megatron-cg-plugin needs torch >= {_fmt(MIN_TORCH)}."
        )
    low, high = SUPPORTED_MEGATRON_CORE
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
    describes the sm_90 host it checks for through ``cli.gpu_host_stand_ins``)."""
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


def check_parameters(target: Callable, expected: Iterable[str], *, where: str) -> None:
    """Raises ``SignatureMismatchError`` if ``target`` no longer accepts each ``expected`` parameter."""
    params = inspect.signature(target).parameters
    missing = [name for name in expected if name not in params]
    if missing:
        raise SignatureMismatchError(
            f"{where} no longer takes parameter(s) {', '.join(missing)} (has: {', '.join(params)}). "
            "This megatron-core/TE build differs from the supported release; install the supported "
            "versions listed in docs/versions.md."
        )
