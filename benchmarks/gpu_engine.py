"""The default SAM model on a GPU through the public engine API: latency, precision, OOM back-off.

    python benchmarks/gpu_engine.py [--device cuda] [--fields 3] [--objects 20] [--json FILE]

What the annotator's worker does on a GPU, without a window: a 520x696 BBBC039 validation
field (the last 8 fields; never trained on) is prepared and every view a prompt may need is
embedded (12 grid tiles + 24 finer click tiles for the default), then boxes and clicks are
decoded one prompt per call, as a user's edits arrive. Sections:

1. the device and the policy the engine picks (precision and why), one NVML reading;
2. latency per field: the embedding of all views (the first field pays cuDNN's autotuning and
   kernel loads: "cold"), a box, a first click (multimask, zoomed and native views), a
   corrective click (previous logits as mask input); medians over ``--objects`` objects;
3. the policy's reduced precision against fp32 on the same device: mean IoU to the ground
   truth after 1 and 3 clicks and with a box (``click_ious``, the clicks benchmark's rules), and
   the mean IoU between the two precisions' first-click masks;
4. a real out-of-memory back-off: the encoder run over 64 views at batch 64 with the caching
   allocator capped (``torch.cuda.set_per_process_memory_fraction``) so that batch cannot fit;
   the batch runner must halve until it fits, lose no view, and give the batch-1 embeddings;
5. with ``--first-mask-pairs N``: fresh processes, the GPU warm-up at model load
   (``engine/sam/interactive/gpu_warmup.py``, what the annotator does) against none, alternating: load,
   warm-up, a box on a new field -> its mask, the rest of that field, the next field.

On a CPU (``--device cpu``) it runs the same sections (section 4 then says it needs CUDA).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tifffile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _data import bbbc039_validation  # noqa: E402  (benchmarks/, the script's folder)
from _machine import cpu_flags, cpu_name  # noqa: E402
from _timing import timed  # noqa: E402
from napari_gpuseg.engine import load_engine  # noqa: E402
from napari_gpuseg.engine.runtime import memory  # noqa: E402
from napari_gpuseg.engine.runtime.batching import BatchRunner  # noqa: E402
from napari_gpuseg.engine.runtime.device import Policy, device_name, make_policy, synchronize  # noqa: E402
from napari_gpuseg.engine.sam.training.click_eval import click_ious, interior_point, tight_box  # noqa: E402
from napari_gpuseg.engine.sam.interactive.inputs import view_input  # noqa: E402
from napari_gpuseg.engine.sam.interactive.predictor import Prompt  # noqa: E402
from napari_gpuseg.models.registry import DEFAULT_MODEL  # noqa: E402

OUT: dict = {}


def objects(labels: np.ndarray, n: int, seed: int = 0):
    from scipy import ndimage as ndi

    slices = ndi.find_objects(labels)
    objs = [(i + 1, s) for i, s in enumerate(slices) if s is not None and (labels[s] == i + 1).sum() >= 30]
    pick = np.random.default_rng(seed).choice(len(objs), min(n, len(objs)), replace=False)
    return [objs[k] for k in sorted(pick)]


def section_device(policy: Policy) -> None:
    dev = policy.device
    print(f"CPU: {cpu_name()} ({cpu_flags()}); torch {torch.__version__}; {time.strftime('%Y-%m-%d')}")
    print(f"device: {device_name(dev)}; policy precision {policy.precision} ({policy.reason})")
    if dev.type == "cuda":
        print(f"compute capability {torch.cuda.get_device_capability(dev)}, "
              f"bf16 supported {torch.cuda.is_bf16_supported()}")
    snap = memory.snapshot(dev)
    keys = ("allocated", "reserved", "free", "total", "utilization", "temperature", "power", "nvml_error")
    print("memory snapshot: " + ", ".join(f"{k}={getattr(snap, k)}" for k in keys))
    OUT["device"] = {"name": device_name(dev), "precision": policy.precision, "reason": policy.reason,
                     **{k: getattr(snap, k) for k in keys}}


def section_latency(engine, fields, n_obj: int) -> None:
    dev = engine.policy.device
    print(f"\n## Latency per field, {engine.info.name}, {engine.policy.precision} on {device_name(dev)}")
    print("| field | views | embed all views (s) | box (ms) | first click (ms) | corrective click (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for k, (img, lab) in enumerate(fields):
        prepared = engine.prepare(img)
        views = engine.prompt_views(prepared)
        t_embed, _ = timed(lambda: engine.embed([prepared], [views]), dev)
        box_ms, click_ms, fix_ms = [], [], []
        for oid, s in objects(lab, n_obj, seed=k):
            truth = lab[s] == oid
            off = np.array([s[1].start, s[0].start])
            box = tight_box(truth) + np.concatenate([off, off])
            t, _ = timed(lambda: engine.predict(prepared, [Prompt(box=box)]), dev)
            box_ms.append(t * 1000)
            pt = (interior_point(truth) + off)[None]
            t, res = timed(lambda: engine.predict(prepared, [Prompt(points=pt, labels=np.ones(1, np.int64))],
                                                  multimask=True), dev)
            click_ms.append(t * 1000)
            # a negative click just outside the object's box corner, the first logits fed back
            y0, x0 = max(0, s[0].start - 2), max(0, s[1].start - 2)
            pts = np.concatenate([pt, np.array([[x0, y0]])])
            t, _ = timed(lambda: engine.predict(prepared, [Prompt(points=pts, labels=np.array([1, 0]),
                                                                  mask_input=res[0])]), dev)
            fix_ms.append(t * 1000)
        row = {"field": k, "views": len(views), "embed_s": round(t_embed, 3),
               "box_ms": round(statistics.median(box_ms), 1), "click_ms": round(statistics.median(click_ms), 1),
               "fix_ms": round(statistics.median(fix_ms), 1)}
        rows.append(row)
        print(f"| {k}{' (cold)' if k == 0 else ''} | {len(views)} | {t_embed:.3f} | {row['box_ms']} | "
              f"{row['click_ms']} | {row['fix_ms']} |", flush=True)
    OUT.setdefault("latency", {})[engine.policy.precision] = rows


def section_precision(engines: dict, fields, n_obj: int) -> None:
    print("\n## Reduced precision vs fp32, same device, same objects")
    print("| precision | objects | 1 click | 3 clicks | box | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    firsts = {}
    for prec, engine in engines.items():
        t0 = time.perf_counter()
        c, b = [], []
        for k, (img, lab) in enumerate(fields):
            r = click_ious(engine, img, lab, clicks=3, max_objects=n_obj, seed=k)
            c.append(r["clicks"])
            b.append(r["box"])
        c, b = np.concatenate(c), np.concatenate(b)
        firsts[prec] = c[:, 0]
        OUT.setdefault("precision", {})[prec] = {"objects": len(b), "click_1": float(c[:, 0].mean()),
                                                 "click_3": float(c[:, 2].mean()), "box": float(b.mean())}
        print(f"| {prec} | {len(b)} | {c[:, 0].mean():.3f} | {c[:, 2].mean():.3f} | {b.mean():.3f} | "
              f"{time.perf_counter() - t0:.1f} |", flush=True)
    # first-click masks of the two precisions against each other
    (pa, ea), (pb, eb) = list(engines.items())[:2]
    agree = []
    for k, (img, lab) in enumerate(fields):
        pre_a, pre_b = ea.prepare(img), eb.prepare(img)
        for oid, s in objects(lab, n_obj, seed=k):
            pt = (interior_point(lab[s] == oid) + [s[1].start, s[0].start])[None]
            ma = ea.predict(pre_a, [Prompt(points=pt, labels=np.ones(1, np.int64))], multimask=True)[0].full(lab.shape)
            mb = eb.predict(pre_b, [Prompt(points=pt, labels=np.ones(1, np.int64))], multimask=True)[0].full(lab.shape)
            u = np.logical_or(ma, mb).sum()
            agree.append(np.logical_and(ma, mb).sum() / u if u else 1.0)
    agree = np.asarray(agree)
    OUT["precision"]["first_click_agreement"] = {"mean": float(agree.mean()), "min": float(agree.min()),
                                                 "under_0.9": int((agree < 0.9).sum()), "n": len(agree)}
    print(f"\nfirst-click masks, {pa} vs {pb}: mean IoU {agree.mean():.4f}, min {agree.min():.3f}, "
          f"{(agree < 0.9).sum()} of {len(agree)} under 0.9")


def section_oom(engine, img) -> None:
    dev = engine.policy.device
    print("\n## Out-of-memory back-off (real allocator limit)")
    if dev.type != "cuda":
        print("needs CUDA: skipped")
        return
    prepared = engine.prepare(img)
    views = (engine.prompt_views(prepared) * 4)[:64]
    x = torch.stack([view_input(prepared, v, engine.info.normalization) for v in views])
    one = torch.cat([engine.encode(x[i:i + 1]).float().cpu() for i in range(len(x))])
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    engine.encode(x[:4])
    synchronize(dev)
    per4 = torch.cuda.max_memory_allocated(dev) - torch.cuda.memory_allocated(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = torch.cuda.memory_allocated(dev) + x.numel() * 4 + 4 * per4  # room for about 16 views
    torch.cuda.empty_cache()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    try:
        runner = BatchRunner(batch_size=64, device=dev)
        t, outs = timed(lambda: runner.run(lambda b: engine.encode(b).float().cpu(), x), dev)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        torch.cuda.empty_cache()
    got = torch.stack(outs)
    diff = (got - one).abs().max().item() / max(1e-12, one.abs().max().item())
    ok = len(outs) == len(x) and runner.oom_events > 0 and diff < 5e-2
    OUT["oom"] = {"cap_mib": cap / 2**20, "oom_events": runner.oom_events, "final_batch": runner.batch_size,
                  "views": len(outs), "max_rel_diff_vs_batch1": diff, "seconds": t, "ok": ok}
    print(f"allocator capped at {cap / 2**20:.0f} MiB (activations of 4 views: {per4 / 2**20:.0f} MiB); "
          f"batch 64 -> {runner.batch_size} after {runner.oom_events} out-of-memory errors; "
          f"{len(outs)} of {len(x)} views; max rel. difference to batch 1: {diff:.2e}; {t:.2f} s: "
          f"{'OK' if ok else 'FAILED'}")


def first_mask_child(args) -> None:
    """One fresh process: load, warm or not, then a box on a new field as a drop would."""
    from napari_gpuseg.engine.sam.interactive.gpu_warmup import warm_gpu

    policy = make_policy(args.device, args.precision)
    pairs = bbbc039_validation()
    (img, lab), (img2, _lab2) = [(tifffile.imread(a), tifffile.imread(b)) for a, b in pairs[:2]]
    t_load, engine = timed(lambda: load_engine(args.model, policy=policy), policy.device)
    t_warm = warm_gpu(engine) if args.child == "warm" else 0.0
    # the object nearest the field's centre, boxed as soon as the image is there
    cy, cx = np.array(lab.shape) / 2
    oid, s = min(objects(lab, 10**6), key=lambda o: ((o[1][0].start + o[1][0].stop) / 2 - cy) ** 2
                 + ((o[1][1].start + o[1][1].stop) / 2 - cx) ** 2)
    off = np.array([s[1].start, s[0].start])
    box = tight_box(lab[s] == oid) + np.concatenate([off, off])

    def first():
        prepared = engine.prepare(img)
        return prepared, engine.predict(prepared, [Prompt(box=box)], near_box=True)

    t_first, (prepared, _res) = timed(first, policy.device)

    def rest(image):
        for _ in engine.embed_steps(image, engine.prompt_views(image)):
            pass

    t_rest, _ = timed(lambda: rest(prepared), policy.device)
    t_field, _ = timed(lambda: rest(engine.prepare(img2)), policy.device)
    print(json.dumps({"kind": args.child, "load_s": t_load, "warm_s": t_warm, "first_mask_s": t_first,
                      "rest_of_field_s": t_rest, "next_field_s": t_field}), flush=True)


def first_mask_pairs(args) -> None:
    """Fresh processes, warm-up at load vs none, alternating; medians."""
    import subprocess

    runs = {"warm": [], "none": []}
    for k in range(args.first_mask_pairs):
        for kind in (("warm", "none") if k % 2 == 0 else ("none", "warm")):
            cmd = [sys.executable, __file__, "--child", kind, "--device", args.device, "--model", args.model,
                   "--precision", args.precision]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode or not line:
                print(out.stdout[-2000:], out.stderr[-2000:])
                raise SystemExit(f"child {kind} failed")
            runs[kind].append(json.loads(line[-1]))
    print(f"\n## First mask after a drop in a fresh process, {args.model}: warm-up at load vs none "
          f"({args.first_mask_pairs} pairs, alternating; medians)")
    print("| at load | load (s) | warm-up (s) | first box -> mask (s) | rest of the field (s) | next field (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "kind"}
        OUT.setdefault("first_mask", {})[kind] = {"median": med, "runs": rs}
        print(f"| {kind} | {med['load_s']:.2f} | {med['warm_s']:.2f} | {med['first_mask_s']:.3f} | "
              f"{med['rest_of_field_s']:.3f} | {med['next_field_s']:.3f} |")
    w, n = (OUT["first_mask"][k]["median"] for k in ("warm", "none"))
    print(f"\nfirst mask {n['first_mask_s'] / w['first_mask_s']:.1f}x sooner with the warm-up; as a "
          f"fraction of a warm field's embedding: {w['first_mask_s'] / w['next_field_s']:.2f} "
          f"(none: {n['first_mask_s'] / n['next_field_s']:.2f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"registry name or file (default {DEFAULT_MODEL})")
    ap.add_argument("--precision", default="auto", help="the engine's precision (auto: the policy's)")
    ap.add_argument("--fields", type=int, default=3, help="validation fields for the latency section")
    ap.add_argument("--objects", type=int, default=20, help="objects per field")
    ap.add_argument("--precision-fields", type=int, default=8)
    ap.add_argument("--first-mask-pairs", type=int, default=0,
                    help="also time the first mask in fresh processes, warm-up at load vs none")
    ap.add_argument("--only-first-mask", action="store_true")
    ap.add_argument("--child", choices=("warm", "none"), help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.child:
        first_mask_child(args)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    policy = make_policy(args.device, args.precision)
    section_device(policy)
    if args.only_first_mask:
        first_mask_pairs(args)
        if args.json:
            Path(args.json).write_text(json.dumps(OUT, indent=1, default=str))
        return 0
    pairs = bbbc039_validation()
    fields = [(tifffile.imread(a), tifffile.imread(b)) for a, b in pairs]
    engine = load_engine(args.model, policy=policy)
    section_latency(engine, fields[: args.fields], args.objects)
    engines = {policy.precision: engine}
    if policy.precision != "fp32":
        engines["fp32"] = load_engine(args.model, policy=Policy(policy.device, "fp32"))
        section_precision(engines, fields[: args.precision_fields], args.objects)
    else:
        print("\n(the policy runs fp32 here: no reduced-precision comparison)")
    section_oom(engine, fields[0][0])
    if args.first_mask_pairs:
        first_mask_pairs(args)
    if args.json:
        Path(args.json).write_text(json.dumps(OUT, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
