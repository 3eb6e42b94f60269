"""Keep vispy's mesh shaders compiled while a shape is dragged.

napari draws a shapes layer (the annotator's **SAM boxes**) as a vispy ``MeshVisual``. Every
data change of a mesh -- each mouse move while a box is dragged, each box written -- runs
``MeshVisual._update_data``, which builds a new ``color_transform`` shader function
(``_build_color_transform``; vispy issue 2568, filed for 0.14, still so in 0.17.0). A new function
object, even with the same code, makes vispy generate, compile and link the mesh's program
again at the next draw. In software GL (llvmpipe) a mouse move of a box drag cost the window
58 ms that way and 46 ms without it (``benchmarks/mesh_shader.py``).

:func:`install` makes ``_build_color_transform`` hand a mesh the function it made last time
when the same pass-through transform is asked for: the shader code is the same, so nothing is
compiled again; the colormap transform (a mesh coloured by values) is made as before. It
changes no drawing (``tests/test_mesh_shader.py`` compares the pixels). Each annotator dock holds
it (:func:`hold`) until the dock is closed or deleted, and vispy's own method is back once the
last one has let go; meanwhile it serves every mesh of the napari process, so other shapes
layers gain too (``benchmarks/first_mask.py --mesh-shader alternate`` measures it in the
annotator).
"""
from __future__ import annotations

import weakref

_MARK = "_gpuseg_keeps_shader"
_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # mesh -> its pass-through function
_HOLDERS = [0]  # docks that hold the fix


def hold():
    """Install the fix for one holder (an annotator dock); returns the callable that lets go
    of it (vispy's own method comes back when the last holder has let go). Each call of that
    callable after the first does nothing."""
    _HOLDERS[0] += 1
    install()
    held = [True]

    def release() -> None:
        if held[0]:
            held[0] = False
            _HOLDERS[0] -= 1
            if _HOLDERS[0] == 0:
                uninstall()
    return release


def install() -> bool:
    """Patch ``vispy.visuals.mesh.MeshVisual._build_color_transform`` (once per process);
    False when vispy has no such method (a vispy that changed it: nothing to do)."""
    try:
        from vispy.visuals.mesh import MeshVisual
    except ImportError:  # pragma: no cover - napari always brings vispy
        return False
    build = getattr(MeshVisual, "_build_color_transform", None)
    if build is None:
        return False
    if getattr(build, _MARK, False):
        return True

    def _build_color_transform(self, colors):
        if colors.ndim == 2 and colors.shape[1] == 1:  # values through a colormap: as vispy does
            return build(self, colors)
        kept = _KEPT.get(self)
        if kept is None:  # (vispy's visuals refuse new attributes: kept beside the mesh)
            kept = _KEPT[self] = build(self, colors)
        return kept

    setattr(_build_color_transform, _MARK, True)
    _build_color_transform.__wrapped__ = build
    MeshVisual._build_color_transform = _build_color_transform
    return True


def uninstall() -> None:
    """Put vispy's own method back (the benchmark's same-run baseline)."""
    from vispy.visuals.mesh import MeshVisual

    build = MeshVisual._build_color_transform
    if getattr(build, _MARK, False):
        MeshVisual._build_color_transform = build.__wrapped__
