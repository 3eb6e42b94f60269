"""engine/ and models/ never import a GUI package (models -> engine -> widgets/cli)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUI = ("qtpy", "napari", "magicgui", "vispy", "PyQt5", "PyQt6", "PySide2", "PySide6")

SCRIPT = textwrap.dedent("""
    import importlib, pkgutil, sys

    GUI = set(sys.argv[1].split(","))

    class NoGui:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in GUI:
                raise ImportError(f"GUI package {name!r} imported")
            return None

    sys.meta_path.insert(0, NoGui())
    failed = []
    names = []
    for pkg_name in sys.argv[2:]:
        pkg = importlib.import_module(pkg_name)
        names.append(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            names.append(info.name)
            try:
                importlib.import_module(info.name)
            except ImportError as exc:
                failed.append(f"{info.name}: {exc}")
    import napari_gpuseg.engine as api
    for name in api.__all__:  # the lazy public API too
        try:
            getattr(api, name)
        except ImportError as exc:
            failed.append(f"napari_gpuseg.engine.{name}: {exc}")
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in GUI)
    print(len(names), "modules")
    if failed or leaked:
        sys.exit("\\n".join(failed + [f"loaded: {m}" for m in leaked]))
""")


def run_isolated(*packages: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", SCRIPT, ",".join(GUI), *packages],
                          capture_output=True, text=True, env=env, timeout=300)


def test_engine_and_models_import_no_gui_package():
    proc = run_isolated("napari_gpuseg.engine", "napari_gpuseg.models")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[0]) > 30  # every module was walked, not just the packages


@pytest.mark.parametrize("pkg", ["napari_gpuseg.widgets"])
def test_the_check_sees_a_gui_import(pkg):
    """The same check on the docks (which import napari/qtpy) must fail."""
    proc = run_isolated(pkg)
    assert proc.returncode != 0
    assert "GUI package" in proc.stderr


def test_no_dock_imports_another_dock_or_a_private_name():
    """Docks share parts through the ``widgets/_*.py`` modules, never through each other, and
    no module imports another module's private (``_name``) function or class."""
    import ast

    widgets = ROOT / "napari_gpuseg" / "widgets"
    docks = {p.stem for p in widgets.glob("*.py") if not p.stem.startswith("_")}
    bad = []
    for path in sorted((ROOT / "napari_gpuseg").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            mod = (node.module or "").split(".")[-1]
            if path.parent == widgets and node.level == 1 and mod in docks:
                bad.append(f"{path.name} imports dock {mod}")
            bad += [f"{path.name} imports {a.name} from {node.module}" for a in node.names
                    if node.module and a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad
