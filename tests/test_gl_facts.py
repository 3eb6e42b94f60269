"""The test processes' OpenGL facts (tests/_gl_facts.py): a non-answer is asked again, never
kept, and a process that gets no answer still makes image layers."""
import functools

import numpy as np
import pytest
from napari._vispy.utils import gl as napari_gl

import _gl_facts


class _Canvas:
    made = 0

    def __init__(self):
        _Canvas.made += 1

    def close(self):
        pass


def _fake(monkeypatch, extensions, sizes):
    """napari's two cached questions, answered from the given lists in turn."""
    calls = {"extensions": 0, "sizes": 0}

    @functools.lru_cache(maxsize=1)
    def get_gl_extensions():
        answer = extensions[min(calls["extensions"], len(extensions) - 1)]
        calls["extensions"] += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    @functools.lru_cache
    def get_max_texture_sizes():
        answer = sizes[min(calls["sizes"], len(sizes) - 1)]
        calls["sizes"] += 1
        return answer

    monkeypatch.setattr(napari_gl, "get_gl_extensions", get_gl_extensions)
    monkeypatch.setattr(napari_gl, "get_max_texture_sizes", get_max_texture_sizes)
    return calls


@pytest.mark.parametrize("answer", [(None, None), (16384, None), (0, 2048), ()])
def test_a_texture_size_non_answer_is_asked_again_and_the_real_one_kept(monkeypatch, answer):
    """What broke a CI worker: no current context, so the sizes came back as (None, None)
    and napari kept them."""
    calls = _fake(monkeypatch, ["GL_ARB_texture_float"], [answer, (np.int32(16384), np.int32(2048))])
    _Canvas.made = 0
    assert _gl_facts.ask_gl_facts(pause_s=0, make_canvas=_Canvas)
    assert calls["sizes"] == 2 and _Canvas.made == 1  # the second try with a canvas of our own
    assert napari_gl.get_max_texture_sizes() == (16384, 2048)  # kept: not asked a third time
    assert calls["sizes"] == 2


def test_an_extensions_question_that_raises_is_asked_again(monkeypatch):
    calls = _fake(monkeypatch, [AttributeError("'NoneType' object has no attribute 'decode'"),
                                "GL_ARB_texture_float"], [(16384, 2048)])
    assert _gl_facts.ask_gl_facts(pause_s=0, make_canvas=_Canvas)
    assert calls["extensions"] == 2


@pytest.mark.parametrize(("extensions", "sizes", "ok"), [
    ("GL_ARB_texture_float", (16384, 2048), True),
    ("GL_ARB_texture_float", (np.int32(16384), np.int32(2048)), True),
    ("", (16384, 2048), False),
    (None, (16384, 2048), False),
    ("GL_ARB_texture_float", (None, None), False),
    ("GL_ARB_texture_float", (16384,), False),
    ("GL_ARB_texture_float", None, False),
])
def test_only_real_answers_count(extensions, sizes, ok):
    assert _gl_facts.answered(extensions, sizes) is ok


def test_a_process_never_answered_still_makes_image_layers(monkeypatch, make_napari_viewer):
    """No try answered: the fallback is installed (with a warning) and a viewer adds and
    removes an image layer, where napari's kept non-answer failed every one."""
    _fake(monkeypatch, [AttributeError("no context")], [(None, None)])
    from napari._vispy import canvas
    from napari._vispy.layers import base, image, labels

    for module in (canvas, base, image, labels):  # what napari kept: every image layer fails
        monkeypatch.setattr(module, "get_max_texture_sizes", lambda: (None, None))
    with pytest.warns(UserWarning, match="no OpenGL answer in this test process after 3 tries"):
        assert not _gl_facts.ask_gl_facts(tries=3, pause_s=0, make_canvas=_Canvas,
                                          set_attr=monkeypatch.setattr)
    assert image.get_gl_extensions() == ""
    assert image.get_max_texture_sizes() == _gl_facts.FALLBACK_TEXTURE_SIZES
    viewer = make_napari_viewer()
    layer = viewer.add_image(np.random.default_rng(0).random((64, 80), dtype=np.float32))
    viewer.add_labels(np.zeros((64, 80), np.uint16))
    assert layer in viewer.window._qt_viewer.canvas.layer_to_visual
    viewer.layers.clear()

