"""Process state a Megatron script expects from its launcher: ``sys.argv``, and the rendezvous
variables torchrun sets. Each is set for the duration of a ``with`` block and put back after.

Megatron initializes ``torch.distributed`` from ``env://``, which needs ``MASTER_ADDR`` and friends
even for one process; a run started as plain ``python`` gets single-process values here, so one
GPU needs no torchrun. Values a launcher already set are kept.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator, MutableMapping, Sequence

__all__ = ["RENDEZVOUS_VARS", "argv_as", "single_process_rendezvous", "single_process_values"]

RENDEZVOUS_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def single_process_values(environ: MutableMapping[str, str], *, port: int | None = None) -> dict[str, str]:
    """The rendezvous variables a lone process lacks (none when a launcher set WORLD_SIZE); its
    store on ``port`` (default: one free now)."""
    if "WORLD_SIZE" in environ:
        return {}
    values = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port() if port is None else port),
    }
    return {key: value for key, value in values.items() if key not in environ}


@contextlib.contextmanager
def single_process_rendezvous(environ: MutableMapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Sets the missing rendezvous variables of a one-process run; yields what it set."""
    environ = os.environ if environ is None else environ
    added = single_process_values(environ)
    environ.update(added)
    try:
        yield added
    finally:
        for key in added:
            environ.pop(key, None)


@contextlib.contextmanager
def argv_as(argv: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` is ``argv`` inside the block (Megatron's parser reads it)."""
    saved = sys.argv
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = saved
