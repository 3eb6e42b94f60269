"""One per-file step wherever a folder job runs: every built-in method, at small sizes, gives
the same label files and the same report rows (timing aside) in this process and on a
LocalCluster of 2 worker processes (127.0.0.1), for gray, RGB, two-channel (channel=1),
multi-series TIFF and ZYX inputs, and box files for ``sam-boxes``. The engine's entry
points take an RGB field as folder jobs take its file."""
import dataclasses

import numpy as np
import pytest
import tifffile

distributed = pytest.importorskip("distributed")

from napari_gpuseg.engine.jobs.clusters import connect  # noqa: E402
from napari_gpuseg.engine.jobs.pipeline import run_folder  # noqa: E402
from napari_gpuseg.io import label_files  # noqa: E402

pytestmark = pytest.mark.timeout(300)

HE_FIELD = "b83d1d77935b6cfd.tif"  # 524 x 348 x 3 H&E, dsb2018_more (training part)
# the gray crop of bbbc039_more image 0: three of the four prompts of points_per_side=2 fall on
# nuclei, so the smallest sam-everything grid finds an object
GRAY_AT = (100, 224)


@pytest.fixture(scope="module")
def cluster():
    handle = connect("local", n_workers=2, threads_per_worker=1)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="module")
def one_sam_here():
    """One SAM engine per model and policy in this process (the test's side: the in-process
    runs of both SAM methods and the entry points), so the weights load and an image is
    encoded once here; every cluster worker still loads and encodes on its own."""
    from napari_gpuseg.engine.runtime.device import resolve_policy
    from napari_gpuseg.engine.sam import loader

    load, engines = loader.load_engine, {}

    def shared(model=loader.DEFAULT_MODEL, policy=None, **kwargs):
        policy = resolve_policy(policy)
        key = (str(model), str(policy.device), policy.precision, tuple(sorted(kwargs.items())))
        if key not in engines:
            engines[key] = load(model, policy=policy, **kwargs)
        return engines[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "load_engine", shared)
        yield shared


def _crop(path, size=96, at=(0, 0)):
    a = tifffile.imread(path)
    return np.ascontiguousarray(a[at[0]:at[0] + size, at[1]:at[1] + size])


@pytest.fixture(scope="module")
def inputs(shared_data, tmp_path_factory):
    """Folders of small real images: plain (gray, RGB, multi-series, ZYX), two-channel (for
    channel=1) and boxed (images with box files, for sam-boxes)."""
    from napari_gpuseg.engine.detect import boxes_from_labels

    root = tmp_path_factory.mktemp("inputs")
    bb = sorted((shared_data / "bbbc039_more" / "images").glob("*.tif"))
    he = shared_data / "dsb2018_more" / "images" / HE_FIELD
    gray_a, gray_b = _crop(bb[0], 96, GRAY_AT), _crop(bb[1], 96, (200, 300))
    rgb = _crop(he, 96, (200, 100))
    plain, chan, boxed, boxes, two = (root / n for n in ("plain", "chan", "boxed", "boxes", "two"))
    for d in (plain, chan, boxed, boxes, two):
        d.mkdir()
    tifffile.imwrite(plain / "gray.tif", gray_a)
    tifffile.imwrite(plain / "rgb.tif", rgb, photometric="rgb")
    with tifffile.TiffWriter(plain / "series.tif") as tw:  # two series: the first is read, a note says so
        tw.write(gray_b)
        tw.write(gray_a[:48, :48])
    tifffile.imwrite(plain / "zyx.tif", np.stack([gray_a[:64, :64], gray_b[:64, :64], gray_a[32:, 32:]]),
                     metadata={"axes": "ZYX"})
    tifffile.imwrite(chan / "two.tif", np.stack([gray_b, gray_a], -1), metadata={"axes": "YXC"})
    tifffile.imwrite(chan / "rgb.tif", rgb, photometric="rgb")
    tifffile.imwrite(two / "two.tif", np.stack([gray_b, gray_a], -1), metadata={"axes": "YXC"})
    mask = tifffile.imread(shared_data / "bbbc039_more" / "masks" / bb[0].name)[GRAY_AT[0]:GRAY_AT[0] + 96, GRAY_AT[1]:GRAY_AT[1] + 96]
    tifffile.imwrite(boxed / "gray.tif", gray_a)
    rows = ["x0,y0,x1,y1"] + [",".join(str(int(v)) for v in b) for b in boxes_from_labels(mask)[:6]]
    (boxes / "gray.csv").write_text("\n".join(rows) + "\n")
    return {"plain": plain, "chan": chan, "boxed": boxed, "boxes": boxes, "two": two}


def _rows(report):
    return [dataclasses.replace(r, seconds=0.0) for r in report.rows]


def _same_everywhere(cluster, folder, out, method, options):
    here = run_folder(folder, out / "here", method, method_options=options, precision="fp32")
    there = run_folder(folder, out / "dask", method, method_options=options, precision="fp32",
                       cluster=cluster.client)
    assert _rows(here) == _rows(there)
    for row in here.rows:
        if row.status == "ok":
            np.testing.assert_array_equal(label_files.read_labels(out / "here" / row.labels),
                                          label_files.read_labels(out / "dask" / row.labels))
    return here


def test_threshold_and_unet_in_process_and_on_the_cluster(cluster, inputs, tmp_path):
    for method in ("threshold", "unet"):
        rep = _same_everywhere(cluster, inputs["plain"], tmp_path / method, method, {})
        rows = {r.file: r for r in rep.rows}
        assert rep.ok == 4, [r.error for r in rep.rows]
        assert rows["rgb.tif"].shape.startswith("96x96 ") and rows["zyx.tif"].shape.startswith("3x64x64 ")
        assert "2 image series" in rows["series.tif"].notes
        assert all(r.objects > 0 for r in rep.rows)


def test_two_channel_with_channel_1_in_process_and_on_the_cluster(cluster, inputs, tmp_path):
    """On the cluster ``--set channel=1`` used to be ignored: a YXC two-channel image was
    read as a stack (labels 96x96x2)."""
    for method in ("threshold", "unet"):
        rep = _same_everywhere(cluster, inputs["chan"], tmp_path / method, method, {"channel": 1})
        rows = {r.file: r for r in rep.rows}
        assert rep.ok == 2 and rows["two.tif"].shape == "96x96 uint16"
        assert "channel 1 of 2 segmented" in rows["two.tif"].notes
        assert "colour channel 1 of 3 segmented" in rows["rgb.tif"].notes
        labels = label_files.read_labels(tmp_path / method / "dask" / rows["two.tif"].labels)
        assert labels.shape == (96, 96)


def test_sam_methods_in_process_and_on_the_cluster(cluster, inputs, one_sam_here, tmp_path):
    """One file each (a SAM model loads in every process): box files, and a two-channel image
    whose channel 1 is the boxed image (in this process its embedding is reused)."""
    rep = _same_everywhere(cluster, inputs["boxed"], tmp_path / "boxes", "sam-boxes",
                           {"boxes": str(inputs["boxes"])})
    assert rep.ok == 1 and rep.rows[0].objects > 0
    rep = _same_everywhere(cluster, inputs["two"], tmp_path / "everything", "sam-everything",
                           {"channel": 1, "points_per_side": 2})
    assert rep.ok == 1 and "channel 1 of 2 segmented" in rep.rows[0].notes and rep.rows[0].objects > 0
    # every worker loaded the model once for both methods (each kept its own copy before)
    from napari_gpuseg.engine.jobs import worker_cache

    kept = cluster.client.run(worker_cache.loaded_keys)
    assert len(kept) == 2 and all(sum(k[0] == "sam-engine" for k in keys) == 1 for keys in kept.values()), kept


def test_predict_labels_and_batch_agree_on_an_rgb_field(shared_data, tmp_path):
    """The README's API on a held-out H&E field used to return 524x348x3 labels with
    thousands of objects; it now converts the image as ``batch`` does."""
    from napari_gpuseg.cli.batch import main
    from napari_gpuseg.engine import load_unet, make_policy, predict_labels, predict_probabilities
    from napari_gpuseg.io import read_image

    src = shared_data / "dsb2018_more" / "images" / HE_FIELD
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / HE_FIELD).symlink_to(src)
    # both at fp32: the default (auto) is bf16 on a CPU with fast bf16 and fp32 elsewhere, and
    # this compares the conversion, not the precision
    assert main([str(tmp_path / "in"), str(tmp_path / "out"), "--quiet", "--precision", "fp32"]) == 0
    batch = label_files.read_labels(tmp_path / "out" / HE_FIELD.replace(".tif", "_labels.tif"))
    image = read_image(src)
    assert image.shape == (524, 348, 3)
    model = load_unet()
    api = predict_labels(model, image, policy=make_policy(precision="fp32"))
    assert api.shape == (524, 348) and 100 < api.max() < 400
    np.testing.assert_array_equal(api, batch)
    green = predict_probabilities(model, image, channel=1)
    assert green.shape == (3, 524, 348)
    np.testing.assert_array_equal(predict_probabilities(model, image[..., 1]), green)


def test_entry_points_take_channel_and_refuse_multichannel_without_it(shared_data, one_sam_here):
    from napari_gpuseg.engine import load_unet, predict_labels, segment_boxes, segment_everything
    from napari_gpuseg.engine.sam.automatic.everything import AutomaticParams
    from napari_gpuseg.io import ChannelError

    a = _crop(sorted((shared_data / "bbbc039_more" / "images").glob("*.tif"))[0], 96, GRAY_AT)
    two = np.stack([np.zeros_like(a), a], -1)
    model = load_unet()
    with pytest.raises(ChannelError, match="2 channels .*channel=N"):
        predict_labels(model, two)
    np.testing.assert_array_equal(predict_labels(model, two, channel=1), predict_labels(model, a))
    engine = one_sam_here()
    with pytest.raises(ChannelError, match="2 channels"):
        segment_everything(engine, two)
    with pytest.raises(ChannelError, match="channel 2 does not exist"):
        segment_boxes(engine, two, [10, 10, 40, 40], channel=2)
    params = AutomaticParams.for_model(engine.info.box_trained, engine.info.decoder_tuned, points_per_side=2)
    everything = segment_everything(engine, a, params).labels
    assert everything.max() > 0
    np.testing.assert_array_equal(segment_everything(engine, two, params, channel=1).labels, everything)
    np.testing.assert_array_equal(segment_boxes(engine, two, [10, 10, 40, 40], channel=1).labels,
                                  segment_boxes(engine, a, [10, 10, 40, 40]).labels)


def test_one_default_per_kind(qtbot, monkeypatch):
    """Folder jobs default to the bundled U-Net (terminal and dock); every SAM method takes the
    annotator's model from where it is defined (it used to keep lite_medsam)."""
    import argparse

    from napari_gpuseg.cli.batch import add_batch_parser
    from napari_gpuseg.engine.jobs.method_registry import create_method
    from napari_gpuseg.engine.sam import loader
    from napari_gpuseg.widgets.batch_folder import BatchFolderWidget

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    batch = add_batch_parser(sub)
    assert parser.parse_args(["batch", "a", "b"]).method == "unet"
    text = " ".join(batch.format_help().split())
    assert "default: unet" in text and f"({loader.DEFAULT_MODEL})" in text
    dock = BatchFolderWidget(None)
    qtbot.addWidget(dock)
    assert dock.method.currentText() == "unet"
    for name in ("sam-boxes", "sam-everything"):
        assert create_method(name).model == loader.DEFAULT_MODEL
    monkeypatch.setattr(loader, "DEFAULT_MODEL", "another_sam")
    assert create_method("sam-boxes").model == "another_sam"
