"""``megatron-cg run [--nproc-per-node N] SCRIPT [ARGS...]``: an unmodified Megatron training script
(Megatron-LM's ``pretrain_gpt.py``, ``pretrain_mamba.py``, your own) with the plugin installed.

The script runs as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS``
sets them, after ``install()``: its parser accepts the ``--cg-*`` flags (``--cg-preset`` puts a
preset's Megatron flags before yours, as in the launcher), the plugin's rules run when Megatron
validates the flags, and rank 0 prints the run report when training ends. One process runs
here, with single-process rendezvous variables (no torchrun needed); with ``--nproc-per-node N`` the
ranks are started through ``torch.distributed.run``'s API (a standalone rendezvous on this host,
``NCCL_NVLS_ENABLE=0``), each running this command for one process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from megatron_cg_plugin import compat, console, installation
from megatron_cg_plugin.capture_lifecycle import refusals_reported
from megatron_cg_plugin.inputs import input_path_problem
from megatron_cg_plugin.launch.presets import expand_preset, find_preset
from megatron_cg_plugin.launch.rendezvous import argv_as, single_process_rendezvous
from megatron_cg_plugin.parse_errors import OneLineErrors, reported_as

__all__ = ["EXIT_BAD_INPUT", "expand_preset", "main", "parser", "run_in_process"]

EXIT_BAD_INPUT = console.EXIT_BAD_INPUT
_RANK_ENTRY = "megatron_cg_plugin.launch.run_script"


def parser() -> argparse.ArgumentParser:
    result = OneLineErrors(
        prog="megatron-cg run", description="Run a Megatron training script with megatron-cg-plugin installed."
    )
    result.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="ranks on this host (default 1: this process, no torchrun needed)",
    )
    result.add_argument("script", help="the training script, e.g. Megatron-LM's pretrain_gpt.py")
    result.add_argument("args", nargs=argparse.REMAINDER, help="the script's flags (Megatron's and --cg-*)")
    return result


@contextlib.contextmanager
def _script_search_path(script: Path) -> Iterator[None]:
    """``sys.path[0]`` is the script's folder, as ``python SCRIPT`` makes it (its sibling modules,
    such as Megatron-LM's ``gpt_builders``, import from there)."""
    saved = list(sys.path)
    sys.path[0:1] = [str(script.resolve().parent)]
    try:
        yield
    finally:
        sys.path[:] = saved


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def run_in_process(script: Path, args: Sequence[str]) -> int:
    """Runs ``script`` in this process with the plugin installed; returns its exit code."""
    with single_process_rendezvous(), argv_as([str(script), *args]), _script_search_path(script):
        try:
            installation.install()
        except (compat.UnsupportedVersionError, compat.SignatureMismatchError) as error:
            print(f"megatron-cg run: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except SystemExit as refused:  # the environment's rules, printed already
            return _exit_code(refused)
        try:
            with refusals_reported("megatron-cg run"):
                runpy.run_path(str(script), run_name="__main__")
        except SystemExit as error:
            return _exit_code(error)
        finally:
            installation.uninstall()
    return 0


def _launch_ranks(nproc: int, script: Path, args: Sequence[str]) -> int:
    """``nproc`` local ranks through ``torch.distributed.run``, each running this command once."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off unless the user's environment turns it on
    # torchrun's own default, set here so that its banner about it does not come before a refusal's cause.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch_args = torchrun.get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", _RANK_ENTRY, str(script), *args]
    )
    try:
        torchrun.run(launch_args)
    except ChildFailedError as failure:
        codes = {rank: info.exitcode for rank, info in sorted(failure.failures.items())}
        ranks = ", ".join(f"rank {rank} (exit code {code})" for rank, code in codes.items())
        if EXIT_BAD_INPUT in codes.values():  # a rank refused the flags (or the host), and said why above
            print(f"megatron-cg run: {script} was refused on {ranks}; the cause is above.", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"megatron-cg run: {script} failed on {ranks}; its output is above.", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    with reported_as("megatron-cg run"):  # the script's parser reads its flags for this command
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    options = parser().parse_args(argv)
    problem = input_path_problem("the training script", options.script, folder=False)
    if problem is not None:
        print(f"megatron-cg run: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    script = Path(options.script)
    if options.nproc_per_node < 1:
        print("megatron-cg run: --nproc-per-node must be >= 1.", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        find_preset(options.args)  # a misspelt preset, named before any rank starts
    except ValueError as error:
        print(f"megatron-cg run: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if options.nproc_per_node == 1:  # each rank expands --cg-preset, as the launcher does
        return run_in_process(script, expand_preset(options.args))
    return _launch_ranks(options.nproc_per_node, script, options.args)


if __name__ == "__main__":
    console.hide_optional_package_warnings()
    sys.exit(main())
