"""The pure modules (plans, rules, banks' router, golden values) run without torch: they are
imported here in a fresh interpreter and torch must not come along. And the package's sources,
scanned: only settings.py reads Megatron's args (config.py the plugin's --cg-* flags among them, for
it), capture code imports nothing of the rules, and no module imports a test extra when it is imported."""

import ast
import subprocess
import sys
from pathlib import Path

import megatron_cg_plugin

PURE = (
    "megatron_cg_plugin",
    "megatron_cg_plugin.config",
    "megatron_cg_plugin.rules",
    "megatron_cg_plugin.scopes",
    "megatron_cg_plugin.banks.router",
    "megatron_cg_plugin.banks.sizes",
    "megatron_cg_plugin.planner.capture_plan",
    "megatron_cg_plugin.slot_sharing.plan",
    "megatron_cg_plugin.packed.layout",
    "megatron_cg_plugin.moe.capacity",
    "megatron_cg_plugin.bench.schedule",
    "megatron_cg_plugin.slot_sharing.offload_plan",
    "megatron_cg_plugin.planner.allocator",
    "megatron_cg_plugin.planner.graph_memory",
    "megatron_cg_plugin.data",
    "megatron_cg_plugin.parse_errors",
)


def test_pure_modules_import_no_torch():
    code = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in PURE)
        + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


PACKAGE = Path(megatron_cg_plugin.__file__).parent


def _named_args(node: ast.AST) -> bool:
    """``args`` or ``<something>.args``: Megatron's parsed flags however a module holds them."""
    return (isinstance(node, ast.Name) and node.id == "args") or (
        isinstance(node, ast.Attribute) and node.attr == "args"
    )


def cg_flag_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Where ``tree`` reads or sets a ``cg_`` attribute of an object named ``args``: ``args.cg_x``, or
    ``getattr``/``hasattr``/``setattr``/``delattr`` of ``args`` with a literal ``"cg_..."`` name."""
    uses = _args_uses(tree, ("getattr", "hasattr", "setattr", "delattr"), loads_only=False)
    return [(line, what) for line, what, name in uses if name.startswith("cg_")]


def test_the_scan_finds_each_way_of_reading_a_cg_flag():
    code = (
        "args.cg_slot_capture\nself.args.cg_offload_window\ngetattr(args, 'cg_offload_copies', None)\n"
        "hasattr(args, 'cg_preset')\nargs.num_layers\nconfig.cg_like\ngetattr(args, 'seq_length')\n"
    )
    assert [line for line, _ in cg_flag_reads(ast.parse(code))] == [1, 2, 3, 4]


def test_only_config_reads_the_cg_flags_from_args():
    """``config.config_from_args`` turns the ``--cg-*`` flags into the ``PluginConfig`` every other
    module is handed: a second reader would miss an ``install(config)`` that overrides the flags."""
    readers = {
        str(path.relative_to(PACKAGE)): reads
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "config.py" or path.parent != PACKAGE
        if (reads := cg_flag_reads(ast.parse(path.read_text(), filename=str(path))))
    }
    assert readers == {}


# Called on an object named args, these read a dict (the farm's flag dicts), not Megatron's namespace, which has none.
_DICT_METHODS = frozenset({"get", "pop", "update", "items", "keys", "values", "setdefault", "copy"})


def _args_uses(tree: ast.AST, functions: tuple[str, ...], *, loads_only: bool) -> list[tuple[int, str, str]]:
    """(line, what, name) for each attribute of an object named ``args`` (``_named_args``; loaded only with
    ``loads_only``; a dict's methods called on it left out) and each call of ``functions`` on one (name: its
    literal attribute name, else empty)."""
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _named_args(node.value):
            loaded = isinstance(node.ctx, ast.Load)
            if (loaded or not loads_only) and not (node.attr in _DICT_METHODS and id(node) in called):
                found.append((node.lineno, f"args.{node.attr}", node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in functions
            and len(node.args) >= 2
            and _named_args(node.args[0])
        ):
            name = node.args[1]
            literal = str(name.value) if isinstance(name, ast.Constant) else ""
            found.append((node.lineno, f"{node.func.id}(args, {ast.unparse(name)})", literal))
    return found


def args_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Where ``tree`` reads a value off an object named ``args``: ``args.x`` or ``self.args.x`` loaded, or
    ``getattr``/``hasattr`` of it, by any name. Writes, and a dict's methods called on it, are not reads of
    Megatron's flags."""
    return [(line, what) for line, what, _ in _args_uses(tree, ("getattr", "hasattr"), loads_only=True)]


def test_the_scan_finds_each_way_of_reading_megatrons_args():
    code = (
        "getattr(args, 'load', None)\nargs.create_attention_mask_in_dataloader\nhasattr(args, 'data_parallel_size')\n"
        "self.args.seq_length\ngetattr(args, name)\nargs.get('--mock-data')\nargs[0]\nargs.num_layers = 2\n"
        "settings.load\nbuild_tokenizer(args)\n"
    )
    assert [line for line, _ in args_reads(ast.parse(code))] == [1, 2, 3, 4, 5]


def test_only_settings_reads_megatrons_args():
    """``settings.read_settings`` is the one read of Megatron's args (``config.config_from_args``, which it
    calls, parses the ``--cg-*`` flags): every other module takes the ``RunSettings`` it builds and holds the
    args only to hand them whole to Megatron's own functions. A second reader would act on a flag the rules
    never saw in the settings."""
    allowed = {"settings.py", "config.py"}
    readers = {
        str(path.relative_to(PACKAGE)): reads
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in allowed
        if (reads := args_reads(ast.parse(path.read_text(), filename=str(path))))
    }
    assert readers == {}


def imported_modules(tree: ast.AST) -> set[str]:
    """The package modules ``tree`` imports (``import a.b``, ``from a.b import c`` as ``a.b`` and ``a.b.c``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_capture_code_needs_nothing_of_the_rules():
    """Capture code (capture/, slot_sharing/, banks/, packed/) reads scope names from ``scopes``; the
    rules are the run's check, a layer above it (``planner.capture_plan`` and ``refusal`` use them)."""
    folders = ("capture", "slot_sharing", "banks", "packed")
    assert all((PACKAGE / folder).is_dir() for folder in folders), "a capture folder moved: name it here"
    capture = sorted(path for folder in folders for path in (PACKAGE / folder).glob("*.py"))
    importers = [
        str(path.relative_to(PACKAGE))
        for path in capture
        if "megatron_cg_plugin.rules" in imported_modules(ast.parse(path.read_text()))
    ]
    assert importers == []


def module_level_imports(tree: ast.Module) -> ast.Module:
    """The imports that run at import time: the module's, into ``if``/``try``/``with`` blocks, not
    into function or class bodies."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return ast.Module(body=found, type_ignores=[])


def test_the_package_imports_no_test_extra_at_module_level():
    """hypothesis and pytest are test extras: the tests' doubles and strategies live under
    tests/unit/_doubles (farm/distributed.py's pytest helpers import pytest inside the call)."""
    importers = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if {"hypothesis", "pytest"}
        & {name.split(".")[0] for name in imported_modules(module_level_imports(ast.parse(path.read_text())))}
    ]
    assert importers == []


def test_megatrons_global_args_are_fetched_only_to_be_checked_or_to_drive_its_loop():
    """Settings come from the one read (``settings.read_settings``, fed by the validate-args hook or
    ``RunSession.ensure_checked``): ``get_args()`` is called only where the args are handed to the
    rules (``installation``) and where the bench drives Megatron's loop counters (``bench.command``).
    A docstring's example of a user's own script does not count."""
    allowed = {"installation.py", "bench/command.py"}
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "get_args":
                callers.add(str(path.relative_to(PACKAGE)))
    assert callers, "the scan found no call at all: it no longer reads the package"
    assert callers <= allowed, f"read settings from session.settings, not Megatron's args: {sorted(callers - allowed)}"
