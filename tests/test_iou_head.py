"""Refitting a decoder's IoU head on first clicks (engine.sam.training.iou_head)."""
import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.prompt_types import Prompt
from napari_gpuseg.engine.sam.training.click_eval import pick_objects
from napari_gpuseg.engine.sam.training.iou_head import first_click_samples, first_click_views, fit_iou_head
from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point, mask_iou
from napari_gpuseg.models.sam.mask_decoder import MLP


def test_fit_lowers_the_held_out_error_and_never_raises_it():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 8)).astype(np.float32)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    y = 1 / (1 + np.exp(-x @ w))  # IoU-like targets in (0, 1), a smooth function of the features
    head = MLP(8, 16, 4, 3)
    before = [p.detach().clone() for p in head.parameters()]
    fit = fit_iou_head(head, x, y, epochs=300, lr=3e-3)
    fitted_err, start_err = fit.held_out_mse_after, fit.held_out_mse_before  # squared errors of IoUs
    assert fitted_err < 0.5 * start_err
    assert (fit.fitted, fit.held_out) == (160, 40)
    assert fit.epoch > 0 and any(not torch.equal(a, b) for a, b in zip(before, head.parameters()))
    assert not any(p.requires_grad for p in head.parameters())
    # targets it cannot learn (noise): the starting weights are kept rather than made worse
    head2 = MLP(8, 16, 4, 3)
    start = [p.detach().clone() for p in head2.parameters()]
    noise = rng.uniform(size=(20, 4)).astype(np.float32)
    fit2 = fit_iou_head(head2, rng.normal(size=(20, 8)).astype(np.float32), noise, epochs=50, lr=1.0)
    assert fit2.held_out_mse_after <= fit2.held_out_mse_before
    if fit2.epoch == 0:
        assert all(torch.equal(a, b) for a, b in zip(start, head2.parameters()))
    # bias only: the hidden layers stay as they were, the output offsets move
    head3 = MLP(8, 16, 4, 3)
    hidden = [p.detach().clone() for layer in head3.layers[:-1] for p in layer.parameters()]
    weight, bias = head3.layers[-1].weight.detach().clone(), head3.layers[-1].bias.detach().clone()
    fit3 = fit_iou_head(head3, x, y + 0.3, epochs=200, lr=1e-2, bias_only=True)
    assert fit3.held_out_mse_after < fit3.held_out_mse_before
    assert all(torch.equal(a, b) for a, b in zip(hidden, [p for la in head3.layers[:-1] for p in la.parameters()]))
    assert torch.equal(weight, head3.layers[-1].weight) and not torch.equal(bias, head3.layers[-1].bias)
    with pytest.raises(ValueError, match="too few"):
        fit_iou_head(MLP(8, 16, 4, 3), x[:3], y[:3])


@pytest.mark.usefixtures("reuse_embeddings")
def test_first_click_samples_measure_the_candidates_a_click_chooses_from(shared_data):
    """On a real training field: one row per view the predictor decodes a first click in,
    the IoU head's input beside every candidate's true IoU; the mask the engine keeps for
    that click is one of the measured candidates."""
    name = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[0].name  # a training field
    image = tifffile.imread(shared_data / "bbbc039" / "images" / name)[:256, :256]
    labels = tifffile.imread(shared_data / "bbbc039" / "masks" / name)[:256, :256]
    engine = load_engine()
    head = engine.sam.mask_decoder.iou_prediction_head
    none = first_click_samples(engine, image, np.zeros_like(labels))  # a field without objects
    assert none[0].shape == (0, head.layers[0].in_features) and none[1].shape == (0, head.layers[-1].out_features)
    for oid, s in pick_objects(labels, 3, seed=0):
        one = np.where(labels == oid, oid, 0)
        feats, ious = first_click_samples(engine, image, one)
        x, y = interior_point((labels == oid)[s]) + [s[1].start, s[0].start]
        prompt = Prompt(points=np.array([[x, y]], dtype=float), labels=np.array([1]))
        views = first_click_views(engine, engine.prepare(image), prompt)
        assert feats.shape == (len(views), head.layers[0].in_features)
        assert ious.shape == (len(views), head.layers[-1].out_features)
        assert np.all((ious >= 0) & (ious <= 1))
        kept = engine.predict(image, [prompt], multimask=True)[0]
        got = mask_iou(kept.full(labels.shape), labels == oid)
        assert np.isclose(ious, got, atol=0.02).any(), (got, ious)
        with torch.no_grad():  # the features are the head's real input: it gives the engine's score
            scores = head(torch.as_tensor(feats).to(next(head.parameters()).dtype)).float().numpy()
        # the engine keeps the head's best, or the candidate the decoder names (click_choice)
        kept_from = scores if engine.click_output is None else scores[:, [engine.click_output]]
        assert np.isclose(kept_from.max(), kept.score, atol=0.05), (scores, kept.score)
