#!/usr/bin/env bash
# Re-create every checked-in plan of experiments/ (see experiments/README.md).
# Usage: experiments/make_plans.sh [NAME]   (NAME: one of the plan names below; default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
NOWDL=${NOWDL:-.venv/bin/nowdl}
run() {  # name, then nowdl plan arguments
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [ "$ONLY" != "$name" ]; then return; fi
  echo "== $name"
  "$NOWDL" plan "$@" --mode estimate --device-spec h100 --out "experiments/$name.json"
}
ONLY=${1:-}
# GEMS: ResNet-110-v2 on 1024x1024 pathology tiles, model-parallel over 4 GPUs (the seeds' --split-size 4)
run resnet110v2_1024_4gpu resnet110v2 --input 1x3x1024x1024 --gpus 4 --stages 4
# GEMS-MASTER: the same with the mirrored second replica pinned (rank r holds stages r and 3-r)
run resnet110v2_1024_4gpu_master resnet110v2 --input 1x3x1024x1024 --gpus 4 --stages 4 --replicas 2 --dp 1
# now-dl: AmoebaNet-D at 2048x2048, 4 spatial parts in the first of 2 stages (the seeds' -np 5 run)
run amoebanet_2048_sp4 amoebanet --input 1x3x2048x2048 --gpus 5 --stages 2 --spatial-parts 4 --spatial-stages 1 --slice square --dp 1 --replicas 1
# the built-in UNet at 2048x2048 in 8 pipeline stages, balanced by memory (make demo)
run unet_2048_8gpu_memory unet --input 1x3x2048x2048 --gpus 8 --balance memory --stages 8
# the same with nothing pinned: the search prefers dp 8 (the model fits one H100 at batch 1)
run unet_2048_8gpu_searched unet --input 1x3x2048x2048 --gpus 8 --balance memory
# a 16384x16384 UNet on 64 H100s (80 GiB each), estimate mode: spatial tiles are a must here
run unet_16384_64gpu_h100 unet --input 1x3x16384x16384 --gpus 64 --balance memory --gpu-memory 80GiB
# the same UNet at 8192x8192 on 64 H100s (8 DGX nodes): 4-tile groups, each inside one node (no halo crosses nodes)
run unet_8192_64gpu_h100 unet --input 1x3x8192x8192 --gpus 64 --nodes 8 --gpus-per-node 8 --balance memory --gpu-memory 80GiB
# UNet at 8192x8192: encoder stages on 4 then 2 tiles, the mirrored decoder on 2 then 4 (12 GPUs)
run unet_8192_sp4x2 unet --input 1x3x8192x8192 --gpus 12 --stages 4 --spatial-parts 4,2 --dp 1 --replicas 1
