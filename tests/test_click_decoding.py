"""Clicks: zoomed views (geometry, routing, the checkpoint field) and the first click's candidates."""
import numpy as np
import pytest
import torch

from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.finetune import finetune_sam
from napari_gpuseg.engine.sam.training.tune_config import SamTuneConfig
from napari_gpuseg.engine.sam.interactive.predictor import MaskResult, Prompt
from napari_gpuseg.engine.sam.training.train_views import collect_views
from napari_gpuseg.engine.sam.interactive.views import View, route_click, touches_cut, zoom_grid
from napari_gpuseg.models.sam.decoder_checkpoint import read_decoder

from sam_fixtures import require_lite_medsam


def test_zoom_grid_tiles_cover_the_image_at_the_finer_scale():
    views = zoom_grid((520, 696), 256, 1.5)
    assert {(v.h, v.w) for v in views} == {(171, 171)}
    assert all(v.scale == pytest.approx(256 / 171) for v in views)
    covered = np.zeros((520, 696), bool)
    for v in views:
        covered[v.y0:v.y1, v.x0:v.x1] = True
    assert covered.all()
    assert zoom_grid((520, 696), 256, 1.0) == zoom_grid((520, 696), 256, 0.5)  # the native grid
    assert {(v.h, v.w) for v in zoom_grid((520, 696), 256, 1.0)} == {(256, 256)}


def test_a_click_goes_to_the_view_holding_it_most_centrally():
    views = zoom_grid((520, 696), 256, 1.5)
    v = route_click(np.array([[300.0, 200.0]]), views)
    assert v.contains_box(np.array([300, 200, 300, 200]))
    best = max(v2.centrality(np.array([300, 200, 300, 200])) for v2 in views
               if v2.contains_box(np.array([300, 200, 300, 200])))
    assert v.centrality(np.array([300, 200, 300, 200])) == best >= 21
    # several points: the view holds them all
    pts = np.array([[10.0, 10.0], [150.0, 120.0]])
    v = route_click(pts, views)
    assert v.contains_box(np.r_[pts.min(0), pts.max(0)])
    assert route_click(np.array([[10.0, 10.0], [600.0, 500.0]]), views) is None


def test_touching_a_cut_edge_but_not_the_image_border():
    shape = (300, 300)
    inner, corner = View(50, 50, 100, 100, 256), View(0, 0, 100, 100, 256)
    m = np.zeros((100, 100), bool)
    m[40:60, 40:60] = True
    assert not touches_cut(m, inner, shape)
    m[0, 50] = True  # the top edge of an inner view cuts the image
    assert touches_cut(m, inner, shape)
    assert not touches_cut(m, corner, shape)  # the corner view's top edge is the image border
    m[50, 99] = True
    assert touches_cut(m, corner, shape)


@pytest.fixture(scope="module")
def zoomed():
    require_lite_medsam()
    engine = load_engine("lite_medsam", cache=EmbeddingCache())
    engine.click_zoom = 1.5
    return engine


def test_first_clicks_are_decoded_in_zoomed_views_and_later_ones_stay_there(zoomed, monkeypatch):
    img = np.zeros((512, 512), np.uint16)
    img[200:230, 300:330] = 1000
    prepared = zoomed.prepare(img)
    zoom_views = set(zoomed.click_views(prepared))
    assert zoom_views and not zoom_views & set(zoomed.views(prepared))
    assert zoomed.prompt_views(prepared)[:len(zoomed.views(prepared))] == zoomed.views(prepared)
    first = zoomed.predict(prepared, [Prompt(points=[[315, 215]], labels=[1])], multimask=True)[0]
    assert first.view in zoom_views and first.view.h == 171
    # a box still goes to the native grid; a corrective click to its mask input's view
    box = zoomed.predict(prepared, [Prompt(box=[295, 195, 335, 235])])[0]
    assert box.view.h == 256
    second = zoomed.predict(prepared, [Prompt(points=[[315, 215], [250, 150]], labels=[1, 0],
                                              mask_input=first)])[0]
    assert second.view == first.view


def test_a_mask_reaching_a_cut_edge_of_its_zoomed_view_is_decoded_again_natively(zoomed, monkeypatch):
    img = np.random.default_rng(0).integers(0, 1000, (512, 512)).astype(np.uint16)
    prepared = zoomed.prepare(img)
    seen = []

    def whole_view(emb, view, prompts, multimask, memo=None, near_box=False, reuse=None):
        seen.append(view)
        return [MaskResult(np.ones((view.h, view.w), bool), view.y0, view.x0, 0.9,
                           torch.zeros(256, 256), view, np.zeros(3)) for _ in prompts]

    monkeypatch.setattr(zoomed, "_decode", whole_view)
    res = zoomed.predict(prepared, [Prompt(points=[[256, 256]], labels=[1])], multimask=True)[0]
    assert [v.h for v in seen] == [171, 256]  # the zoomed view, then the native grid tile
    assert res.view == seen[-1] and res.view in zoomed.views(prepared)


def test_a_clicks_native_view_does_not_depend_on_the_prompts_before_it(zoomed):
    img = np.zeros((512, 700), np.uint16)
    prepared = zoomed.prepare(img)
    click = Prompt(points=[[225, 225]], labels=[1])
    alone = zoomed.route(prepared, click, zoom=False)
    assert alone in zoomed.views(prepared)
    # a box wider than the tiles' overlap, across their borders, gets a view made for it,
    # centred on it: more central for the click than any grid tile, yet the click keeps
    # its grid tile
    box = Prompt(box=[150, 150, 300, 300])
    made = zoomed.route(prepared, box)
    assert made not in zoomed.views(prepared)
    point = np.array([225, 225, 225, 225])
    assert made.centrality(point) > alone.centrality(point)
    assert zoomed.route(prepared, click, zoom=False) == alone
    assert zoomed.route(prepared, box) == made  # boxes still reuse the view made for them


def test_carried_logits_keep_the_mask_where_it_lies_in_the_image():
    from napari_gpuseg.engine.sam.interactive.mask_input_carry import carry_logits
    from napari_gpuseg.engine.sam.interactive.inputs import logits_to_view_mask

    native, fine = View(0, 0, 256, 256, 256), View(40, 30, 171, 171, 256)
    low = torch.full((64, 64), -8.0)
    low[20:30, 22:34] = 8.0  # image rows 80-120, columns 88-136
    assert torch.equal(carry_logits(low, native, native), low)

    def image_mask(logits, view):
        m = np.zeros((300, 300), bool)
        m[view.y0:view.y1, view.x0:view.x1] = logits_to_view_mask(logits[None], view)[0].numpy() > 0
        return m

    want = image_mask(low, native)
    there = carry_logits(low.half(), native, fine)  # box batches keep fp16 logits
    assert there.dtype == torch.float32
    got = image_mask(there, fine)
    assert (got & want).sum() / (got | want).sum() > 0.9
    back = image_mask(carry_logits(there, fine, native), native)
    assert (back & want).sum() / (back | want).sum() > 0.9
    # what lies outside the source view (rows 40-211, columns 30-201) is background in the
    # larger one, however much of the source view the mask fills
    full = torch.full((64, 64), 8.0)
    full[-1, -1] = -8.0
    wide = image_mask(carry_logits(full, fine, native), native)
    assert not wide[:38].any() and not wide[:, :28].any() and wide[45:200, 35:195].all()


def _recording(seen, cut=False):
    def decode(emb, view, prompts, multimask, memo=None, near_box=False, reuse=None):
        m = np.zeros((view.h, view.w), bool)
        if cut:
            m[:, :] = True
        else:
            m[view.h // 2 - 5:view.h // 2 + 5, view.w // 2 - 5:view.w // 2 + 5] = True
        seen.append((view, [p.mask_input for p in prompts]))
        return [MaskResult(m, view.y0, view.x0, 0.9, torch.zeros(64, 64), view, np.zeros(4)) for _ in prompts]
    return decode


def test_a_corrective_click_after_a_native_first_mask_is_decoded_in_the_click_view(zoomed, monkeypatch):
    img = np.random.default_rng(2).integers(0, 1000, (512, 512)).astype(np.uint16)
    prepared = zoomed.prepare(img)
    native = zoomed.views(prepared)[4]
    low = torch.full((64, 64), -8.0)
    low[28:36, 28:36] = 8.0
    m = np.zeros((native.h, native.w), bool)
    m[112:144, 112:144] = True
    first = MaskResult(m, native.y0, native.x0, 0.8, low, native, np.zeros(4))
    centre = [native.x0 + 128.0, native.y0 + 128.0]
    seen = []
    monkeypatch.setattr(zoomed, "_decode", _recording(seen))
    res = zoomed.predict(prepared, [Prompt(points=[centre, [centre[0] + 30, centre[1]]], labels=[1, 0],
                                           mask_input=first)])[0]
    (view, (carried,)), = seen
    assert view in zoomed.click_views(prepared) and res.view == view and carried.view == view
    assert carried.low_res.shape == (64, 64) and (carried.low_res > 0).sum() > (low > 0).sum()  # 1.5x finer
    # a box prompt, or a model decoding clicks at native scale, stays in the mask input's view
    seen.clear()
    zoomed.predict(prepared, [Prompt(points=[centre], labels=[1], box=[centre[0] - 20, centre[1] - 20,
                                                                        centre[0] + 20, centre[1] + 20],
                                     mask_input=first)])
    assert seen[0][0] == native
    # a carried mask reaching a cut edge of the click view: decoded again in the native view
    seen.clear()
    monkeypatch.setattr(zoomed, "_decode", _recording(seen, cut=True))
    res = zoomed.predict(prepared, [Prompt(points=[centre], labels=[1], mask_input=first)])[0]
    assert [v for v, _ in seen] == [seen[0][0], native] and seen[0][0].h == 171
    assert res.view == native and seen[1][1][0] is first


@pytest.mark.parametrize("zoom_score, wins", [(0.95, "zoomed"), (0.5, "native")])
def test_a_first_click_keeps_the_scale_with_the_higher_predicted_iou(zoomed, monkeypatch, zoom_score, wins):
    img = np.random.default_rng(1).integers(0, 1000, (512, 512)).astype(np.uint16)
    prepared = zoomed.prepare(img)

    def small_mask(emb, view, prompts, multimask, memo=None, near_box=False, reuse=None):
        m = np.zeros((view.h, view.w), bool)
        m[view.h // 2 - 5:view.h // 2 + 5, view.w // 2 - 5:view.w // 2 + 5] = True  # inside, no cut
        score = zoom_score if view.h == 171 else 0.8
        return [MaskResult(m, view.y0, view.x0, score, torch.zeros(256, 256), view, np.zeros(4))
                for _ in prompts]

    monkeypatch.setattr(zoomed, "_decode", small_mask)
    res = zoomed.predict(prepared, [Prompt(points=[[256, 256]], labels=[1])], multimask=True)[0]
    assert (res.view.h == 171) == (wins == "zoomed")


def test_a_blended_first_click_weights_the_candidates_by_predicted_iou():
    from napari_gpuseg.engine.sam.interactive.decode_call import keep_best

    low = torch.stack([torch.full((1, 8, 8), v) for v in (4.0, -2.0, -6.0, 1.0)], 1)  # (1, 4, 8, 8)
    iou = torch.tensor([[0.9, 0.8, 0.1, 0.85]])
    chosen, score = keep_best(low, iou, True, None, blend=10.0)
    w = torch.softmax(10 * iou, 1)[0]
    torch.testing.assert_close(chosen[0], (w[:, None, None] * low[0]).sum(0))
    assert score.item() == pytest.approx(0.9)  # the score stays the best predicted IoU
    assert torch.equal(keep_best(low, iou, True, 1, blend=10.0)[0][0], low[0, 1])  # a named candidate wins
    assert torch.equal(keep_best(low, iou, False, None, blend=10.0)[0][0], low[0, 0])  # single output
    torch.testing.assert_close(keep_best(low, iou, True, None, blend=1e4)[0], low[:, 0])  # cold: the best


def test_the_two_views_of_a_first_click_join_in_the_native_view():
    """Where both views see a pixel their logits are averaged with the weight of each view's
    candidates (logsumexp of blend x predicted IoU); elsewhere the native view's stand."""
    from napari_gpuseg.engine.sam.interactive.decode_call import blend_views

    native, finer = View(0, 0, 64, 64, 64), View(16, 24, 32, 32, 64)
    nat = MaskResult(np.zeros((64, 64), bool), 0, 0, 0.5, torch.full((16, 16), -1.0), native,
                     np.array([0.5, 0.4, 0.1, 0.3]))
    fine = MaskResult(np.ones((32, 32), bool), 16, 24, 0.9, torch.full((16, 16), 3.0), finer,
                      np.array([0.9, 0.2, 0.1, 0.3]))
    res = blend_views(fine, nat, 10.0)
    assert res.view == native and (res.y0, res.x0) == (0, 0) and res.mask.shape == (64, 64)
    expect = np.zeros((64, 64), bool)
    expect[16:48, 24:56] = True  # the finer view outweighs (e^9 vs e^5): its +3 wins over -1
    assert np.array_equal(res.mask, expect)
    assert res.score == 0.9 and np.array_equal(res.all_scores, fine.all_scores)
    # a corrective click refines the joined logits, in the native view's low-res grid
    assert res.low_res.shape == (16, 16) and res.low_res[8, 10] > 2 and res.low_res[1, 1] == pytest.approx(-1)
    # the same logits, a native view that outweighs: -1 wins where both see the pixel
    heavy = MaskResult(nat.mask, 0, 0, 0.99, torch.full((16, 16), -4.0), native, np.array([0.99, 0.98, 0.97, 0.96]))
    assert not blend_views(fine, heavy, 10.0).mask.any()


def test_the_default_model_blends_a_first_clicks_candidates(shared_data):
    """The shipped default names its blend (measured on training objects, the model card);
    a first click on a real cell gives the two views' blends joined, a box the best mask."""
    import tifffile

    from napari_gpuseg.engine.sam.interactive.decode_call import blend_views

    require_lite_medsam()
    engine = load_engine(cache=EmbeddingCache())
    assert engine.click_blend == 10.0 and engine.click_output is None and engine.click_threshold == -2.0
    d = shared_data / "scratch_assay" / "cells"
    img = tifffile.imread(d / "images" / "t03.tif")[:, :256]
    prepared = engine.prepare(img)
    click = Prompt(points=[[120.0, 100.0]], labels=[1])
    (res,) = engine.predict(prepared, [click], multimask=True)
    finer_view, native_view = engine.route(prepared, click), engine.route(prepared, click, zoom=False)
    assert finer_view != native_view and res.view == native_view
    (fine,) = engine._decode_routed(prepared, [click], [finer_view], True, None, False)
    (nat,) = engine._decode_routed(prepared, [click], [native_view], True, None, False)
    assert np.array_equal(res.mask, blend_views(fine, nat, 10.0).mask) and res.mask[100, 120]
    engine.click_blend = None  # the rule before: one candidate of one view
    (one,) = engine.predict(prepared, [click], multimask=True)
    assert one.score == res.score and not np.array_equal(one.mask, res.mask)


def test_training_views_follow_the_models_click_zoom_and_the_checkpoint_keeps_it(
        zoomed, shared_data, tmp_path):
    import tifffile

    # 256 x 171: one native view (256 rows) and two zoomed 171 px views, three encoder passes
    # (a 256 x 256 crop needs five: four zoomed views)
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[0]
    img = tifffile.imread(f)[:256, :171]
    lab = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[:256, :171]
    views = collect_views(zoomed, [img], [lab], zooms=(1.0, 1.5))
    sizes = sorted({v.view.h for v in views})
    assert sizes == [171, 256] and len(views) == 3 and all(len(v.ids) for v in views)
    # the labels of a zoomed view are resized the way its pixels are
    z = next(v for v in views if v.view.h == 171)
    assert z.labels.shape == (256, 256) and set(np.unique(z.labels)) - {0} >= set(z.ids)
    cfg = SamTuneConfig(max_steps=2, views_per_step=1, objects_per_view=2, warmup=1, corrections=1,
                        views_per_image=None, val_fraction=0.0)
    out = tmp_path / "zoomed.pt"
    res = finetune_sam([img], [lab], model=zoomed, config=cfg, out_path=out)
    assert res.n_train_views == len(views)  # native and zoomed: the default follows click_zoom
    assert read_decoder(out)["click_zoom"] == 1.5
    assert load_engine(str(out), cache=zoomed.cache).click_zoom == 1.5
    with pytest.raises(ValueError, match="view_zooms"):
        SamTuneConfig(view_zooms=(0.5,)).check()


def test_a_tuned_decoder_offers_its_single_mask_output_as_a_fourth_candidate(zoomed):
    from napari_gpuseg.engine.sam.interactive.fast_decoder import decode_sparse

    shipped = load_engine(cache=zoomed.cache)  # the default model: a decoder tuned here
    assert shipped.candidates == "all" and zoomed.candidates == "multi"
    img = np.zeros((256, 256), np.uint16)
    img[100:130, 90:125] = 800
    prepared = shipped.prepare(img)
    (res,) = shipped.predict(prepared, [Prompt(points=[[107, 115]], labels=[1])], multimask=True)
    # the candidate the shipped decoder names (click_output, measured on training objects; None:
    # the one its IoU head rates highest)
    kept = res.all_scores.max() if shipped.click_output is None else res.all_scores[shipped.click_output]
    assert res.all_scores.shape == (4,) and res.score == kept
    (stock,) = zoomed.predict(zoomed.prepare(img), [Prompt(points=[[107, 115]], labels=[1])], multimask=True)
    assert stock.all_scores.shape == (3,)
    # the module path (used with a mask input) gives the same four candidates as the factored one
    dev = shipped.policy.device  # a GPU where there is one
    emb = shipped.embedding(prepared, res.view).to(dev)  # the cache may keep it in host memory
    with torch.inference_mode():
        pts = torch.as_tensor(res.view.to_input(np.array([[107.0, 115.0]]))[None], dtype=torch.float32, device=dev)
        sparse, dense = shipped.sam.prompt_encoder(points=(pts, torch.ones(1, 1, dtype=torch.int64, device=dev)),
                                                   boxes=None, masks=None)
        iou_f, _sel, low_f = decode_sparse(shipped.sam, emb, sparse, "all")
        low_m, iou_m = shipped._decode_module(emb, sparse, dense, "all")
    assert low_m.shape == low_f.shape and low_m.shape[1] == 4
    torch.testing.assert_close(iou_m.float(), iou_f, atol=1e-3, rtol=1e-3)


def test_a_click_refines_fp16_logits_inside_a_bf16_autocast():
    """Box batches keep their low-res logits in fp16; a click refining such a mask in a
    worker job (the job runs inside the policy's autocast) on a CPU whose policy picks bf16
    must not meet torch's refusal to stack fp16 tensors under a bf16 autocast."""
    from napari_gpuseg.engine.runtime.device import make_policy

    require_lite_medsam()
    engine = load_engine("lite_medsam", cache=EmbeddingCache(), policy=make_policy("cpu", "bf16"))
    # the encoder in fp32 (a CPU without fast bf16 takes a minute per view in bf16): what is
    # tested is the decoder's input under the autocast
    engine.encode = load_engine("lite_medsam", cache=EmbeddingCache(), policy=make_policy("cpu", "fp32")).encode
    yy, xx = np.mgrid[:128, :128]
    img = (120 * (((yy - 64) ** 2 + (xx - 60) ** 2) < 20 ** 2) + 20).astype(np.uint8)
    first = engine.predict(img, [Prompt(box=[38, 42, 84, 86])])[0]
    click = dict(points=[[60, 64]], labels=[1])
    ref = engine.predict(img, [Prompt(**click, mask_input=first)])[0]  # fp32 logits, no autocast
    first.low_res = first.low_res.half()  # as segment_boxes keeps them
    with engine.policy.autocast():
        again = engine.predict(img, [Prompt(**click, mask_input=first)])[0]
    assert again.low_res is not None and np.isfinite(again.score)
    a, b = again.full(img.shape), ref.full(img.shape)
    assert b.sum() > 100 and (a & b).sum() / (a | b).sum() > 0.9


def test_waits_for_encoder_names_a_prompt_whose_view_is_being_embedded():
    from napari_gpuseg.engine.sam.interactive.encoder_pauses import waits_for_encoder

    require_lite_medsam()
    engine = load_engine("lite_medsam", cache=EmbeddingCache())
    img = np.random.default_rng(3).integers(0, 255, (256, 640), dtype=np.uint8)
    prepared = engine.prepare(img)
    left, right = Prompt(box=[20, 40, 60, 90]), Prompt(box=[560, 40, 600, 90])
    seen = []
    hook = engine.sam.image_encoder.layers[1].register_forward_pre_hook(
        lambda *_a: seen.append((waits_for_encoder(engine, prepared, left),
                                 waits_for_encoder(engine, prepared, right),
                                 waits_for_encoder(engine, img, left))))
    try:
        engine.embed([prepared], [[engine.route(prepared, left)]])
    finally:
        hook.remove()
    assert seen == [(True, False, False)]  # a raw array is never in progress
    assert not waits_for_encoder(engine, prepared, left)  # the call is over


def test_a_click_on_a_small_image_is_decoded_padded_not_stretched(shared_data):
    """A 128 px image: the shipped decoder's clicks see it at the scales it was trained at
    (padded at native and at 1.5x), not stretched 2x to the input; a box keeps the stretched
    view (boxes measured better there). The nucleus below came out as 22 px stretched."""
    import tifffile

    require_lite_medsam()
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[17]  # a validation field
    img = tifffile.imread(f)[196:324, 286:414]
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[196:324, 286:414]
    engine = load_engine("nuclei_sam", cache=EmbeddingCache())
    prepared = engine.prepare(img)
    (box_view,) = engine.views(prepared)
    assert box_view.zoom == 0 and box_view.scale == 2.0 and box_view.resized_hw == (256, 256)
    (native,), (finer,) = engine.native_click_views(prepared), engine.click_views(prepared)
    assert (native.scale, native.resized_hw) == (1.0, (128, 128))
    assert (finer.scale, finer.resized_hw) == (1.5, (192, 192))
    assert set(engine.prompt_views(prepared)) == {box_view, native, finer}
    assert len({engine._key(prepared, v) for v in (box_view, native, finer)}) == 3  # three embeddings
    obj = gt == gt[108, 112]
    res = engine.predict(img, [Prompt(points=[[112, 108]])], multimask=True)[0]
    assert res.view in (native, finer)
    mask = res.full(img.shape)
    assert (mask & obj).sum() / (mask | obj).sum() > 0.8
    ys, xs = np.nonzero(obj)
    box = engine.predict(img, [Prompt(box=[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])])[0]
    assert box.view == box_view
    # the published model stretches small images for clicks too, as SAM does
    lite = load_engine("lite_medsam", cache=EmbeddingCache())
    assert lite.native_click_views(lite.prepare(img)) == lite.views(lite.prepare(img))
