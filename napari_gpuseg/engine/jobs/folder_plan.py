"""What a folder job will do, decided before any file is read, the same for a run in this
process (:mod:`.pipeline`) and on a Dask cluster (:mod:`.dask_runner`): the device list,
the work item of each input file (an output name already taken gets an error row), and
the error that stops a run as a whole. GUI-free."""
from __future__ import annotations

from pathlib import Path

from .file_step import Item
from .outputs import foreign_output, output_paths, rel_name, same_folder
from .report import ImageStatus, RunReport, safe_text


class PipelineError(RuntimeError):
    """The run as a whole failed (for example the model could not be loaded)."""


def parse_devices(devices) -> list[str]:
    """``None`` -> ``["auto"]``; ``"cuda:0,cuda:1"`` -> a list. A list that names no
    device (``","``, ``" "``, ``[]``) is a ValueError: it would start no worker."""
    if devices is None:
        return ["auto"]
    parts = devices.split(",") if isinstance(devices, str) else list(devices)
    names = [str(d).strip() for d in parts if str(d).strip()]
    if not names:
        raise ValueError(f"the device list {devices!r} names no device "
                         "(give e.g. cpu, cuda:0 or cuda:0,cuda:1, or leave it out for the best one)")
    return names


def plan_items(found: list[Path], in_dir: Path, out_dir: Path, report: RunReport, earlier: dict) -> list[Item]:
    """The work items of ``found``; a file whose output name is already taken (by another
    input, or by a file this program did not write) gets an error row in ``report``."""
    items, seen, foreign = [], {}, []
    listed = {r.labels for r in earlier.values() if r.labels}
    for i, f in enumerate(found):
        src_rel = rel_name(f, in_dir)
        rel = safe_text(src_rel)  # a name that is not valid UTF-8 is escaped in the report
        lp, tp = output_paths(in_dir, out_dir, f)
        item = Item(i, Path(f), rel, lp, tp, safe_text(lp.relative_to(out_dir).as_posix()), src_rel=src_rel)
        if lp in seen:
            report.rows.append(ImageStatus(rel, status="error",
                                           error=f"output name {lp.name} already used by {seen[lp]}"))
            continue
        seen[lp] = rel
        other = foreign_output(lp, tp, item.labels_rel, listed)
        if other is not None:  # never replace a file this program did not write
            foreign.append(other)
            report.rows.append(ImageStatus(rel, status="error", error=(
                f"not overwritten: {other.name} exists and was not written by napari-gpuseg "
                "(move it away or choose another output folder)")))
            continue
        items.append(item)
    if same_folder(in_dir, out_dir) and foreign:
        raise PipelineError(
            f"the output folder is the input folder and {len(foreign)} output name(s) are taken by "
            f"files napari-gpuseg did not write (e.g. {foreign[0].name}); choose another output folder")
    return items
