"""Deterministic splitting of a file list across jobs (``--shard I/N``, SLURM job arrays)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N`` (0-based)."""
    try:
        i_s, n_s = str(text).split("/")
        index, count = int(i_s), int(n_s)
    except ValueError as exc:
        raise ValueError(f"shard must look like I/N (e.g. 0/4), got {text!r}") from exc
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {text!r}: need 0 <= I < N")
    return index, count


def shard_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """The shard of a SLURM job-array task, or None outside a job array.

    Uses ``SLURM_ARRAY_TASK_ID`` with ``SLURM_ARRAY_TASK_MIN`` / ``_STEP`` (so arrays such
    as ``--array=1-8`` or ``--array=0-14:2`` work) and ``SLURM_ARRAY_TASK_COUNT`` (or
    ``_MAX``).
    """
    env = os.environ if env is None else env
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task in (None, ""):
        return None
    task_id = int(task)
    first = int(env.get("SLURM_ARRAY_TASK_MIN") or 0)
    step = int(env.get("SLURM_ARRAY_TASK_STEP") or 1)
    if env.get("SLURM_ARRAY_TASK_COUNT"):
        count = int(env["SLURM_ARRAY_TASK_COUNT"])
    elif env.get("SLURM_ARRAY_TASK_MAX"):
        count = (int(env["SLURM_ARRAY_TASK_MAX"]) - first) // step + 1
    else:
        raise ValueError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not")
    index = (task_id - first) // step
    if not 0 <= index < count:
        raise ValueError(f"SLURM array task {task_id} is outside {first}..(+{count} tasks)")
    return index, count


def resolve_shard(
    shard: str | tuple[int, int] | None, env: Mapping[str, str] | None = None
) -> tuple[int, int] | None:
    """An explicit shard wins; otherwise the scheduler's array index; otherwise None."""
    if shard is None or shard == "":
        return shard_from_env(env)
    if isinstance(shard, str):
        return parse_shard(shard)
    index, count = (int(v) for v in shard)
    return parse_shard(f"{index}/{count}")


def shard_files(
    files: Sequence[str | os.PathLike], index: int, count: int, root: str | os.PathLike | None = None
) -> list[Path]:
    """Every ``count``-th file starting at ``index`` of the files sorted by path (relative to
    ``root`` when given), so shards 0..N-1 cover every file exactly once on any machine."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"bad shard {index}/{count}")
    base = Path(root).resolve() if root is not None else None

    def key(p: Path) -> str:
        return (p.resolve().relative_to(base) if base else p).as_posix()

    ordered = sorted((Path(f) for f in files), key=key)
    return ordered[index::count]
