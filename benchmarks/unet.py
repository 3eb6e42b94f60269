"""U-Net benchmark: tiled inference ours vs MONAI (same network, image, window, overlap,
batch, in the same run), adaptive batches, training iterations/s; on a GPU also
fp32 vs fp16/bf16, channels_last and torch.compile for inference and training.

    OMP_NUM_THREADS=2 python benchmarks/unet.py [--quick] [--out results.md]

Timings are the best of ``--repeats`` runs, ours and MONAI interleaved so both see the
same machine load. MONAI is a reference only (not a package dependency).
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from napari_gpuseg.engine.runtime.device import Policy, device_name
from napari_gpuseg.engine.unet.tiling import sliding_window_inference, window_slices
from napari_gpuseg.engine.unet.loss import dice_ce_loss
from napari_gpuseg.engine.unet.predict import default_roi
from napari_gpuseg.models.unet import UNet, UNetConfig

ROWS: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    ROWS.append(line)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def interleaved(fns: dict, device, repeats: int) -> dict:
    """Best time of each callable, run in rounds (every variant once per round) so that
    all variants see the same background load on a shared machine."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            best[k] = min(best[k], best_of(fn, device, 1))
    return best


def net_for(dims: int, device, channels_last=False) -> UNet:
    torch.manual_seed(0)
    cfg = UNetConfig(spatial_dims=dims, depth=3, base=16 if dims == 2 else 8, norm="batch")
    net = UNet(cfg).to(device).eval()
    if channels_last and dims == 2:
        net = net.to(memory_format=torch.channels_last)
    return net


def tiled_vs_monai(device: torch.device, cases, repeats: int, sw_batch: int) -> None:
    from monai.inferers import sliding_window_inference as monai_swi

    emit(f"\n### Tiled inference, ours vs MONAI ({device_name(device)}, fp32, sw_batch_size={sw_batch}, "
         "overlap 0.25, gaussian)\n")
    emit("| image | window | windows | MONAI (s) | ours, same settings (s) | MONAI / ours | max abs diff | "
         "ours, defaults (s) | MONAI / ours defaults |")
    emit("|---|---|---|---|---|---|---|---|---|")
    policy = Policy(device, "fp32")
    for shape, roi in cases:
        net = net_for(len(shape), device)
        x = torch.rand((1, 1) + shape, device=device)
        # what predict_probabilities does by default: automatic window, channels_last in 2D
        auto = default_roi(net.config, shape)
        cl = len(shape) == 2
        net_cl = net_for(len(shape), device, channels_last=cl)
        with torch.inference_mode():
            runs = {
                "monai": lambda: monai_swi(x, roi, sw_batch, net, overlap=0.25, mode="gaussian"),
                "ours": lambda: sliding_window_inference(x, roi, sw_batch, net, overlap=0.25, mode="gaussian",
                                                         policy=policy),
                "default": lambda: sliding_window_inference(x, auto, sw_batch, net_cl, overlap=0.25,
                                                            mode="gaussian", policy=policy, channels_last=cl),
            }
            diff = (runs["ours"]() - runs["monai"]()).abs().max().item()
            times = interleaved(runs, device, repeats)
        n = len(window_slices(shape, roi, 0.25))
        a, b, c = times["ours"], times["monai"], times["default"]
        how = f"{'x'.join(map(str, auto))}{', channels_last' if cl else ''}"
        emit(f"| {'x'.join(map(str, shape))} | {'x'.join(map(str, roi))} | {n} | {b:.3f} | {a:.3f} | "
             f"{b / a:.2f} | {diff:.1e} | {c:.3f} ({how}) | {b / c:.2f} |")


def inference_modes(device: torch.device, repeats: int) -> None:
    """Precision / channels_last / compile / adaptive batch for our tiled inference."""
    shape, roi = (1024, 1024), (256, 256)
    x = torch.rand((1, 1) + shape, device=device)
    emit(f"\n### Our tiled inference variants, {shape[0]}x{shape[1]}, window 256 ({device_name(device)})\n")
    emit("| variant | seconds | speed-up vs fp32 |")
    emit("|---|---|---|")
    precisions = ["fp32", "bf16"] + (["fp16"] if device.type == "cuda" else [])
    variants = [(p, False, False, 8) for p in precisions]
    if device.type == "cuda":
        best = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        variants += [(best, True, False, 8), (best, True, True, 8), (best, True, False, None)]
    else:
        variants += [("fp32", True, False, 8), ("bf16", True, False, 8), ("fp32", False, False, None)]
    runs = {}
    for prec, cl, comp, bs in variants:
        net = net_for(2, device, channels_last=cl)
        fn = torch.compile(net) if comp else net
        policy = Policy(device, prec)
        name = f"{prec}{' channels_last' if cl else ''}{' compile' if comp else ''}" \
               f"{' batch Auto' if bs is None else f' batch {bs}'}"
        runs[name] = (lambda fn=fn, bs=bs, policy=policy, cl=cl: sliding_window_inference(
            x, roi, bs, fn, overlap=0.25, mode="gaussian", policy=policy, channels_last=cl))
    with torch.inference_mode():
        for run in runs.values():
            run()  # warm-up (and compile)
        times = interleaved(runs, device, repeats)
    base = times[next(iter(times))]
    for name, t in times.items():
        emit(f"| {name} | {t:.3f} | {base / t:.2f} |")


def training_speed(device: torch.device, iters: int, crop: int, batch: int, rounds: int = 3) -> None:
    emit(f"\n### Training iterations/s ({device_name(device)}, U-Net base 16 depth 3, "
         f"batch {batch} x {crop}x{crop}, AdamW{' fused' if device.type == 'cuda' else ''})\n")
    emit("| variant | it/s | crops/s |")
    emit("|---|---|---|")
    precisions = ["fp32", "bf16"] + (["fp16"] if device.type == "cuda" else [])
    variants = [(p, False, False) for p in precisions]
    if device.type == "cuda":
        best = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        variants += [(best, True, False), (best, True, True)]
    x = torch.rand(batch, 1, crop, crop, device=device)
    y = torch.randint(0, 3, (batch, crop, crop), device=device)
    steps = {}
    for prec, cl, comp in variants:
        torch.manual_seed(0)
        net = UNet(UNetConfig(base=16, depth=3)).to(device).train()
        xb = x
        if cl:
            net = net.to(memory_format=torch.channels_last)
            xb = x.contiguous(memory_format=torch.channels_last)
        fn = torch.compile(net) if comp else net
        opt = torch.optim.AdamW(net.parameters(), 1e-3, fused=device.type == "cuda")
        scaler = torch.amp.GradScaler(device.type, enabled=prec == "fp16")
        policy = Policy(device, prec)

        def step(fn=fn, xb=xb, opt=opt, scaler=scaler, policy=policy):
            with policy.autocast():
                out = fn(xb)
            loss = dice_ce_loss(out, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        for _ in range(3 if comp else 2):
            step()
        name = f"{prec}{' channels_last' if cl else ''}{' compile' if comp else ''}"
        steps[name] = (lambda step=step: [step() for _ in range(iters)])
    times = interleaved(steps, device, rounds)
    for name, t in times.items():
        rate = iters / t
        emit(f"| {name} | {rate:.2f} | {rate * batch:.1f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", help="also write the tables (markdown) here")
    ap.add_argument("--skip-cpu", action="store_true", help="GPU sections only")
    ap.add_argument("--sections", default="monai,variants,train",
                    help="comma-separated subset of: monai, variants, train")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 5)
    emit(f"## U-Net benchmark ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
         f"{platform.machine()}, {torch.get_num_threads()} CPU threads)")
    cpu = torch.device("cpu")
    cases_cpu = [((520, 696), (256, 256)), ((64, 128, 128), (32, 64, 64))]
    if not args.quick:
        cases_cpu.insert(1, ((1024, 1024), (256, 256)))
    sections = set(args.sections.split(","))
    if not args.skip_cpu:
        if "monai" in sections:
            tiled_vs_monai(cpu, cases_cpu, repeats, sw_batch=4)
        if "variants" in sections and not args.quick:
            inference_modes(cpu, repeats)
        if "train" in sections:
            training_speed(cpu, iters=2 if args.quick else 3, crop=128, batch=8, rounds=repeats)
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        torch.backends.cudnn.benchmark = True
        cases_gpu = [((520, 696), (256, 256)), ((2048, 2048), (256, 256)), ((128, 256, 256), (64, 128, 128))]
        if "monai" in sections:
            tiled_vs_monai(gpu, cases_gpu, repeats + 2, sw_batch=16)
        if "variants" in sections:
            inference_modes(gpu, repeats + 2)
        if "train" in sections:
            training_speed(gpu, iters=20, crop=256, batch=16, rounds=3)
    else:
        emit("\n(no CUDA device: GPU sections skipped)")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(ROWS) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
