"""The CPU stand-in of ``session-2026-12-04b/drivers/insitu.py`` with two codes in one process: arms
``noop``, ``before`` (the package under ``sys.argv[1]``, e.g. a ``git archive`` of a commit) and
``after`` (the importable one), interleaved cycle by cycle, each cycle a marked step of 4 microbatches
over three Megatron-shaped layers, each check after a forward that pushes it out of cache. Processes
on this host differ more than the codes do (a noop of 0.5 to 2.9 us); one process compares them.
Usage: ``PYTHONPATH=. python insitu_ab.py ROOT_BEFORE [CYCLES]``. Host microseconds a check."""
import importlib
import pathlib
import sys

import torch


def load(root: str | None):
    """``contracts``, ``ContractCheck`` and ``StepMarks`` of the package under ``root`` (None: the
    importable one), its modules then dropped from ``sys.modules`` so another copy can load."""
    if root:
        sys.path.insert(0, root)
    try:
        contracts = importlib.import_module("megatron_cg_plugin.capture.contracts")
        found = contracts, importlib.import_module("megatron_cg_plugin.config").ContractCheck
    finally:
        if root:
            sys.path.remove(root)
            for name in [name for name in sys.modules if name.startswith("megatron_cg_plugin")]:
                del sys.modules[name]
    return found


CODES = {"before": load(sys.argv[1]), "after": load(None)}
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "session-2026-12-04b" / "drivers"))
import insitu  # noqa: E402  (the stand-in's model, layers and loop, over the importable copy)


def checker(arm):
    if arm == "noop":
        return lambda args, kwargs: None
    contracts, contract_check = CODES[arm]
    hidden, layer = torch.zeros(4, 2, 8, requires_grad=True), insitu.Layer()
    insitu.keep.extend((hidden, layer))  # held, as in insitu.py
    contract = contracts.ReplayContract.record(
        "g", (hidden,), insitu.replay_kwargs(None) | {"rotary_pos_emb": torch.zeros(4, 1, 1, 8)},
        module=layer, step_marks=insitu.marks)
    return contract.replay_check(contract_check.FULL)


insitu.run({arm: [checker(arm) for _ in range(3)] for arm in ("noop", "before", "after")},
           int(sys.argv[2]) if len(sys.argv) > 2 else 300, rotate=True)
