"""Seam stitching: objects cut by a block seam get one id, ids unique over the image.

Both blocks of a seam segment the pixels within ``halo`` of it (each with context on both
sides). In the zone around the seam, a pair of objects (one of each block) whose overlap
covers at least ``min_fraction`` of the smaller of the two is one object. Pairs become
edges of a graph over (block, local id); its connected components are the objects of the
image, numbered 1..N in the order of their first block. GUI-free, torch-free.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .plan import Block, Seam


def zone_of(ext_labels: np.ndarray, block: Block, seam: Seam) -> np.ndarray:
    """The part of a block's extended-region labels inside the seam's zone."""
    sl = tuple(slice(z0 - e0, z1 - e0) for (z0, z1), (e0, _) in zip(seam.zone, block.ext))
    return ext_labels[sl]


def match_objects(a: np.ndarray, b: np.ndarray, min_fraction: float = 0.5) -> np.ndarray:
    """(k, 2) pairs of ids (of ``a``, of ``b``) that are one object: their overlap in
    these same-shape zone arrays is at least ``min_fraction`` of the smaller one's area."""
    if a.shape != b.shape:
        raise ValueError(f"seam zones differ in shape: {a.shape} vs {b.shape}")
    a = a.ravel().astype(np.int64)
    b = b.ravel().astype(np.int64)
    both = (a > 0) & (b > 0)
    if not both.any():
        return np.zeros((0, 2), np.int64)
    nb = int(b.max()) + 1
    pairs, inter = np.unique(a[both] * nb + b[both], return_counts=True)
    ia, ib = pairs // nb, pairs % nb
    area_a = np.bincount(a)[ia]
    area_b = np.bincount(b)[ib]
    keep = inter >= min_fraction * np.minimum(area_a, area_b)
    return np.stack([ia[keep], ib[keep]], axis=1)


def global_ids(counts: Sequence[int], in_core: Sequence[np.ndarray],
               pairs: Sequence[tuple[int, int, np.ndarray]]) -> tuple[list[np.ndarray], int]:
    """Per block a lookup table local id -> image id, and the number of objects.

    ``counts[k]``: the largest local id of block k; ``in_core[k]``: the local ids with
    pixels in block k's core (only they get an id); ``pairs``: (block a, block b, (m, 2)
    array of matched local ids)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    offsets = np.concatenate([[0], np.cumsum([int(c) + 1 for c in counts])]).astype(np.int64)
    total = int(offsets[-1])
    rows, cols = [np.arange(total)], [np.arange(total)]
    for ka, kb, m in pairs:
        if len(m):
            rows.append(offsets[ka] + m[:, 0])
            cols.append(offsets[kb] + m[:, 1])
    r, c = np.concatenate(rows), np.concatenate(cols)
    graph = coo_matrix((np.ones(len(r), np.int8), (r, c)), shape=(total, total))
    _, comp = connected_components(graph, directed=False)
    present = np.zeros(total, bool)
    for k, ids in enumerate(in_core):
        ids = np.asarray(ids, np.int64)
        present[offsets[k] + ids[ids > 0]] = True
    nodes = np.nonzero(present)[0]  # in block order, then local id order
    comps, first = np.unique(comp[nodes], return_index=True)
    order = np.argsort(first, kind="stable")
    new_id = np.zeros(int(comp.max()) + 1, np.int64)
    new_id[comps[order]] = np.arange(1, len(comps) + 1)
    luts = []
    for k in range(len(counts)):
        node = np.arange(offsets[k], offsets[k + 1])
        lut = np.where(present[node], new_id[comp[node]], 0)
        luts.append(lut.astype(np.uint32 if len(comps) < 2**32 else np.uint64))
    return luts, len(comps)
