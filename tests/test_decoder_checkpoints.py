"""Hostile decoder checkpoints (files Adapt SAM / ``train-sam`` write, edited by hand or
damaged): each is refused by every loader in one line that names the file, before any
download, recursion without end or a model that gives wrong masks."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from napari_gpuseg.engine.sam.loader import load_engine, load_sam_model
from napari_gpuseg.models import registry
from napari_gpuseg.models.state_dict_loading import CheckpointError
from napari_gpuseg.models.sam.decoder_checkpoint import apply_decoder

from sam_fixtures import require_lite_medsam

SHIPPED = registry.WEIGHTS_DIR / "nuclei_sam_decoder.pt"


@pytest.fixture(scope="module")
def shipped() -> dict:
    return torch.load(SHIPPED, map_location="cpu", weights_only=True)


def _save(path, doc, **changes):
    doc = {**doc, **changes}
    for k in [k for k, v in changes.items() if v is _DROP]:
        del doc[k]
    torch.save(doc, path)
    return path


_DROP = object()


def _one_line(exc) -> str:
    msg = str(exc)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


@pytest.fixture
def counted_reads(monkeypatch):
    """Fails fast where a loader would recurse without end: each level reads the file again."""
    real, calls = registry.read_if_decoder, []

    def read(path):
        calls.append(path)
        if len(calls) > 20:
            raise AssertionError(f"decoder files read {len(calls)} times: the loader recurses")
        return real(path)

    monkeypatch.setattr(registry, "read_if_decoder", read)
    return calls


def test_a_decoder_naming_itself_or_a_cycle_is_refused(shipped, tmp_path, counted_reads):
    me = tmp_path / "self_base.pt"
    _save(me, shipped, base=str(me))
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    _save(a, shipped, base=str(b))
    _save(b, shipped, base=str(a))
    for load in (load_engine, lambda p: registry.load_model(p)[0]):
        counted_reads.clear()
        with pytest.raises(CheckpointError, match="names itself as its base") as info:
            load(me)
        assert str(me) in _one_line(info.value)
        counted_reads.clear()
        with pytest.raises(CheckpointError, match="bases name each other") as info:
            load(a)
        assert f"'{a}' -> '{b}' -> '{a}'" in _one_line(info.value)
    # a relative name of the same file is the same file
    counted_reads.clear()
    rel = tmp_path / "rel.pt"
    _save(rel, shipped, base=str(tmp_path / "." / "rel.pt"))
    with pytest.raises(CheckpointError, match="names itself"):
        load_sam_model(rel)


def test_a_base_that_is_neither_a_file_nor_a_registry_model_is_named(shipped, tmp_path):
    path = _save(tmp_path / "lost.pt", shipped, base=str(tmp_path / "gone.pth"))
    with pytest.raises(CheckpointError, match="names the base .*gone.pth.*neither a file nor a registry model"):
        load_engine(path)


def test_base_sha256_is_checked(shipped, tmp_path):
    lite = require_lite_medsam()
    # a registry base: the decoder's hash against the registry's, before anything is loaded
    wrong = _save(tmp_path / "wrong_hash.pt", shipped, base_sha256="0" * 64)
    with pytest.raises(CheckpointError, match="'lite_medsam' is not the checkpoint it was trained on") as info:
        load_engine(wrong)
    assert "another encoder" in _one_line(info.value)
    # a file base: the file's own hash
    base = tmp_path / "my_lite.pth"
    shutil.copyfile(lite, base)
    good = _save(tmp_path / "good.pt", shipped, base=str(base))
    assert load_sam_model(good).decoder_tuned
    state = torch.load(lite, map_location="cpu", weights_only=True)
    key = next(k for k, v in state.items() if k.startswith("image_encoder") and v.is_floating_point())
    state[key] = state[key] + 0.01  # another encoder of the same architecture
    torch.save(state, base)
    for load in (load_engine, lambda p: registry.load_model(p)[0]):
        with pytest.raises(CheckpointError, match="my_lite.pth' is not the checkpoint it was trained on"):
            load(good)


def test_a_vit_h_base_is_compared_before_any_download(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_CACHE, str(tmp_path / "cache"))  # sam_vit_h not cached

    def no_download(url, *_a, **_k):
        raise AssertionError(f"a download of {url} started")

    monkeypatch.setattr(registry, "download_file", no_download)
    path = _save(tmp_path / "on_vit_h.pt", shipped, base="sam_vit_h")
    for load in (load_engine, lambda p: registry.load_model(p)[0]):
        with pytest.raises(CheckpointError, match="trained on a lite_medsam model, but its base 'sam_vit_h' is vit_h"):
            load(path)
    # the same input size and architecture but another hash: refused as well, before the download
    path = _save(tmp_path / "vit_b_hash.pt", shipped, base="sam_vit_b", arch="vit_b", image_size=1024)
    with pytest.raises(CheckpointError, match="'sam_vit_b' is not the checkpoint it was trained on"):
        load_engine(path)
    # a decoder written by hand without arch is compared by its input size
    path = _save(tmp_path / "size.pt", shipped, base="sam_vit_h", arch=_DROP, base_sha256=None)
    with pytest.raises(CheckpointError, match="trained at 256 px input, but its base 'sam_vit_h' takes 1024 px"):
        load_engine(path)


def _nan_state(doc, value=math.nan, every=True):
    state = dict(doc["state"])
    for i, k in enumerate(state):
        if state[k].is_floating_point() and (every or i == 3):
            state[k] = torch.full_like(state[k], value)
    return state


MALFORMED = {
    "base=5": (dict(base=5), "'base' must name"),
    "base=None": (dict(base=None), "'base' must name"),
    "base=''": (dict(base=""), "'base' must name"),
    "base=list": (dict(base=["lite_medsam"]), "'base' must name"),
    "no base": (dict(base=_DROP), "'base' must name"),
    "base_sha256=12": (dict(base_sha256=12), "'base_sha256' must be 64 hex digits"),
    "base_sha256=short": (dict(base_sha256="abc"), "'base_sha256' must be 64 hex digits"),
    "arch=vit_q": (dict(arch="vit_q"), "'arch' must be one of"),
    "arch=3": (dict(arch=3), "'arch' must be one of"),
    "image_size='256'": (dict(image_size="256"), "'image_size' must be"),
    "image_size=-1": (dict(image_size=-1), "'image_size' must be"),
    "click_zoom='x'": (dict(click_zoom="x"), "'click_zoom' must be a number from 1 to 4"),
    "click_zoom=nan": (dict(click_zoom=math.nan), "'click_zoom' must be"),
    "click_zoom=0": (dict(click_zoom=0.0), "'click_zoom' must be"),
    "click_zoom=1e9": (dict(click_zoom=1e9), "'click_zoom' must be"),
    "click_output=4": (dict(click_output=4), "'click_output' must be None or a candidate index from 0 to 3"),
    "click_output=-1": (dict(click_output=-1), "'click_output' must be"),
    "click_output=True": (dict(click_output=True), "'click_output' must be"),
    "click_output='1'": (dict(click_output="1"), "'click_output' must be"),
    "click_blend=0": (dict(click_blend=0), "'click_blend' must be None or a number above 0 and at most 100"),
    "click_blend=-1": (dict(click_blend=-1.0), "'click_blend' must be"),
    "click_blend=1e3": (dict(click_blend=1e3), "'click_blend' must be"),
    "click_blend=nan": (dict(click_blend=math.nan), "'click_blend' must be"),
    "click_blend=True": (dict(click_blend=True), "'click_blend' must be"),
    "click_blend='10'": (dict(click_blend="10"), "'click_blend' must be"),
    "click_threshold=9": (dict(click_threshold=9.0), "'click_threshold' must be None or a logit from -8 to 8"),
    "click_threshold=nan": (dict(click_threshold=math.nan), "'click_threshold' must be"),
    "click_threshold=True": (dict(click_threshold=True), "'click_threshold' must be"),
    "click_threshold='-2'": (dict(click_threshold="-2"), "'click_threshold' must be"),
    "no state": (dict(state=_DROP), "'state' must map"),
    "state=list": (dict(state=[1, 2]), "'state' must map"),
    "state={}": (dict(state={}), "'state' must map"),
    "state of numbers": (dict(state={"mask_decoder.iou_token.weight": 1.0}), "not named tensors"),
    "all NaN": ("nan", "every weight tensor.* NaN or infinite"),
    "one inf": ("inf", "1 weight tensor.* NaN or infinite"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_decoder_fields_are_one_checkpoint_error(shipped, tmp_path, case):
    change, match = MALFORMED[case]
    if change == "nan":
        change = dict(state=_nan_state(shipped))
    elif change == "inf":
        change = dict(state=_nan_state(shipped, math.inf, every=False))
    path = _save(tmp_path / "bad.pt", shipped, **change)
    with pytest.raises(CheckpointError, match=match) as info:
        load_engine(path)
    assert f"decoder checkpoint '{path}'" in _one_line(info.value)


def test_a_nan_decoder_given_as_a_dict_is_refused_before_it_changes_the_model(shipped):
    require_lite_medsam()
    sam = load_sam_model("lite_medsam")
    before = {k: v.clone() for k, v in sam.mask_decoder.state_dict().items()}
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        apply_decoder(sam, {**shipped, "state": _nan_state(shipped)})
    after = sam.mask_decoder.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not getattr(sam, "decoder_tuned", False) and np.isfinite(after["iou_token.weight"].numpy()).all()
