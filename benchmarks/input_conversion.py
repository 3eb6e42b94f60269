"""How well each candidate colour-to-gray conversion separates nuclei from background, and
which fields the one conversion (``engine.normalize.model_input``) inverts.

    python benchmarks/input_conversion.py

Per field with ground truth: the pixel ROC AUC of "nucleus vs background" from the
converted intensity (1.0: every nucleus pixel brighter than every background pixel; 0.5:
no separation; below 0.5: nuclei darker). Candidates for the colour fields: luminance
(ITU-R BT.601), luminance inverted, and the hematoxylin channel of ``skimage.color.rgb2hed``
(stain separation). Then the inversion decision of ``model_input`` over every field of the
shared data, with the median's position in the 0.1-99.9 % range it is based on.
Data: ``../shared/data`` next to the repository, or ``NAPARI_GPUSEG_SHARED_DATA``.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tifffile
from scipy.stats import rankdata
from skimage.color import rgb2hed

from napari_gpuseg.engine.normalize import bright_background, is_color, model_input, to_gray

REPO = Path(__file__).resolve().parents[1]


def shared_data() -> Path:
    env = os.environ.get("NAPARI_GPUSEG_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


def auc(mask: np.ndarray, value: np.ndarray, step: int = 7) -> float:
    """Pixel ROC AUC of ``value`` for ``mask`` (every ``step``-th pixel, Mann-Whitney)."""
    y, x = mask.ravel()[::step].astype(bool), value.ravel()[::step]
    r = rankdata(x)
    n1, n0 = int(y.sum()), int((~y).sum())
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def main() -> None:
    data = shared_data()
    pairs = [(data / "dsb2018" / "image.tif", data / "dsb2018" / "mask.tif")]
    for folder in ("bbbc039", "bbbc039_more", "dsb2018_more"):
        pairs += [(p, data / folder / "masks" / p.name) for p in sorted((data / folder / "images").glob("*.tif"))]
    print("| colour field | luminance | luminance inverted | hematoxylin (rgb2hed) | model_input |")
    print("| --- | --- | --- | --- | --- |")
    rows, cols = [], {"lum": [], "inv": [], "hed": [], "ours": []}
    for image_path, mask_path in pairs:
        img, mask = tifffile.imread(image_path), tifffile.imread(mask_path) > 0
        gray = to_gray(img) if is_color(img) else img.astype(np.float32)
        lo, med, hi = np.percentile(gray, [0.1, 50, 99.9])
        rows.append((image_path.parent.parent.name, image_path.name, is_color(img), bool(mask.any()),
                     float((med - lo) / max(hi - lo, 1e-9)), bool(bright_background(gray))))
        if is_color(img):
            a = {"lum": auc(mask, gray), "inv": auc(mask, -gray), "hed": auc(mask, rgb2hed(img[..., :3])[..., 0]),
                 "ours": auc(mask, model_input(img))}
            for k, v in a.items():
                cols[k].append(v)
            print(f"| {image_path.name} | {a['lum']:.3f} | {a['inv']:.3f} | {a['hed']:.3f} | {a['ours']:.3f} |")
    print(f"| mean of {len(cols['lum'])} | " + " | ".join(f"{np.mean(cols[k]):.3f}" for k in cols) + " |")
    print("\n| fields | count | inverted | median position in the 0.1-99.9 % range (min - max) |")
    print("| --- | --- | --- | --- |")
    groups = {"gray with nuclei": [r for r in rows if not r[2] and r[3]],
              "gray without nuclei (noise only)": [r for r in rows if not r[2] and not r[3]],
              "colour (H&E, stained, brightfield)": [r for r in rows if r[2]]}
    for name, g in groups.items():
        pos = [r[4] for r in g]
        print(f"| {name} | {len(g)} | {sum(r[5] for r in g)} | {min(pos):.2f} - {max(pos):.2f} |")


if __name__ == "__main__":
    main()
