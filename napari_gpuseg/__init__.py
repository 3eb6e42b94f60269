"""napari-gpuseg: fast interactive and batch segmentation for napari."""

__version__ = "0.1.0"

# CPU inference keeps glibc's freed memory instead of page-faulting it back (engine/runtime/allocator.py)
from .engine.runtime.allocator import configure_allocator as _configure_allocator  # noqa: E402

_configure_allocator()
