"""A prompt during a background embedding of a real field, with the real LiteMedSAM:
answered inside the first encoder call (at a pause point), with only its own view."""
import threading

import pytest
import tifffile
import torch

from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.interactive.predictor import Prompt, SamEngine
from napari_gpuseg.engine.runtime.worker import BACKGROUND, CANCELLED, INTERACTIVE, InferenceWorker

from sam_fixtures import gt_boxes, iou, require_lite_medsam

FP32 = Policy(torch.device("cpu"), "fp32")


@pytest.fixture(scope="module")
def engine():
    path = require_lite_medsam()
    from napari_gpuseg.engine.sam.loader import load_engine

    loaded = load_engine(str(path), policy=FP32, arch="lite_medsam")
    return SamEngine(loaded.sam, loaded.info, FP32, cache=EmbeddingCache())


@pytest.fixture(scope="module")
def strip(shared_data):
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[18]
    img = tifffile.imread(f)[100:356, :640]
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[100:356, :640]
    return img, gt


@pytest.fixture
def worker():
    w = InferenceWorker(FP32)
    yield w
    w.shutdown()


def test_prompt_during_background_embedding_is_answered_first(engine, worker, strip):
    img, gt = strip
    image = engine.prepare(img)
    views = engine.views(image)
    assert len(views) == 3 and engine.views_ready(image) == 0
    encoded = []
    hook = engine.sam.image_encoder.register_forward_hook(lambda _m, a, _o: encoded.append(len(a[0])))
    queued, running, counts = threading.Event(), threading.Event(), []

    def progress(done, total):
        counts.append((done, total))
        running.set()
        queued.wait(30)  # hold the background job until the prompt is queued

    try:
        tiles = worker.submit(engine.embed_steps, image, tag="tiles", priority=BACKGROUND,
                              progress=progress)
        assert running.wait(60)  # the tiles run before the prompt is queued (a loaded machine)
        ids, boxes = gt_boxes(gt)
        last = views[-1]
        k = next(i for i, b in enumerate(boxes) if last.contains_box(b, margin=8))

        def prompt_job():
            res = engine.predict(image, [Prompt(box=boxes[k])])[0]
            return res, engine.views_ready(image)

        prompt = worker.submit(prompt_job, tag="prompt", priority=INTERACTIVE)
        queued.set()
        (result, ready_then), = [prompt.result(120)]
        assert ready_then == 1  # its own view, not the image's
        assert result.view == last and iou(result.full(gt.shape), gt == ids[k]) > 0.6
        assert tiles.result(300).digest == image.digest
    finally:
        hook.remove()
    log = [(ev, t) for ev, _i, t in worker.log]
    assert log.index(("end", "prompt")) < log.index(("end", "tiles"))
    assert log.index(("start", "tiles")) < log.index(("start", "prompt"))
    assert sum(encoded) == 3  # the background skipped the view the prompt embedded
    assert engine.views_ready(image) == 3 and counts[0] == (0, 3) and counts[-1] == (3, 3)


def test_cancelling_background_embedding_stops_inside_the_encoder(engine, worker, strip):
    img, _gt = strip
    image = engine.prepare(img + 1)
    jobs, reached = [], []
    blocks = [m for n, m in engine.sam.image_encoder.named_modules() if n.endswith("blocks.0")]
    hooks = [blocks[0].register_forward_pre_hook(lambda *_: jobs[0].cancel()),
             blocks[-1].register_forward_pre_hook(lambda *_: reached.append(1))]
    release = threading.Event()
    worker.submit(release.wait, 30)  # the job starts only once it is in ``jobs``
    try:
        jobs.append(worker.submit(engine.embed_steps, image, step=3, priority=BACKGROUND))
        release.set()
        assert jobs[0].wait(120) and jobs[0].status == CANCELLED
    finally:
        for h in hooks:
            h.remove()
    assert not reached and engine.views_ready(image) == 0


# (a module, the next one to run): a prompt queued while the first runs is answered
# before the second starts: inside the 256 px patch embedding and MBConv stage, the
# downsampling, an MLP and the neck (their pause points; before, only between blocks).
# In fp32 on a CPU with oneDNN the MBConv blocks run band of rows by band: a prompt queued
# during one band is answered before the next (``rows`` marks each band)
MBCONV_WHOLE = [("layers.0.blocks.0.conv1", "layers.0.blocks.0.conv2"),
                ("layers.0.blocks.1.conv3", "layers.0.blocks.1.act3")]
MBCONV_BANDS = [("layers.0.blocks.0.rows", "layers.0.blocks.0.rows"),
                ("layers.0.blocks.1.rows", "layers.0.blocks.1.rows")]
WITHIN = [("patch_embed.seq.0", "patch_embed.seq.2"),
          ("layers.0.downsample.conv1", "layers.0.downsample.conv2"),
          ("layers.1.blocks.0.mlp.fc1", "layers.1.blocks.0.mlp.fc2"),
          ("neck.0", "neck.2")]


def test_a_prompt_is_answered_within_the_encoders_large_layers(engine, worker, strip):
    from napari_gpuseg.models.sam import cpu_fused

    with torch.inference_mode():
        banded = engine.policy.precision == "fp32" and cpu_fused.rows_active(torch.zeros(1, 1, 1, 1))
    within = WITHIN + (MBCONV_BANDS if banded else MBCONV_WHOLE)
    img, _gt = strip
    image = engine.prepare(img[:, :256] + 2)  # one view nobody embedded
    modules = dict(engine.sam.image_encoder.named_modules())
    prompts, answered, hooks = {}, {}, []

    def queue(after):
        def hook(_m, _a, _o):
            if after not in prompts:  # from the worker thread, while the encoder runs
                prompts[after] = worker.submit(lambda: None, tag=after, priority=INTERACTIVE)
        return hook

    def check(after, before):
        def hook(_m, _a):
            if after in prompts and before not in answered:
                answered[before] = prompts[after].wait(0)
        return hook

    try:
        for after, before in within:
            hooks.append(modules[after].register_forward_hook(queue(after)))
            hooks.append(modules[before].register_forward_pre_hook(check(after, before)))
        tiles = worker.submit(engine.embed_steps, image, tag="tiles", priority=BACKGROUND)
        assert tiles.result(300).digest == image.digest
    finally:
        for h in hooks:
            h.remove()
    assert answered == {before: True for _after, before in within}
    log = [(ev, t) for ev, _i, t in worker.log]
    assert log.index(("start", "tiles")) < log.index(("end", "neck.0")) < log.index(("end", "tiles"))
