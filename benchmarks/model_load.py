"""SAM model load time: weights built without random initialisation vs the old way.

    OMP_NUM_THREADS=2 python benchmarks/model_load.py [--model lite_medsam] [--repeats 5]

``load_sam`` builds the modules on the meta device and assigns the checkpoint's tensors
(``build._build_for_state``). The baseline in the same run is the way a model was loaded
before: ``build_sam`` (real modules, random initialisation: TinyViT's ``trunc_normal_``,
every ``nn.Linear``'s ``kaiming_uniform_``), then ``load_state_dict`` copying the weights
in. Both read the same file each time (the read is part of a load); the two alternate so
they see the same machine load, and the outputs of the two models are compared on one
input. Prints the median seconds of each and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from _machine import machine_line  # noqa: E402
from napari_gpuseg.models import registry  # noqa: E402
from napari_gpuseg.models.state_dict_loading import load_state_dict_strict, read_state_dict  # noqa: E402
from napari_gpuseg.models.sam.build import build_sam, infer_arch, infer_image_size, load_sam  # noqa: E402


def old_load(path):
    state = read_state_dict(path, map_location="cpu")
    arch = infer_arch(state)
    model = build_sam(arch, image_size=infer_image_size(state, arch))
    load_state_dict_strict(model, state)
    return model.requires_grad_(False).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="lite_medsam", help="registry name of a full SAM checkpoint")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(machine_line())
    path = registry.resolve_checkpoint(args.model)
    print(f"{args.model}: {path.name}, {path.stat().st_size / 2**20:.1f} MiB")
    old_load(path), load_sam(None, path)  # warm-up: imports, file cache
    t_old, t_new = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        a = old_load(path)
        t_old.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = load_sam(None, path)
        t_new.append(time.perf_counter() - t0)
    size = a.image_size
    x = torch.rand(1, 3, size, size) * (255 if a.normalization == "sam" else 1)
    with torch.no_grad():
        same = torch.equal(a.image_encoder(a.preprocess(x) if hasattr(a, "preprocess") else x),
                           b.image_encoder(b.preprocess(x) if hasattr(b, "preprocess") else x))
    mo, mn = statistics.median(t_old), statistics.median(t_new)
    print(f"random init + copy (before): median {mo:.3f} s  {[round(t, 3) for t in t_old]}")
    print(f"meta + assign      (after):  median {mn:.3f} s  {[round(t, 3) for t in t_new]}")
    print(f"ratio before/after: {mo / mn:.2f}x; image embeddings identical: {same}")


if __name__ == "__main__":
    main()
