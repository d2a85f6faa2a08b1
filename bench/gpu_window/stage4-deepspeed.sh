#!/usr/bin/env bash
# GPU window, stage 4 of 9: tiertrain against DeepSpeed ZeRO-Infinity on the GPU, bf16, states on
# the NVMe, same model and data (bench/vs_deepspeed.py), where DeepSpeed is importable; skipped,
# with the reason, where it is not. It is not in the GPU image, and it is published as source
# only (its ops built on first use, its NVMe path needing libaio): `bench/gpu_window/wheels.sh
# --deepspeed` builds its wheel here (ops left to build on first use, which the image's compilers
# do) and fetches its requirements and libaio's two Debian packages into .whl/.
#
#   bench/gpu_window/stage4-deepspeed.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage4-deepspeed
source "$(dirname "$0")/lib.sh" "$@"

if ! deepspeed_ready; then
  skip "tiertrain vs DeepSpeed ZeRO-Infinity" "$DS_WHY"
  finish
fi
step "tiertrain vs DeepSpeed ZeRO-Infinity, cuda, bf16 (bench/vs_deepspeed.py)" 1 500 \
  "$PY" bench/vs_deepspeed.py --device cuda --dtype bfloat16 --steps 4 --rounds 1 --systems deepspeed,baseline,engines \
  --scratch "$nvme/vs-deepspeed" --out "$out/stage4-deepspeed-vs.md"
finish
