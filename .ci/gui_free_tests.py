"""Print the test files that need no GUI library, one per line: the files the minimum-torch CI
step runs (its venv has no napari or Qt). Found, not listed, so new test files are covered.

A test file needs the GUI when it imports a GUI library (napari, qtpy, pytest-qt, magicgui,
vispy, a Qt binding), uses a Qt/napari fixture (``qtbot``, ``make_napari_viewer``), or imports
a module of this package that imports a GUI library when it is imported, directly or through
its own imports (imports inside functions run only when called).

    python .ci/gui_free_tests.py [tests]
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "napari_gpuseg"
GUI = {"napari", "qtpy", "pytestqt", "magicgui", "vispy", "PyQt5", "PyQt6", "PySide2", "PySide6"}
FIXTURES = re.compile(r"\b(qtbot|make_napari_viewer|make_napari_viewer_proxy)\b")


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _nodes(tree: ast.AST, in_functions: bool):
    """Every node of ``tree``; without ``in_functions``, none inside a function body (what
    runs when the module is imported)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if in_functions or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo.append(child)


def _imports(path: Path, module: str | None) -> set[str]:
    """Absolute names of the modules ``path`` imports: anywhere in a test file (its tests run
    every import), at import time in a module of the package (not inside its functions)."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else (module.rpartition(".")[0] if module else None)
    for node in _nodes(ast.parse(path.read_text(encoding="utf-8")), in_functions=module is None):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and package:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # submodules imported by name
    return names


def _reaches_gui(names: set[str]) -> bool:
    """Whether any of ``names``, or a module of this package they import (transitively, with
    the packages above each), is a GUI library."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        top = name.split(".")[0]
        if top in GUI:
            return True
        if top != PACKAGE:
            continue
        path = _module_file(name)
        if path is None:
            continue
        todo += [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += sorted(_imports(path, name))
    return False


def needs_gui(test_file: Path) -> bool:
    if FIXTURES.search(test_file.read_text(encoding="utf-8")):
        return True
    return _reaches_gui(_imports(test_file, None))


def main() -> None:
    folder = ROOT / (sys.argv[1] if len(sys.argv) > 1 else "tests")
    for f in sorted(folder.glob("test_*.py")):
        if not needs_gui(f):
            print(f.relative_to(ROOT))


if __name__ == "__main__":
    main()
