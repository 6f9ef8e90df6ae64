"""Rendezvous ports for local launches that run side by side (the matrix's cells and benches).

A port found free by binding port 0 comes from the kernel's ephemeral range, which every other
bind(0) and every outgoing connection draw from too, so between the probe's close and the launch's
own bind a neighbour can take it: a matrix cell's graphed launch lost its rendezvous port
that way ("The connection to the C10d store has failed"). The ports here come from below that
range, which the kernel never hands out by itself; each is handed out once per allocator, and one
that something holds now is skipped. Each process starts at its own block of the range (by process
id), so two drivers on one host do not walk the same ports in step.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["PortAllocator", "ephemeral_start", "port_is_free"]

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LINUX_EPHEMERAL_START = 32768  # the kernel's default, where the file cannot be read
_FIRST_PORT = 20000
_BLOCK = 64  # ports per process block


def ephemeral_start(path: Path = _EPHEMERAL_RANGE) -> int:
    """The lowest port the kernel picks for bind(0) and outgoing connections."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _LINUX_EPHEMERAL_START


def port_is_free(port: int) -> bool:
    """Nothing holds ``port`` on loopback now (a bind without SO_REUSEADDR succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Calling it returns a port no earlier call returned, from ``[first, stop)`` (``stop``: the
    ephemeral range's start), beginning at ``start`` (default: this process's block) and wrapping
    once; thread-safe. Raises ``RuntimeError`` when every port was handed out or is held."""

    def __init__(
        self,
        *,
        first: int = _FIRST_PORT,
        stop: int | None = None,
        start: int | None = None,
        is_free: Callable[[int], bool] = port_is_free,
    ) -> None:
        stop = ephemeral_start() if stop is None else stop
        if not 0 < first < stop:
            raise ValueError(f"ports [{first}, {stop}): the range is empty or below the ephemeral range's start.")
        blocks = max(1, (stop - first) // _BLOCK)
        start = first + (os.getpid() % blocks) * _BLOCK if start is None else start
        if not first <= start < stop:
            raise ValueError(f"start {start} is outside [{first}, {stop}).")
        self.first, self.stop = first, stop
        self._order = iter([*range(start, stop), *range(first, start)])
        self._is_free = is_free
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            for port in self._order:
                if self._is_free(port):
                    return port
        raise RuntimeError(f"no free port left in [{self.first}, {self.stop}) for another launch.")
