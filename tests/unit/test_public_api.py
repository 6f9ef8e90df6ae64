"""The package's public surface is explicit: every module lists its public names in ``__all__``, and
one plugin module uses only what another lists there (its internals stay underscored or unlisted),
so a reader sees each module's seams without reading its callers."""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import ROOT, module_names

MODULES = module_names(ROOT)


def declared_all(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def test_every_module_declares_its_public_names():
    missing = [name for name, path in MODULES.items() if path.name != "__init__.py" and declared_all(path) is None]
    assert missing == []


def test_the_public_api_is_the_documented_one():
    import megatron_cg_plugin

    assert set(megatron_cg_plugin.__all__) == {"__version__", "PluginConfig", "add_plugin_args", "install", "uninstall"}


def uses_across_modules() -> list[tuple[str, str, str]]:
    """(user, module, name) for every ``from plugin.module import name`` and ``module.name`` read by
    another plugin module."""
    found = []
    for user, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "") in MODULES:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    if child in MODULES:
                        aliases[alias.asname or alias.name] = child
                    elif node.module != user:
                        found.append((user, node.module, alias.name))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != user
            ):
                found.append((user, aliases[node.value.id], node.attr))
    return found


def test_modules_use_only_each_others_public_names():
    unlisted = []
    for user, module, name in uses_across_modules():
        if name.startswith("__"):  # dunders (__doc__, __version__) belong to every module
            continue
        listed = declared_all(MODULES[module])
        if listed is None:  # a package's __init__ without __all__: its submodules are its surface
            if f"{module}.{name}" not in MODULES:
                unlisted.append(f"{user} uses {module}.{name}, and {module} has no __all__")
        elif name not in listed:
            unlisted.append(f"{user} uses {module}.{name}, which {module}.__all__ does not list")
    assert unlisted == []
