"""Each test the compiled quick accept makes (accept_code.py) and each read of QuickState
(contracts.py), removed or weakened in turn, must fail the unit tests. Run from anywhere with the
project's venv: ``.venv/bin/python docs/results/session-2026-12-05/drivers/mutate_accept.py``.
Restores both files. Kept in step with the code: session-2026-12-05b added seven mutants and rewrote
"live storages ignored" for the storage read it changed; session-2026-12-05c rewrote the skip's three for
the step marks read inline and added "held step set outside a marked run"."""
import os
import pathlib
import subprocess

root = pathlib.Path(__file__).resolve().parents[4]  # the repository
AC, CO = root / "megatron_cg_plugin/capture/accept_code.py", root / "megatron_cg_plugin/capture/contracts.py"
RESET = '''        "if first is not False:  # a step's first microbatch (or no such mark): nothing read for it yet",
        "    state.held_at_step = None",
    ]'''
LAYOUT_TEST = '''    body.append(f"if len(args) != {layout.positional} or len(kwargs) != {layout.keywords}:")
    body.append("    return False")'''
SKIP = '''            "held_at = state.held_at_step  # None unless first is False (reset above)",
            "if held_at is not None and held_at == marks.count:",
            "    return True  # read at this step's first microbatch (QuickAccept)",
'''
EARLY_SKIP = ('    if layout.full and layout.step_marked:\n        body += ["if full and state.held_at_step is not None and '
              'state.held_at_step == state.step_marks.count:", "    return True"]\n')
AFTER_TYPES = '    if tensors:\n        reads = '
AFTER_METAS = '    if layout.full:\n        body.extend('
RESET_LATE = '\n    body.append("if first is not False:")\n    body.append("    state.held_at_step = None")'


# name: (file, text, its replacement), or (file, a function of the file's text)
MUTANTS = {
    "reset removed": (AC, '"    state.held_at_step = None",', '"    pass",'),
    "reset after the layout test": (AC, lambda text: text.replace(RESET, "    ]").replace(LAYOUT_TEST, LAYOUT_TEST + RESET_LATE)),
    "skip before the metadata test": (AC, lambda text: text.replace(SKIP, "").replace(AFTER_TYPES, EARLY_SKIP + AFTER_TYPES)),
    "skip before controls and memory": (AC, lambda text: text.replace(SKIP, "").replace(AFTER_METAS, EARLY_SKIP + AFTER_METAS)),
    "shapes-mode refuses full": (AC, '        body.append("    return False")\n    body.append(f"if len(args)',
                                 '        body.append("    pass")\n    body.append(f"if len(args)'),
    "keyword count not compared": (AC, " or len(kwargs) != {layout.keywords}:", ":"),
    "keyword names by ==": (AC, 'f"({name} is not {key} and (type({name}) is not str or {name} != {key}))"',
                            'f"({name} != {key})"'),
    "keyword names not compared": (AC, 'f"({name} is not {key} and (type({name}) is not str or {name} != {key}))"',
                                   'f"False"'),
    "str-subclass keywords learned": (CO, "        if not _plain_names(kwargs):\n            return", ""),
    "positional count not compared": (AC, "len(args) != {layout.positional} or", ""),
    "types not compared": (AC, 'f"type({value[p]}) is not t{i}"', 'f"False"'),
    "metas not compared": (AC, 'body.append(f"if {_tuple(reads)} != metas:")', 'body.append(f"if False:")'),
    "controls not compared": (AC, 'f"    if not controls == {', 'f"    if False and not controls == {'),
    "memory_in_place ignored": (AC, 'lines.append(f"    if not memory_in_place(',
                                'lines.append(f"    if False and not memory_in_place('),
    "live storages ignored": (AC, 'f"{storage} in live_storages"', 'f"False"'),
    # session-2026-12-05b: storage addresses computed from address and offset, groups by weak reference
    "storage offset in elements": (AC, "storage_offset({tensor}) * {itemsize}", "storage_offset({tensor})"),
    "storage offset added": (AC, 'f"{pointer} - storage_offset', 'f"{pointer} + storage_offset'),
    "every type by offset": (CO, "storage_by_offset=tuple(any(", "storage_by_offset=tuple(True or any("),
    "offset types by ==": (CO, "any(type(tensor) is kind for kind in _STORAGE_BY_OFFSET)",
                           "type(tensor) in _STORAGE_BY_OFFSET"),
    "instance's storage_offset": (AC, 'f"{pointer} - storage_offset({tensor}) * {itemsize}"',
                                  'f"{pointer} - {tensor}.storage_offset() * {itemsize}"'),
    "instance's storage": (CO, "return type(tensor).untyped_storage(tensor).data_ptr()",
                                 "return tensor.untyped_storage().data_ptr()"),
    "groups' layer held strongly": (CO, "        layer = weakref.ref(module)\n", "        raise TypeError\n"),
    "skip in any step": (AC, '"if held_at is not None and held_at == marks.count:"', '"if held_at is not None:"'),
    "held state not read": (AC, 'lines += ["if not held_accepts():", "    return False"]', 'lines += []'),
    "skip kept after a later microbatch": (AC, '"state.held_at_step = marks.count if first is True and marks.depth else None',
                                           '"state.held_at_step = marks.count if marks.depth else None'),
    "held step set outside a marked run": (AC, "if first is True and marks.depth else None", "if first is True else None"),
    "parameter types ignored": (CO, "if tuple(map(type, parameters)) != self.parameter_types:", "if False:"),
    "parameter addresses ignored": (CO, "if tuple(map(_DATA_PTR, parameters)) != self.parameter_ptrs:", "if False:"),
    "group names ignored": (CO, "if not _same_names(now, names) or not all", "if not all"),
    "group names by ==": (CO, "if not _same_names(now, names)", "if tuple(now) != names"),
    "str-subclass group names learned": (CO, " if all(\n            map(_plain_names, seen)) else None", ""),
    "group identity ignored": (CO, " or not all(map(operator.is_, now.values(), groups))", ""),
    "in-place stride ignored": (CO, "if static.buffer() is None or tensor.stride() != static.spec.stride:",
                                "if static.buffer() is None:"),
    "freed static read in place": (CO, "if static.buffer() is None or tensor.stride()", "if tensor.stride()"),
    "copied into a live static": (CO, "            elif _storage_ptr(tensor) in live_storages:\n                return False\n",
                                  ""),
    "learned held step on any first": (CO, "marks.step_now() if first_microbatch is True and marks",
                                       "marks.step_now() if first_microbatch is not None and marks"),
}
originals = {path: path.read_text() for path in (AC, CO)}
survived = []
try:
    for name, (path, *change) in MUTANTS.items():
        text = originals[path]
        if len(change) == 1:
            text = change[0](text)
        else:
            assert text.count(change[0]) == 1, (name, text.count(change[0]))
            text = text.replace(*change)
        assert text != originals[path], name
        path.write_text(text)
        for cache in root.glob("megatron_cg_plugin/capture/__pycache__/*"):  # a stale .pyc of the same size
            cache.unlink()
        run = subprocess.run([str(root / ".venv/bin/python"), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                              "tests/unit/test_accept_code.py", "tests/unit/test_contracts.py"], cwd=root,
                             env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True)
        path.write_text(originals[path])
        first_failure = [line for line in run.stdout.splitlines() if line.startswith("FAILED")][:1]
        print(f"{name:36s} rc={run.returncode} {first_failure[0][:150] if first_failure else run.stdout.splitlines()[-1]}",
              flush=True)
        if run.returncode == 0:
            survived.append(name)
finally:
    for path, text in originals.items():
        path.write_text(text)
print("SURVIVED:", survived)
