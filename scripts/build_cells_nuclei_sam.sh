#!/usr/bin/env bash
# Rebuild the shipped SAM decoder napari_gpuseg/weights/cells_nuclei_sam_decoder.pt (model card:
# napari_gpuseg/weights/CELLS_NUCLEI_SAM_CARD.md): one `napari-gpuseg train-sam` stage that
# continues from the nuclei decoder (`nuclei_sam`, scripts/build_nuclei_sam.sh) on LiteMedSAM's
# encoder, on the training parts of ../shared/data (or $NAPARI_GPUSEG_SHARED_DATA): whole cells
# in transmitted light (scratch_assay t00-t06, both polarities), their nuclei, and BBBC039 and
# DSB2018 nuclei so that nuclei are kept. Native views and views 1.5x finer, random gamma
# 1/1.5..1.5 per picture. Time-bound (--max-time, embedding excluded), so the weights depend on
# the machine's speed. Embeddings are cached on disk ($EMB_CACHE, default: the model cache), so
# a rerun skips the encoder. NAPARI_GPUSEG_CMD overrides the command (e.g. "python -m napari_gpuseg.cli").
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${NAPARI_GPUSEG_SHARED_DATA:-../shared/data}"
OUT="${1:-napari_gpuseg/weights/cells_nuclei_sam_decoder.pt}"
CMD="${NAPARI_GPUSEG_CMD:-napari-gpuseg}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

$CMD train-sam \
  --images "$DATA/scratch_assay/cells/images" --labels "$DATA/scratch_assay/cells/masks" --limit 7 \
    --views-per-image 3 --polarity random \
  --images "$DATA/scratch_assay/nuclei/images" --labels "$DATA/scratch_assay/nuclei/masks" --limit 7 \
    --views-per-image 1 --polarity random \
  --images "$DATA/bbbc039/images" --labels "$DATA/bbbc039/masks" --limit 8 \
    --views-per-image 1 --polarity as-is \
  --images "$DATA/dsb2018_more/images" --labels "$DATA/dsb2018_more/masks" --limit 0 \
    --views-per-image 1 --polarity random \
  --zoom 1 --zoom 1.5 --click-zoom 1.5 --contrast-jitter 1.5 \
  --model nuclei_sam --out "$OUT" ${EMB_CACHE:+--cache "$EMB_CACHE"} \
  --max-steps 5000 --max-time "${MAX_TIME:-2700}" --views-per-step 4 --objects-per-view 3 --lr 3e-4 \
  --box-fraction 0.25 --corrections 2 --eval-every 20 --val-objects 48 --val-fraction 0.1 --patience 8 --seed 4

sha256sum "$OUT"
