"""Each test the compiled quick accept makes (accept_code.py) and each read of QuickState
(contracts.py), removed in turn, must fail the unit tests. Run from anywhere with the project's venv:
``.venv/bin/python docs/results/session-2026-12-05/drivers/mutate_accept.py``. Restores both files."""
import os
import pathlib
import subprocess

root = pathlib.Path(__file__).resolve().parents[4]  # the repository
AC, CO = root / "megatron_cg_plugin/capture/accept_code.py", root / "megatron_cg_plugin/capture/contracts.py"
RESET = '''        "if first is not False:  # a step's first microbatch (or no such mark): nothing read for it yet",
        "    state.held_at_step = None",
    ]'''
LAYOUT = '''    body.append(f"if len(args) != {layout.positional} or tuple(kwargs) != keys:")
    body.append("    return False")'''
M = {  # name: (file, text, its replacement)
 "reset removed": (AC, '"    state.held_at_step = None",', '"    pass",'),
 "reset after the layout": (AC, None, None),
 "shapes-mode refuses full": (AC, 'body.append("    return False")\n    body.append(f"if len(args)', 'body.append("    pass")\n    body.append(f"if len(args)'),
 "keys not compared": (AC, "tuple(kwargs) != keys", "False"),
 "positional count not compared": (AC, "len(args) != {layout.positional} or", ""),
 "types not compared": (AC, 'f"type({value[p]}) is not t{i}"', 'f"False"'),
 "metas not compared": (AC, 'body.append(f"if {_tuple(reads)} != metas:")', 'body.append(f"if False:")'),
 "controls not compared": (AC, 'f"    if not controls == {', 'f"    if False and not controls == {'),
 "memory_in_place ignored": (AC, 'lines.append(f"    if not memory_in_place(', 'lines.append(f"    if False and not memory_in_place('),
 "live storages ignored": (AC, 'f"{t}.untyped_storage().data_ptr() in live_storages"', 'f"False"'),
 "skip in any step": (AC, '"if held_at is not None and held_at == step_now():"', '"if held_at is not None:"'),
 "held state not read": (AC, 'lines += ["if not held_accepts():", "    return False"]', 'lines += []'),
 "skip kept after a later microbatch": (AC, '"state.held_at_step = step_now() if first is True else None"', '"state.held_at_step = step_now()"'),
 "parameter types ignored": (CO, "if tuple(map(type, parameters)) != self.parameter_types:", "if False:"),
 "parameter addresses ignored": (CO, "if tuple(map(_DATA_PTR, parameters)) != self.parameter_ptrs:", "if False:"),
 "group names ignored": (CO, "if tuple(now) != names or not all", "if not all"),
 "group identity ignored": (CO, " or not all(map(operator.is_, now.values(), groups))", ""),
 "in-place stride ignored": (CO, "if static.buffer() is None or tensor.stride() != static.spec.stride:", "if static.buffer() is None:"),
 "freed static read in place": (CO, "if static.buffer() is None or tensor.stride()", "if tensor.stride()"),
 "copied into a live static": (CO, "            elif _storage_ptr(tensor) in live_storages:\n                return False\n", ""),
 "learned held step on any first": (CO, "marks.step_now() if first_microbatch is True and marks", "marks.step_now() if first_microbatch is not None and marks"),
}
originals = {p: p.read_text() for p in (AC, CO)}
failed = []
try:
    for name, (path, old, new) in M.items():
        text = originals[path]
        if name == "reset after the layout":  # the reset after the layout test, not before it
            reset_late = '\n    body.append("if first is not False:")\n    body.append("    state.held_at_step = None")'
            text = text.replace(RESET, "    ]").replace(LAYOUT, LAYOUT + reset_late)
        else:
            assert text.count(old) == 1, (name, text.count(old))
            text = text.replace(old, new)
        assert text != originals[path], name
        path.write_text(text)
        for cache in root.glob("megatron_cg_plugin/capture/__pycache__/*"):  # a stale .pyc of the same size
            cache.unlink()
        r = subprocess.run([str(root / ".venv/bin/python"), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                            "tests/unit/test_accept_code.py", "tests/unit/test_contracts.py"], cwd=root,
                           env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True)
        path.write_text(originals[path])
        last = [l for l in r.stdout.splitlines() if l.startswith("FAILED")][:1]
        print(f"{name:40s} rc={r.returncode} {last[0][:140] if last else r.stdout.splitlines()[-1]}", flush=True)
        if r.returncode == 0:
            failed.append(name)
finally:
    for p, t in originals.items():
        p.write_text(t)
print("SURVIVED:", failed)
