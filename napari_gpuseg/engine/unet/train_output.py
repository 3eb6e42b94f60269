"""Where a training run's checkpoint goes: checked before training, a fallback after a
failed save (disk full, folder removed), so a trained model is never lost."""
from __future__ import annotations

import os
from pathlib import Path


def check_output_path(path) -> Path:
    """Fail before training (``OSError`` with one line) when ``path`` cannot be written: a
    folder, a parent that cannot be created, a read-only or special file system. Writes
    and removes a probe file beside ``path``."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint path {path} is a folder; give a file name such as model.pt")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".{path.name}.{os.getpid()}.probe"
        with open(probe, "wb") as fh:
            fh.write(b"probe")
        probe.unlink()
    except OSError as exc:
        raise OSError(f"cannot write the checkpoint {path}: "
                      f"{exc.strerror or type(exc).__name__} (checked before training)") from exc
    return path


def fallback_checkpoint_path(path) -> Path:
    """Where a checkpoint goes when ``path`` fails during training: the temp folder."""
    import tempfile

    path = Path(path)
    return Path(tempfile.gettempdir()) / f"napari-gpuseg-{os.getpid()}-{path.stem}{path.suffix or '.pt'}"


class SaveTarget:
    """The checkpoint path; after a failed save (disk full, folder removed) every later
    save goes to :func:`fallback_checkpoint_path` and :attr:`failure` says where and why."""

    def __init__(self, path) -> None:
        self.path = Path(path)
        self.failure: str | None = None

    def save(self, write):
        try:
            return write(self.path)
        except (OSError, RuntimeError) as exc:  # torch's zip writer raises RuntimeError on ENOSPC
            if self.failure is not None:  # the fallback failed too: nothing left to try
                raise
            first = (getattr(exc, "strerror", None) or str(exc)).splitlines()[0][:200]
            reason = f"{type(exc).__name__}: {first}"
            self.path = fallback_checkpoint_path(self.path)
            self.failure = f"could not write the checkpoint ({reason}); saved to {self.path} instead"
            return write(self.path)
