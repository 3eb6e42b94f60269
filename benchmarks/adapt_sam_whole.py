"""Adapt SAM with the whole model tuned: image encoder, prompt encoder and mask decoder.

    OMP_NUM_THREADS=2 python benchmarks/adapt_sam_whole.py [--annotate left|right]
        [--minutes 12] [--eval-every 4] [--lr-enc 1e-4] [--lr-dec 2e-4]

What the shipped Adapt SAM does not do (it keeps the encoder frozen and embeds each view
once), measured on the same task as ``adapt_sam.py``: the ``dsb2018/`` field's left-half
objects are the annotation (``--annotate right``: the measured objects themselves, a
ceiling), and the right half's objects are clicked through the public engine
(``click_ious``) before and after, in the same run. Every step runs the encoder forward and
backward on ``--views`` training views (fp32, plain ops: the fused inference kernels serve
no gradients), then the Adapt SAM episodes (a click or a box, corrective clicks) on
``--objects`` objects per view; the encoder's batch-norm statistics stay as they are. The
views are the native tiles and the model's click views (1.5x) holding a whole annotated
object. AdamW, warm-up, cosine decay over the wall time; the click evaluations with
``--eval-every`` run inside that time (about 35 s each). Not a product path: a measurement
of what tuning the encoder adds.
"""
import argparse
import time

import numpy as np
import torch

from _data import dsb2018_field
from _machine import machine_line
from adapt_sam import halves
from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.click_eval import click_ious
from napari_gpuseg.engine.sam.training.episode_loss import episode
from napari_gpuseg.engine.sam.training.tune_config import SamTuneConfig
from napari_gpuseg.engine.sam.interactive.inputs import view_input
from napari_gpuseg.engine.sam.training.train_views import candidate_views, view_labels, whole_objects

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--minutes", type=float, default=12, help="wall time of the tuning")
ap.add_argument("--annotate", choices=("left", "right"), default="left",
                help="the half tuned on; right = the measured half (a ceiling)")
ap.add_argument("--lr-enc", type=float, default=1e-4)
ap.add_argument("--lr-dec", type=float, default=2e-4)
ap.add_argument("--views", type=int, default=2, help="training views per step")
ap.add_argument("--objects", type=int, default=8, help="objects per view and step")
ap.add_argument("--bn-train", action="store_true", help="let batch norm follow the training views")
ap.add_argument("--eval-every", type=float, default=4, help="minutes between click evaluations (0: end only)")
args = ap.parse_args()
print(machine_line(), flush=True)
torch.manual_seed(0)
img, lab = dsb2018_field()
left, right = halves(lab)
ann = right if args.annotate == "right" else left

eng = load_engine("nuclei_sam", cache=EmbeddingCache(2 << 30))
r0 = click_ious(eng, img, right, clicks=3)
print(f"start  n={r0['n']} 1 click {r0['clicks'][:, 0].mean():.3f} 3 clicks {r0['clicks'][:, 2].mean():.3f} "
      f"box {r0['box'].mean():.3f}", flush=True)

prep = eng.prepare(img)
items = []
for zoom in (1.0, eng.click_zoom):
    for v in candidate_views(eng, prep, float(zoom)):
        vl = view_labels(ann, v)
        ids = whole_objects(ann, v, prep.shape, vl)
        if len(ids):
            items.append((view_input(prep, v, eng.info.normalization), vl, ids))
print(f"{len(items)} training views, zooms 1 and {eng.click_zoom}", flush=True)

sam = eng.sam
cfg = SamTuneConfig(corrections=2, first_candidates="all")
for p in sam.parameters():
    p.requires_grad_(True)
enc = list(sam.image_encoder.parameters())
dec = list(sam.prompt_encoder.parameters()) + list(sam.mask_decoder.parameters())
opt = torch.optim.AdamW([{"params": enc, "lr": args.lr_enc}, {"params": dec, "lr": args.lr_dec}],
                        weight_decay=1e-4)
rng = np.random.default_rng(0)
dev = torch.device("cpu")


def measure(tag):
    fresh = load_engine("nuclei_sam", cache=EmbeddingCache(2 << 30))
    fresh.sam.load_state_dict({k: v.detach().clone() for k, v in sam.state_dict().items()})
    fresh.sam.eval()
    r = click_ious(fresh, img, right, clicks=3)
    print(f"{tag} 1 click {r['clicks'][:, 0].mean():.3f} 3 clicks {r['clicks'][:, 2].mean():.3f} "
          f"box {r['box'].mean():.3f}", flush=True)


def train_mode():
    sam.train()
    if not args.bn_train:
        for m in sam.image_encoder.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()


train_mode()
t0 = time.perf_counter()
step, next_eval = 0, args.eval_every * 60 if args.eval_every else None
while time.perf_counter() - t0 < args.minutes * 60:
    frac = (time.perf_counter() - t0) / (args.minutes * 60)
    for g, base in zip(opt.param_groups, (args.lr_enc, args.lr_dec)):
        g["lr"] = base * min(1.0, (step + 1) / 10) * 0.5 * (1 + np.cos(np.pi * frac))
    pick = rng.choice(len(items), size=min(args.views, len(items)), replace=False)
    x = torch.stack([items[i][0] for i in pick])
    emb_all = sam.image_encoder(x)
    embs, gts = [], []
    for j, i in enumerate(pick):
        _, vl, ids = items[i]
        for oid in rng.choice(ids, size=min(args.objects, len(ids)), replace=False):
            embs.append(j)
            gts.append(vl == oid)
    emb = emb_all[torch.as_tensor(embs)]
    gt = np.stack(gts)
    is_box = rng.random(len(gt)) < 0.3
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for use_box in (False, True):
        sel = np.nonzero(is_box == use_box)[0]
        if len(sel) == 0:
            continue
        loss = episode(sam, emb[torch.as_tensor(sel)], gt[sel], use_box, rng, cfg, dev) * (len(sel) / len(gt))
        loss.backward(retain_graph=not use_box)
        total += float(loss.detach())
    opt.step()
    step += 1
    if step % 10 == 0:
        print(f"step {step} {time.perf_counter() - t0:.0f}s loss {total:.4f}", flush=True)
    if next_eval and time.perf_counter() - t0 >= next_eval:
        sam.eval()
        measure(f"after {step} steps ({time.perf_counter() - t0:.0f} s):")
        train_mode()
        next_eval += args.eval_every * 60
sam.eval()
measure(f"final {step} steps ({time.perf_counter() - t0:.0f} s):")
