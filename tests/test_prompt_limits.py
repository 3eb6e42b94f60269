"""Engine API misuse: prompts no user means (labels other than 0/1, clicks off the image,
10,000 points) and an image 12,000 times longer than wide. Each is refused in one line
before any work, or works; none allocates gigabytes or ends in a torch error."""
from __future__ import annotations

import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine import Prompt, load_engine
from napari_gpuseg.engine.sam.interactive.crop_look import crop_look
from napari_gpuseg.engine.sam.automatic.everything import AutomaticParams, plan_crops, segment_everything
from napari_gpuseg.engine.sam.interactive.inputs import view_input
from napari_gpuseg.engine.sam.interactive.prompt_types import MAX_POINTS

from sam_fixtures import require_lite_medsam


@pytest.fixture(scope="module")
def engine():
    require_lite_medsam()
    return load_engine()  # nuclei_sam: the model that takes clicks


@pytest.fixture(scope="module")
def field(shared_data):
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[16]  # a validation field
    return tifffile.imread(f)


@pytest.mark.parametrize("labels, shown", [([7], "got 7"), ([-1], "got -1"), ([0.5], "got 0.5"),
                                           ([np.nan], "got nan"), (["pos"], "got ['pos']")])
def test_point_labels_other_than_0_and_1_are_refused(labels, shown):
    with pytest.raises(ValueError, match=r"point labels must be 1 \(positive\) or 0 \(negative\)") as info:
        Prompt(points=[[10, 10]], labels=labels)
    assert shown in str(info.value) and "\n" not in str(info.value)
    ok = Prompt(points=[[10, 10], [20, 20]], labels=[True, 0.0])  # bools and whole floats are 1 and 0
    assert ok.labels.tolist() == [1, 0] and ok.labels.dtype == np.int64


def test_a_prompt_with_too_many_points_is_refused_before_any_work():
    pts = np.random.default_rng(0).uniform(0, 500, (10_000, 2))
    with pytest.raises(ValueError, match=f"at most {MAX_POINTS} points, got 10000"):
        Prompt(points=pts)
    assert len(Prompt(points=pts[:MAX_POINTS]).points) == MAX_POINTS


def test_a_positive_click_off_the_image_is_refused_like_a_box(engine, field):
    img = field[:256, :256]
    h, w = img.shape
    for pts in ([[300, 20]], [[20, -3]], [[20, 20], [20, 400]]):
        prompt = Prompt(points=pts)
        with pytest.raises(ValueError, match=f"positive point .* lies outside the {w} x {h} image"):
            engine.predict(img, [prompt])
        with pytest.raises(ValueError, match="lies outside"):
            crop_look(engine, engine.prepare(img), prompt)
    # the edges of both pixel conventions are on the image (napari: -0.5 .. W-0.5; SAM: 0 .. W)
    for x, y in ((-0.5, -0.5), (w, h), (w - 0.5, 0)):
        Prompt(points=[[x, y]]).check_inside((h, w))
    # a negative point beside the image still is a normal prompt (checked in test_sam_engine)
    Prompt(points=[[30, 20], [30, -6]], labels=[1, 0]).check_inside((h, w))


def test_segment_everything_on_a_one_pixel_strip(engine, field):
    """One row of a BBBC039 field (1 x 696): shrunk into the 256 px input whole, it is under
    half a pixel high. Tiles take it; a forced whole-image crop is one pixel high."""
    strip = field[260:261]
    params = AutomaticParams.for_model(engine.info.box_trained, engine.info.decoder_tuned, points_per_side=4)
    res = segment_everything(engine, strip, params)
    prepared = engine.prepare(strip)
    crops = plan_crops(engine, prepared, params)
    assert crops and all(c.view.h == 1 for c in crops) and all(c.view.w <= 256 for c in crops)
    assert res.labels.shape == strip.shape and res.n_prompts == 16 * len(crops)
    # the official crop geometry keeps the whole image: one pixel high in the input
    params.tiling = "crops"
    (whole,) = plan_crops(engine, prepared, params)
    assert whole.view.resized_hw == (1, 256)
    assert view_input(prepared, whole.view, engine.info.normalization).shape == (3, 256, 256)
