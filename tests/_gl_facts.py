"""napari's OpenGL facts for a test process that draws with the offscreen Qt platform.

napari asks OpenGL for its extensions and its largest texture sizes the first time a process
makes an image layer, and keeps the first thing it gets (``functools.lru_cache``). Under the
offscreen platform a question sometimes meets no current context: between tests (a closed
viewer's canvas still listed as vispy's current one) and in some pytest-xdist workers from
their start. The extensions question then raises, but the texture-size question returns
``(None, None)``, which napari keeps; every image layer of that process then fails with
``TypeError: 'NoneType' object cannot be interpreted as an integer`` and no viewer of it can
be closed (41 failed tests and 40 errors in one CI run, all in one worker).

:func:`ask_gl_facts` asks both questions before the process's first viewer, keeps only real
answers (a non-empty extension list, two positive sizes) and asks again otherwise, first as
napari does, then with a hidden vispy canvas of its own made current. A process where no try
is answered has no OpenGL to draw with anyway (offscreen draws nothing): :func:`install_fallback`
gives its image layers the answers of a GPU without float textures and with 2048 px textures,
and a warning says so.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable

# llvmpipe's largest 3D texture, and within every desktop GPU's 2D limit
FALLBACK_TEXTURE_SIZES = (2048, 2048)


def answered(extensions: Any, sizes: Any) -> bool:
    """True when both of napari's questions got a real answer."""
    if not isinstance(extensions, str) or not extensions:
        return False
    try:
        return len(sizes) == 2 and all(s is not None and int(s) > 0 for s in sizes)
    except TypeError:
        return False


def _clear(napari_gl) -> None:
    napari_gl.get_gl_extensions.cache_clear()
    napari_gl.get_max_texture_sizes.cache_clear()


def _hidden_canvas():
    from vispy.app import Canvas

    canvas = Canvas(show=False)
    canvas.set_current()
    return canvas


def ask_gl_facts(tries: int = 6, pause_s: float = 0.2,
                 process_events: Callable[[], None] | None = None,
                 make_canvas: Callable[[], Any] = _hidden_canvas,
                 set_attr: Callable[[Any, str, Any], None] = setattr) -> bool:
    """Have napari's cached OpenGL facts be real answers; returns False when the fallback
    had to be installed (see the module docstring)."""
    from napari._vispy.utils import gl as napari_gl

    problem = "no try"
    for attempt in range(tries):
        _clear(napari_gl)
        canvas = make_canvas() if attempt else None  # napari's own way first
        try:
            extensions = napari_gl.get_gl_extensions()
            sizes = napari_gl.get_max_texture_sizes()
            if answered(extensions, sizes):
                return True
            problem = f"texture sizes {sizes!r}, {len(extensions or '')} characters of extensions"
        except Exception as exc:  # noqa: BLE001 - asked again below
            problem = repr(exc)
        finally:
            if canvas is not None:
                canvas.close()
        if process_events is not None:
            process_events()
        time.sleep(pause_s)
    _clear(napari_gl)
    install_fallback(set_attr)  # before the warning: `-W error` raises there
    warnings.warn(f"no OpenGL answer in this test process after {tries} tries ({problem}): "
                  "image layers are made as for a GPU without float textures and with "
                  f"{FALLBACK_TEXTURE_SIZES[0]} px textures", stacklevel=2)
    return False


def install_fallback(set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Point every napari module that asks at fixed answers (see the module docstring)."""
    from napari._vispy import canvas
    from napari._vispy.layers import base, image, labels

    for module in (canvas, base, image, labels):
        set_attr(module, "get_max_texture_sizes", lambda: FALLBACK_TEXTURE_SIZES)
    set_attr(image, "get_gl_extensions", lambda: "")
