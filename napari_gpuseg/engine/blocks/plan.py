"""Block planning: a grid of cores that tile the image, each read with a halo of context.

A block's *core* is the part of the image it owns in the output; its *extended* region is
the core grown by ``halo`` pixels on every side (clipped to the image), which is what the
method segments. Neighbouring blocks share a seam; the labels both see within ``halo`` of
a seam are what :mod:`.stitch` compares to give an object cut by the seam one id.
GUI-free, torch-free.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence


MIN_BLOCK = 16  # pixels a side (or the image's size along that axis)
MAX_BLOCKS = 100_000  # a run's work folder holds a record per block


@dataclass(frozen=True)
class Block:
    """One block: its grid position, core and extended region (as (start, stop) pairs)."""

    index: int
    grid: tuple[int, ...]
    core: tuple[tuple[int, int], ...]
    ext: tuple[tuple[int, int], ...]

    @property
    def name(self) -> str:
        return "_".join(str(g) for g in self.grid)

    def core_slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.core)

    def ext_slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.ext)

    def core_in_ext(self) -> tuple[slice, ...]:
        """The core as slices of the extended region's array."""
        return tuple(slice(c0 - e0, c1 - e0) for (c0, c1), (e0, _) in zip(self.core, self.ext))

    @property
    def core_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.core)


@dataclass(frozen=True)
class Seam:
    """The face shared by block ``lower`` and block ``upper`` (the next one along ``axis``)
    at coordinate ``at``; ``zone`` is the region both compare (``width`` each side)."""

    lower: int
    upper: int
    axis: int
    at: int
    zone: tuple[tuple[int, int], ...]


def _tuple(value, n: int, what: str) -> tuple[int, ...]:
    vals = (value,) * n if isinstance(value, int) else tuple(int(v) for v in value)
    if len(vals) != n:
        raise ValueError(f"{what} {value!r} has {len(vals)} values for a {n}-D image")
    return vals


@dataclass(frozen=True)
class BlockPlan:
    shape: tuple[int, ...]
    block: tuple[int, ...]
    halo: tuple[int, ...]
    blocks: tuple[Block, ...]
    grid_shape: tuple[int, ...]

    def seams(self, width: Sequence[int] | None = None) -> list[Seam]:
        """Every face between neighbours; the zone is ``width`` (default halo // 2, at least
        1) pixels each side of the seam, over the shared core range of the other axes."""
        w = tuple(width) if width is not None else tuple(max(1, h // 2) for h in self.halo)
        by_grid = {b.grid: b for b in self.blocks}
        out = []
        for b in self.blocks:
            for axis in range(len(self.shape)):
                g = list(b.grid)
                g[axis] += 1
                nb = by_grid.get(tuple(g))
                if nb is None:
                    continue
                at = b.core[axis][1]
                zone = list(b.core)
                zone[axis] = (max(b.ext[axis][0], at - w[axis]), min(nb.ext[axis][1], at + w[axis]))
                out.append(Seam(b.index, nb.index, axis, at, tuple(zone)))
        return out


def plan_blocks(shape: Sequence[int], block: int | Sequence[int], halo: int | Sequence[int]) -> BlockPlan:
    """Cores of size ``block`` (the last ones smaller) covering ``shape``, in C order, each
    extended by ``halo`` (clipped to the image). ``halo`` must be smaller than ``block``;
    ``block`` at least ``MIN_BLOCK`` a side (or the image's size), at most ``MAX_BLOCKS``
    blocks: else ``ValueError`` with a one-line reason."""
    shape = tuple(int(s) for s in shape)
    n = len(shape)
    asked = _tuple(block, n, "block size")
    if any(s < 1 for s in shape):
        raise ValueError(f"image shape {shape} must be positive")
    if any(b < MIN_BLOCK and b < s for b, s in zip(asked, shape)):
        raise ValueError(f"block size {block!r} is too small: at least {MIN_BLOCK} pixels a side "
                         "(1024 in 2D, 128 in 3D by default)")
    blk = tuple(min(b, s) for b, s in zip(asked, shape))
    hal = _tuple(halo, n, "halo")
    if any(h < 0 for h in hal) or any(h >= b and b < s for h, b, s in zip(hal, blk, shape)):
        raise ValueError(f"halo {hal} must be >= 0 and smaller than the block size {blk}")
    grid_shape = tuple(-(-s // b) for s, b in zip(shape, blk))
    n_blocks = 1
    for g in grid_shape:
        n_blocks *= g
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"block size {block!r} gives {n_blocks} blocks for an image of {shape}: at most "
                         f"{MAX_BLOCKS}, choose bigger blocks")
    blocks = []
    for i, g in enumerate(itertools.product(*(range(k) for k in grid_shape))):
        core = tuple((gi * b, min(s, (gi + 1) * b)) for gi, b, s in zip(g, blk, shape))
        ext = tuple((max(0, c0 - h), min(s, c1 + h)) for (c0, c1), h, s in zip(core, hal, shape))
        blocks.append(Block(i, tuple(g), core, ext))
    return BlockPlan(shape, blk, hal, tuple(blocks), grid_shape)
