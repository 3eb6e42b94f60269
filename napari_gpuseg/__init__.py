"""napari-gpuseg: fast interactive and batch segmentation for napari."""

__version__ = "0.1.0"

# Importing the package changes no process-wide setting: the allocator set-up for CPU work
# (engine/runtime/allocator.py) is applied by the command-line programs and by the workers
# when they first run on the CPU.
