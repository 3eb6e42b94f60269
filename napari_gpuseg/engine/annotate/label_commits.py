"""Committing masks into a label volume, with undo. Pure numpy: no GUI, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Commit:
    index: tuple  # leading (slice) index into the label array
    coords: tuple[np.ndarray, ...]  # pixel coordinates written, in the 2D plane (3D: z, y, x)
    previous: np.ndarray  # values they had before
    ids: list[int]


@dataclass
class LabelCommitter:
    """Writes 2D masks into (a slice of) a label array; each commit can be undone.

    ``overwrite=False`` (default) paints only background pixels, so objects already
    committed or painted by hand are never erased by a new one.
    """

    overwrite: bool = False
    max_undo: int = 50
    history: list[_Commit] = field(default_factory=list)

    @staticmethod
    def next_id(labels: np.ndarray) -> int:
        return int(labels.max(initial=0)) + 1

    def commit(self, labels: np.ndarray, masks: list[np.ndarray], index: tuple = ()) -> list[int]:
        """Write each mask with its own new id into ``labels[index]``; returns the ids used."""
        plane = labels[index] if index else labels
        next_id = self.next_id(labels)
        ys_all, xs_all, prev_all, ids = [], [], [], []
        for mask in masks:
            mask = np.asarray(mask, dtype=bool)
            if mask.shape != plane.shape:
                raise ValueError(f"mask shape {mask.shape} does not match labels {plane.shape}")
            write = mask if self.overwrite else mask & (plane == 0)
            ys, xs = np.nonzero(write)
            if len(ys) == 0:
                continue
            prev_all.append(plane[ys, xs].copy())
            plane[ys, xs] = next_id
            ys_all.append(ys)
            xs_all.append(xs)
            ids.append(next_id)
            next_id += 1
        if ids:
            self.history.append(_Commit(index, (np.concatenate(ys_all), np.concatenate(xs_all)),
                                        np.concatenate(prev_all), ids))
            del self.history[:-self.max_undo]
        return ids

    def undo(self, labels: np.ndarray) -> list[int]:
        """Revert the last commit (pixels still carrying its ids go back). Returns its ids."""
        if not self.history:
            return []
        c = self.history.pop()
        plane = labels[c.index] if c.index else labels
        current = plane[c.coords]
        still = np.isin(current, c.ids)  # a pixel repainted by hand since is left alone
        plane[tuple(a[still] for a in c.coords)] = c.previous[still]
        return c.ids

    def open_group(self, labels: np.ndarray) -> None:
        """Start one undo step for 3D objects written slice by slice with :meth:`commit_slice`
        (a propagated object, or every object of "Segment all objects in 3D")."""
        self.history.append(_Commit((), tuple(np.empty(0, np.intp) for _ in range(3)),
                                    np.empty(0, labels.dtype), []))
        del self.history[:-self.max_undo]

    def commit_slice(self, labels: np.ndarray, z: int, mask: np.ndarray, obj_id: int) -> None:
        """Write one slice of 3D object ``obj_id`` into ``labels`` (Z, Y, X) as part of the
        step opened by :meth:`open_group`; undo removes the whole group at once."""
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != labels.shape[1:]:
            raise ValueError(f"mask shape {mask.shape} does not match label slices {labels.shape[1:]}")
        if not self.history or len(self.history[-1].coords) != 3:
            self.open_group(labels)
        step = self.history[-1]
        if obj_id not in step.ids:
            step.ids.append(obj_id)
        plane = labels[z]
        write = mask if self.overwrite else mask & (plane == 0)
        ys, xs = np.nonzero(write)
        if len(ys):
            step.previous = np.concatenate([step.previous, plane[ys, xs]])
            plane[ys, xs] = obj_id
            step.coords = (np.concatenate([step.coords[0], np.full(len(ys), z, np.intp)]),
                           np.concatenate([step.coords[1], ys]), np.concatenate([step.coords[2], xs]))
