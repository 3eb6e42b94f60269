"""Decoder checkpoints that also carry tuned image-encoder tensors (TinyViT's last stage and
neck): they replace the base's, the engine names its encoder by them (no embedding of the
base's encoder is served for it, even from a shared cache), a decoder tuned on top names
that checkpoint as its base and gets the tuned encoder back, and tensors that do not fit
are refused before anything changes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.loader import base_identity, load_engine
from napari_gpuseg.models import registry
from napari_gpuseg.models.sam.decoder_checkpoint import apply_decoder, read_decoder, save_decoder
from napari_gpuseg.models.state_dict_loading import CheckpointError

from sam_fixtures import require_lite_medsam

PARTS = ("layers.3.", "neck.")


@pytest.fixture(scope="module")
def tuned_file(tmp_path_factory):
    """The shipped nuclei decoder on LiteMedSAM with its encoder's last stage and neck
    changed, saved as one decoder checkpoint."""
    require_lite_medsam()
    sam, _ = registry.load_model("nuclei_sam")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for k, p in sam.image_encoder.named_parameters():
            if k.startswith(PARTS):
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp("tuned") / "tuned_encoder.pt"
    save_decoder(path, sam, "lite_medsam", registry.MODELS["lite_medsam"].sha256, encoder_parts=PARTS)
    return path, {k: v.detach().clone() for k, v in sam.image_encoder.state_dict().items() if k.startswith(PARTS)}


def _as_saved(v):
    """A tensor as the checkpoint stores it (floats in fp16), compared in fp32."""
    return v.to(torch.float16).float() if v.is_floating_point() else v


def _as_loaded(v):
    return v.float() if v.is_floating_point() else v


def _image():
    rng = np.random.default_rng(1)
    img = rng.normal(60, 10, (200, 240)).clip(0, 255)
    img[60:110, 80:140] += 120
    return img.astype(np.uint8)


def test_the_tuned_encoder_loads_and_has_its_own_embeddings(tuned_file):
    path, tensors = tuned_file
    doc = read_decoder(path)
    assert {k.split(".")[0] for k in doc["state"]} == {"prompt_encoder", "mask_decoder", "image_encoder"}
    cache = EmbeddingCache(1 << 30)  # one cache for both: keys must keep them apart
    base = load_engine("nuclei_sam", cache=cache)
    tuned = load_engine(path, cache=cache)
    enc = tuned.sam.image_encoder.state_dict()
    for k, v in tensors.items():
        assert torch.equal(_as_loaded(enc[k]), _as_saved(v)), k
    assert tuned.info.encoder != base.info.encoder
    assert tuned.info.encoder.startswith("lite_medsam+")
    img = base.prepare(_image())
    view = base.views(img)[0]
    e_base = base.embedding(img, view).float()
    e_tuned = tuned.embedding(tuned.prepare(_image()), view).float()
    assert (e_base - e_tuned).abs().max() > 1e-2  # not the base's cached embedding
    # the same file loads to the same encoder name (its embeddings are shared between loads)
    assert load_engine(path, cache=cache).info.encoder == tuned.info.encoder


def test_a_decoder_tuned_on_it_names_it_as_base_and_gets_the_tuned_encoder(tuned_file, tmp_path):
    path, tensors = tuned_file
    tuned = load_engine(path)
    name, sha = base_identity(tuned)
    assert name == str(path) and sha == registry.sha256_file(path)
    with torch.no_grad():
        tuned.sam.mask_decoder.iou_prediction_head.layers[0].bias.add_(0.1)  # "adapted"
    on_top = save_decoder(tmp_path / "adapted.pt", tuned.sam, name, sha)
    assert not any(k.startswith("image_encoder.") for k in read_decoder(on_top)["state"])
    again = load_engine(on_top)
    assert again.info.encoder == tuned.info.encoder
    enc = again.sam.image_encoder.state_dict()
    for k, v in tensors.items():
        assert torch.equal(_as_loaded(enc[k]), _as_saved(v)), k
    assert base_identity(again) == (str(path), sha)
    # a decoder-only file on the plain base still runs the base's encoder
    plain = load_engine("nuclei_sam")
    assert plain.info.encoder == "lite_medsam" and base_identity(plain)[0] == "lite_medsam"


@pytest.mark.parametrize("case", ["unknown key", "wrong shape"])
def test_encoder_tensors_that_do_not_fit_are_refused_before_anything_changes(tuned_file, case):
    path, _ = tuned_file
    doc = read_decoder(path)
    state = dict(doc["state"])
    if case == "unknown key":
        state["image_encoder.layers.9.blocks.0.mlp.fc1.weight"] = torch.zeros(4, 4, dtype=torch.float16)
    else:
        key = next(k for k in state if k.startswith("image_encoder.neck."))
        state[key] = torch.zeros(3, 3, dtype=torch.float16)
    sam, _ = registry.load_model("nuclei_sam")
    before = {k: v.clone() for k, v in sam.state_dict().items()}
    with pytest.raises(CheckpointError, match="does not fit the image_encoder") as info:
        apply_decoder(sam, {**doc, "state": state})
    assert "\n" not in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in sam.state_dict().items())
    assert getattr(sam, "encoder_id", None) is None
