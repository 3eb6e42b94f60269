"""Big images in blocks with a halo, seams stitched, labels written block by block to
OME-Zarr (see :mod:`.run`)."""
from .plan import Block, BlockPlan, plan_blocks
from .run import BlockReport, BlockRunError, run_blocks
from .tasks import ArraySource

__all__ = ["ArraySource", "Block", "BlockPlan", "BlockReport", "BlockRunError", "plan_blocks", "run_blocks"]
