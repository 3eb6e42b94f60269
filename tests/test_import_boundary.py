"""The import boundaries: engine/ and models/ import no GUI package when imported, no
module of the package imports itself through others (no import cycle), and the contracts of
pyproject.toml (layers, no GUI below widgets/, independent docks) hold."""
import os
import re
import shutil
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


def test_no_module_imports_a_private_name():
    """No module imports another module's private (``_name``) function or class."""
    import ast

    bad = []
    for path in sorted((ROOT / "napari_gpuseg").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                bad += [f"{path.name} imports {a.name} from {node.module}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad



# modules that still reach into another object's private attributes (a worker's own jobs,
# torch and os internals, two dock helpers, the fix of vispy's mesh shader); every other module
# uses public names only
PRIVATE_REACH = {"cli/batch.py", "engine/runtime/job.py", "engine/runtime/worker.py",
                 "engine/sam/interactive/encoder_pauses.py", "models/sam/cpu_fused.py",
                 "widgets/_big_layer.py", "widgets/_first_layer.py", "widgets/_mesh_shader.py"}


def test_no_module_reads_another_objects_private_attribute():
    """``obj._name`` only on ``self`` / ``cls`` (the propagate panel, for one, is given the
    annotator dock's callbacks instead of calling its private methods)."""
    import ast

    bad = []
    for path in sorted((ROOT / "napari_gpuseg").rglob("*.py")):
        rel = path.relative_to(ROOT / "napari_gpuseg").as_posix()
        if rel in PRIVATE_REACH:
            continue
        bad += [f"{rel}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]
    assert not bad, bad


# ----------------------------------------------------------------------------- import cycles
def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports, from every import statement of
    ``root/napari_gpuseg`` (at module level, under ``if TYPE_CHECKING:`` and inside
    functions alike: a deferred import still ties the two modules together)."""
    import ast

    files = {}
    for path in (root / "napari_gpuseg").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    graph = {}
    for mod, (path, is_pkg) in files.items():
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                for a in node.names:  # ``from pkg import module`` imports the module
                    sub = f"{base}.{a.name}"
                    targets |= {sub} if sub in files else ({base} if base in files else set())
        graph[mod] = targets - {mod}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_inside_the_package():
    graph = import_graph(ROOT)
    assert len(graph) > 100 and "napari_gpuseg.engine.sam.training.finetune" in graph
    assert "napari_gpuseg.engine.sam.interactive.predictor" in graph["napari_gpuseg.engine.sam.loader"]
    assert import_cycles(graph) == []


@pytest.mark.parametrize("edits, cycle", [
    pytest.param({"engine/sam/training/tune_config.py": """
                      from typing import TYPE_CHECKING
                      if TYPE_CHECKING:
                          from .finetune import SamTuneResult
                  """}, ["napari_gpuseg.engine.sam.training.click_choice",  # finetune -> click_choice -> config
                         "napari_gpuseg.engine.sam.training.episode_loss",  # finetune -> episode_loss -> config
                         "napari_gpuseg.engine.sam.training.finetune",
                         "napari_gpuseg.engine.sam.training.tune_config"], id="type-checking-import"),
    pytest.param({"engine/sam/interactive/views.py": """
                      def _later():
                          from . import predictor
                  """}, None, id="import-in-a-function"),
    pytest.param({"io/__init__.py": "from ..engine import normalize\n"},
                 ["napari_gpuseg.engine.normalize", "napari_gpuseg.io"], id="from-package-import-module"),
])
def test_the_cycle_check_sees_a_cycle(tmp_path, edits, cycle):
    cycles = import_cycles(import_graph(_copy_with(tmp_path, edits)))
    assert len(cycles) == 1, cycles
    if cycle is not None:
        assert cycles[0] == cycle
    else:  # views -> predictor -> ... -> views: the whole loop is one group
        assert {"napari_gpuseg.engine.sam.interactive.views",
                "napari_gpuseg.engine.sam.interactive.predictor"} <= set(cycles[0])


# ----------------------------------------------------------------------------- import-linter
# The layers, the GUI-free engine and the independent docks are stated as import-linter
# contracts in pyproject.toml. lint-imports reads every import statement, including those
# inside functions, in any form.

def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` run in ``root`` with ``root/pyproject.toml`` (the package is imported
    from ``root``)."""
    pytest.importorskip("importlinter")  # the testing extra installs it
    exe = shutil.which("lint-imports", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                             os.environ.get("PATH", "")]))
    assert exe, "import-linter is installed but its lint-imports command is not on the PATH"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([exe, "--no-cache", "--no-logo"], cwd=root,
                          capture_output=True, text=True, env=env, timeout=120)


def test_the_package_keeps_its_import_contracts():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Contracts: 3 kept, 0 broken." in proc.stdout


def _contracts() -> list[dict]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: import-linter depends on tomli there
        import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def test_the_independence_contract_names_every_dock():
    """A new dock module is covered: the contract lists every public module of widgets/, among
    them every dock of napari.yaml."""
    widgets = ROOT / "napari_gpuseg" / "widgets"
    public = {f"napari_gpuseg.widgets.{p.stem}" for p in widgets.glob("*.py") if not p.stem.startswith("_")}
    manifest = (ROOT / "napari_gpuseg" / "napari.yaml").read_text(encoding="utf-8")
    in_manifest = set(re.findall(r"python_name:\s*(napari_gpuseg\.widgets\.\w+):", manifest))
    [independence] = [c for c in _contracts() if c["type"] == "independence"]
    assert set(independence["modules"]) == public
    assert len(in_manifest) >= 8 and in_manifest <= public


def _copy_with(tmp_path: Path, edits: dict[str, str]) -> Path:
    """A copy of the package's modules and pyproject.toml in ``tmp_path``, with ``edits``
    (path in the package -> text appended to that module)."""
    shutil.copytree(ROOT / "napari_gpuseg", tmp_path / "napari_gpuseg",
                    ignore=lambda d, names: [n for n in names if not (n.endswith((".py", ".yaml"))
                                                                      or (Path(d) / n).is_dir())
                                             or n == "__pycache__"])
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for rel, text in edits.items():
        path = tmp_path / "napari_gpuseg" / rel
        path.write_text(path.read_text(encoding="utf-8") + "\n" + textwrap.dedent(text), encoding="utf-8")
    return tmp_path


DOCK_TO_DOCK = "napari_gpuseg.widgets.unet_predict -> napari_gpuseg.widgets.sam_annotator"


@pytest.mark.parametrize("edits, broken, shown", [
    pytest.param({"widgets/unet_predict.py": "from .sam_annotator import SamAnnotatorWidget\n"},
                 "docks are independent of each other", DOCK_TO_DOCK, id="dock-from-relative-import-name"),
    pytest.param({"widgets/unet_predict.py": "from . import sam_annotator\n"},
                 "docks are independent of each other", DOCK_TO_DOCK, id="dock-from-dot-import-module"),
    pytest.param({"widgets/unet_predict.py": "import napari_gpuseg.widgets.sam_annotator\n"},
                 "docks are independent of each other", DOCK_TO_DOCK, id="dock-absolute-import"),
    pytest.param({"widgets/unet_predict.py": """
                      def _later():
                          from .sam_annotator import SamAnnotatorWidget
                          return SamAnnotatorWidget
                  """},
                 "docks are independent of each other", DOCK_TO_DOCK, id="dock-import-in-a-function"),
    pytest.param({"widgets/_prompts.py": "from . import sam_annotator\n",
                  "widgets/unet_predict.py": "from . import _prompts\n"},
                 "docks are independent of each other", "napari_gpuseg.widgets._prompts",
                 id="dock-through-a-shared-helper"),
    pytest.param({"engine/metrics.py": "from qtpy.QtWidgets import QWidget\n"},
                 "engine and models import no GUI package", "napari_gpuseg.engine.metrics -> qtpy",
                 id="engine-imports-qtpy"),
    pytest.param({"models/unet.py": "from ..engine import normalize\n"},
                 "widgets and cli above engine above io (files) above models",
                 "napari_gpuseg.models.unet -> napari_gpuseg.engine.normalize", id="models-import-engine"),
    pytest.param({"engine/metrics.py": "def _later():\n    import napari_gpuseg.widgets._dock\n"},
                 "widgets and cli above engine above io (files) above models",
                 "napari_gpuseg.engine.metrics -> napari_gpuseg.widgets._dock", id="engine-imports-widgets"),
])
def test_lint_imports_fails_on_a_broken_contract(tmp_path, edits, broken, shown):
    root = _copy_with(tmp_path, edits)
    proc = lint_imports(root)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"Contracts: \d+ kept, [1-9]\d* broken\.", proc.stdout), proc.stdout[-3000:]
    report = proc.stdout.split("Broken contracts", 1)[1]
    assert broken in report and shown in report, report
