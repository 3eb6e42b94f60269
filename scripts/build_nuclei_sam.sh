#!/usr/bin/env bash
# Rebuild the shipped SAM decoder napari_gpuseg/weights/nuclei_sam_decoder.pt (model card:
# napari_gpuseg/weights/NUCLEI_SAM_CARD.md) from LiteMedSAM and the training part of the
# real data in ../shared/data (or $NAPARI_GPUSEG_SHARED_DATA). Three stages of
# `napari-gpuseg train-sam`: stage 1 tunes LiteMedSAM's box-trained decoder to clicks on
# a first set of views; stage 2 continues from it on every training field, with up to
# three corrective clicks per object; stage 3 adds views 1.5x finer than native and saves
# the decoder to decode first clicks at that scale. All are time-bound (--max-time), so the
# weights depend on the machine's speed. About 3 h on a 2-core CPU; embeddings are cached on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${NAPARI_GPUSEG_SHARED_DATA:-../shared/data}"
OUT="${1:-napari_gpuseg/weights/nuclei_sam_decoder.pt}"
TMP="$(mktemp -d)"
STAGE1="$TMP/nuclei_sam_stage1.pt"
STAGE2="$TMP/nuclei_sam_stage2.pt"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# --choose-output 0: the shipped nuclei_sam keeps the IoU head's choice for first clicks

napari-gpuseg train-sam \
  --images "$DATA/bbbc039_more/images" --labels "$DATA/bbbc039_more/masks" --limit 48 --views-per-image 1 \
  --images "$DATA/bbbc039/images" --labels "$DATA/bbbc039/masks" --limit 16 --views-per-image 1 \
  --images "$DATA/dsb2018_more/images" --labels "$DATA/dsb2018_more/masks" --limit 0 --views-per-image 3 \
  --model lite_medsam --out "$STAGE1" \
  --max-steps 600 --max-time 3600 --views-per-step 4 --objects-per-view 4 --lr 8e-4 \
  --box-fraction 0.2 --corrections 1 --eval-every 15 --val-objects 32 --val-fraction 0.08 --patience 6 --seed 0 --choose-output 0

napari-gpuseg train-sam \
  --images "$DATA/bbbc039_more/images" --labels "$DATA/bbbc039_more/masks" --limit 0 --views-per-image 1 \
  --images "$DATA/bbbc039/images" --labels "$DATA/bbbc039/masks" --limit 16 --views-per-image 2 \
  --images "$DATA/dsb2018_more/images" --labels "$DATA/dsb2018_more/masks" --limit 0 --views-per-image 0 \
  --model "$STAGE1" --out "$STAGE2" \
  --max-steps 5000 --max-time 3300 --views-per-step 4 --objects-per-view 4 --lr 3e-4 \
  --box-fraction 0.15 --corrections 3 --eval-every 25 --val-objects 96 --val-fraction 0.08 --patience 8 --seed 1 --choose-output 0

napari-gpuseg train-sam \
  --images "$DATA/bbbc039_more/images" --labels "$DATA/bbbc039_more/masks" --limit 0 --views-per-image 1 \
  --images "$DATA/bbbc039/images" --labels "$DATA/bbbc039/masks" --limit 16 --views-per-image 2 \
  --images "$DATA/dsb2018_more/images" --labels "$DATA/dsb2018_more/masks" --limit 0 --views-per-image 4 \
  --zoom 1 --zoom 1.5 --click-zoom 1.5 \
  --model "$STAGE2" --out "$OUT" \
  --max-steps 5000 --max-time 2400 --views-per-step 4 --objects-per-view 4 --lr 2e-4 \
  --box-fraction 0.15 --corrections 3 --eval-every 25 --val-objects 96 --val-fraction 0.08 --patience 8 --seed 2 --choose-output 0

sha256sum "$OUT"
