"""The package's import graph, read from the source with ``ast``: no module imports itself back
through others (a cycle); every import points down the layers docs/architecture.md lists (its
```layers block, so the doc and the code cannot drift apart); and a function-local import of one
of the plugin's own modules says why it waits (``# deferred: <reason>`` on its line: a heavy
dependency such as torch, Megatron or matplotlib that the importing module must stay free of).
Local imports of the plugin's own modules are edges of the graph like the others: deferring one
hides neither a cycle nor an import that points up."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "megatron_cg_plugin"
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"
DEFERRED = re.compile(r"#\s*deferred:\s*\S")
LAYERS_BLOCK = re.compile(r"^```layers\n(.*?)^```", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    local: bool  # inside a function: runs when it is called, not when the module loads
    marked: bool  # the statement carries "# deferred: <reason>"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module and package of the package at ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, known: set[str]) -> list[str]:
    """The package's modules a statement imports (``from pkg import module`` names the module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            package = importer.split(".") if is_package else importer.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = []
    for name in names:
        while name and name not in known:  # "pkg.module.attribute" -> "pkg.module"
            name = name.rpartition(".")[0]
        if name and name not in found:
            found.append(name)
    return found


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports(root: Path = ROOT) -> list[Import]:
    """Every import of one of the package's own modules by another, outside ``if TYPE_CHECKING:``."""
    known = module_names(root)
    found: list[Import] = []
    for importer, path in known.items():
        source = path.read_text()
        lines = source.splitlines()

        def walk(node: ast.AST, local: bool, lines=lines, importer=importer, path=path) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for branch in child.orelse:
                        walk(branch, local)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    text = "\n".join(lines[child.lineno - 1 : child.end_lineno])
                    for target in _targets(child, importer, path.name == "__init__.py", set(known)):
                        if target != importer:
                            found.append(Import(importer, target, child.lineno, local, bool(DEFERRED.search(text))))
                    continue
                walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(ast.parse(source, str(path)), False)
    return found


def graph(found: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for item in found:
        edges.setdefault(item.importer, set()).add(item.imported)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path
    that starts and ends at the component's first module in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_cycle_in(component, edges) for component in components]


def _cycle_in(component: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to it, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(edges.get(node, set()) & component):
                if successor == start:
                    return paths[node] + [start]
                if successor not in paths:
                    paths[successor] = paths[node] + [successor]
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{sorted(component)} is strongly connected but has no cycle through {start}")


def cycle_problems(root: Path = ROOT) -> list[str]:
    """One line per import cycle of the package at ``root``, naming every module on cycles with it."""
    edges = graph(imports(root))
    return [
        f"{' -> '.join(cycle)}  (and every cycle among {', '.join(sorted(_component(cycle[0], edges)))})"
        for cycle in cycles(edges)
    ]


def test_the_package_has_no_import_cycle():
    found = cycle_problems()
    assert not found, "import cycles (break each by moving what the lower module needs below it):\n" + "\n".join(found)


def _component(start: str, edges: dict[str, set[str]]) -> set[str]:
    """The modules on some cycle through ``start``: reached from it and reaching it."""

    def reached(frm: str, step) -> set[str]:
        seen, todo = {frm}, [frm]
        while todo:
            for following in step(todo.pop()):
                if following not in seen:
                    seen.add(following)
                    todo.append(following)
        return seen

    reverse: dict[str, set[str]] = {}
    for node, successors in edges.items():
        for successor in successors:
            reverse.setdefault(successor, set()).add(node)
    return reached(start, lambda n: edges.get(n, ())) & reached(start, lambda n: reverse.get(n, ()))


def test_function_local_imports_of_the_plugin_say_why_they_wait():
    local = [item for item in imports() if item.local]
    unmarked = [f"{item.importer} (line {item.line}) imports {item.imported}" for item in local if not item.marked]
    assert not unmarked, (
        f"{len(unmarked)} of the {len(local)} function-local imports of the plugin's own modules give "
        "no reason: import at the top, or add '# deferred: <why>' (a heavy dependency the importing "
        "module stays free of):\n" + "\n".join(unmarked)
    )


def test_the_graph_sees_the_package_as_it_is():
    # A graph that missed imports would pass both tests above: a few edges known to exist.
    edges = graph(imports())
    assert "megatron_cg_plugin.patching.ledger" in edges["megatron_cg_plugin.installation"]
    assert "megatron_cg_plugin.capture.transaction" in edges["megatron_cg_plugin.capture_lifecycle"]
    assert "megatron_cg_plugin.config" in edges["megatron_cg_plugin"]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_cycle_through_a_local_import_is_found_and_named(tmp_path):
    root = _package(
        tmp_path,
        {
            "a.py": "from pkg import b\n",
            "b.py": "import pkg.sub.c\n",
            "sub/__init__.py": "",
            "sub/c.py": "def f():\n    from .. import a  # deferred: a reason does not make a cycle right\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        },
    )
    assert cycles(graph(imports(root))) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_unmarked_local_imports_are_told_apart_from_marked_ones(tmp_path):
    root = _package(
        tmp_path,
        {
            "a.py": "import os\n\ndef f():\n    import json\n    from pkg.b import thing\n\n"
            "def g():\n    from pkg import b  # deferred: b imports torch\n",
            "b.py": "thing = 1\n",
        },
    )
    found = [(item.line, item.imported, item.local, item.marked) for item in imports(root)]
    assert found == [(5, "pkg.b", True, False), (8, "pkg.b", True, True)]


@pytest.mark.parametrize("text", ["# deferred:", "# deferred"])
def test_a_deferral_needs_a_reason(tmp_path, text):
    root = _package(tmp_path, {"a.py": f"def f():\n    from pkg import b  {text}\n", "b.py": ""})
    assert [item.marked for item in imports(root)] == [False]


# ---------------------------------------------------------------- folders


def folder_of(module: str) -> str:
    """A module's folder: its first package component under the package (``pkg.banks.capture`` ->
    ``banks``); a top-level module (``pkg.rules``) and the package itself count as themselves."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_graph(found: list[Import]) -> dict[str, set[str]]:
    """The imports between folders (``folder_of``), an import inside one folder left out."""
    edges: dict[str, set[str]] = {}
    for item in found:
        importer, imported = folder_of(item.importer), folder_of(item.imported)
        if importer != imported:
            edges.setdefault(importer, set()).add(imported)
    return edges


def folder_cycle_problems(root: Path = ROOT, known: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    """One line per loop between the folders of the package at ``root`` (``known`` imports left out)."""
    edges = folder_graph([item for item in imports(root) if (item.importer, item.imported) not in known])
    return [
        f"{' -> '.join(cycle)}  (and every loop among {', '.join(sorted(_component(cycle[0], edges)))})"
        for cycle in cycles(edges)
    ]


def test_the_folders_import_each_other_without_a_loop():
    problems = folder_cycle_problems()
    assert not problems, (
        "folders that import each other (a feature folder imports only folders below it; move "
        "the module that sits above its folder):\n" + "\n".join(problems)
    )


def test_a_loop_between_folders_is_found_and_top_level_modules_are_folders_of_their_own(tmp_path):
    root = _package(
        tmp_path,
        {
            "a/__init__.py": "",
            "a/low.py": "",
            "a/high.py": "from pkg.b import user\n",
            "b/__init__.py": "",
            "b/user.py": "from pkg.a import low\nfrom pkg import c\n",
            "c.py": "",
            "d.py": "import pkg.a.high\n",
        },
    )
    # No module imports itself back, yet a and b import each other; c and d are folders of their own.
    assert cycle_problems(root) == []
    assert folder_graph(imports(root)) == {"a": {"b"}, "b": {"a", "c"}, "d": {"a"}}
    assert folder_cycle_problems(root) == ["a -> b -> a  (and every loop among a, b)"]
    assert folder_cycle_problems(root, known=frozenset({("pkg.a.high", "pkg.b.user")})) == []


# ---------------------------------------------------------------- layers


def read_layers(text: str, package: str) -> list[tuple[str, tuple[str, ...]]]:
    """The ```layers block of ``text``, top layer first: (layer name, its module patterns as
    dotted names under ``package``; ``x.*`` is the package ``x`` and everything in it, and the
    package's own name stands for its ``__init__``)."""
    block = LAYERS_BLOCK.search(text)
    assert block, "docs/architecture.md has no ```layers block"
    layers = []
    for line in block.group(1).splitlines():
        if line.strip():
            name, *patterns = line.split()
            layers.append((name, tuple(p if p == package else f"{package}.{p}" for p in patterns)))
    return layers


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def layer_problems(root: Path = ROOT, text: str | None = None) -> list[str]:
    """Modules the layers do not place (or place twice), and imports that point up a layer."""
    layers = read_layers(ARCHITECTURE.read_text() if text is None else text, root.name)
    height = {}  # module -> its layer's height (the bottom layer is 0)
    problems = []
    for module in module_names(root):
        places = [
            (len(layers) - 1 - index, name)
            for index, (name, patterns) in enumerate(layers)
            if any(_matches(module, pattern) for pattern in patterns)
        ]
        if len(places) != 1:
            problems.append(
                f"{module} is in {len(places)} layers ({', '.join(n for _, n in places) or 'none'}): "
                "place it in exactly one in docs/architecture.md's ```layers block"
            )
        elif places:
            height[module] = places[0]
    for item in imports(root):
        if item.importer in height and item.imported in height and height[item.importer][0] < height[item.imported][0]:
            problems.append(
                f"{item.importer} (layer {height[item.importer][1]}, line {item.line}) imports "
                f"{item.imported} (layer {height[item.imported][1]}, above it)"
            )
    return problems


def test_every_import_points_down_the_documented_layers():
    problems = layer_problems()
    assert not problems, (
        "docs/architecture.md's layers and the imports disagree (move the code, or the module to "
        "another layer where that is what it is):\n" + "\n".join(problems)
    )


def test_the_layers_block_names_only_modules_that_exist():
    known = set(module_names(ROOT))
    patterns = [pattern for _, layer in read_layers(ARCHITECTURE.read_text(), ROOT.name) for pattern in layer]
    stale = [pattern for pattern in patterns if not any(_matches(module, pattern) for module in known)]
    assert not stale, f"docs/architecture.md's layers name modules that do not exist: {stale}"


def test_the_foreign_state_primitive_imports_nothing_of_the_plugin():
    # Any layer may make its foreign change through foreign_state: it sits below
    # everything and knows none of the modules that use it (the ledger, which owns the builders, sits above).
    imported = {item.imported for item in imports() if item.importer == "megatron_cg_plugin.foreign_state"}
    assert imported == set()
    users = {item.importer for item in imports() if item.imported == "megatron_cg_plugin.foreign_state"}
    assert {
        "megatron_cg_plugin.patching.ledger",
        "megatron_cg_plugin.capture.transaction",
        "megatron_cg_plugin.bench.command",
        "megatron_cg_plugin.installation",
    } <= users


LAYERED = """
```layers
top     a sub.*
bottom  b
```
"""


def test_an_import_that_points_up_is_found_even_deferred(tmp_path):
    root = _package(
        tmp_path,
        {
            "a.py": "from pkg import b\n",
            "b.py": "def f():\n    from pkg.sub import c  # deferred: a reason does not make it point down\n",
            "sub/__init__.py": "",
            "sub/c.py": "",
            "d.py": "",
        },
    )
    problems = layer_problems(root, LAYERED)
    assert problems == [
        "pkg is in 0 layers (none): place it in exactly one in docs/architecture.md's ```layers block",
        "pkg.d is in 0 layers (none): place it in exactly one in docs/architecture.md's ```layers block",
        "pkg.b (layer bottom, line 2) imports pkg.sub.c (layer top, above it)",
    ]


def test_the_checks_fail_on_a_synthetic_cyclic_package(tmp_path):
    # The same functions the package's own tests call, fed a package with a cycle of two modules in
    # one layer (which the layer check alone would let pass).
    root = _package(tmp_path, {"a.py": "import pkg.b\n", "b.py": "from pkg import a\n"})
    assert cycle_problems(root) == ["pkg.a -> pkg.b -> pkg.a  (and every cycle among pkg.a, pkg.b)"]
    assert list(layer_problems(root, "```layers\nall  pkg a b\n```\n")) == []
