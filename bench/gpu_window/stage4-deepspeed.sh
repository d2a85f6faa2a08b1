#!/usr/bin/env bash
# GPU window, stage 4 of 6: tiertrain against DeepSpeed ZeRO-Infinity on the GPU, bf16, states on
# the NVMe, same model and data (bench/vs_deepspeed.py), where DeepSpeed is importable; skipped,
# with the reason, where it is not. It is not in the GPU image, and it is published as source
# only (its ops built on first use, its NVMe path needing libaio): carrying it is not built yet,
# so on that image this stage is one skip and costs a call.
#
#   bench/gpu_window/stage4-deepspeed.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage4-deepspeed
source "$(dirname "$0")/lib.sh" "$@"

if ! why=$("$PY" -c "import deepspeed" 2>&1); then
  skip "tiertrain vs DeepSpeed ZeRO-Infinity" "DeepSpeed is not importable here: $(printf '%s' "$why" | tail -n 1)"
  finish
fi
step "tiertrain vs DeepSpeed ZeRO-Infinity, cuda, bf16 (bench/vs_deepspeed.py)" 1 500 \
  "$PY" bench/vs_deepspeed.py --device cuda --dtype bfloat16 --steps 4 --rounds 1 \
  --scratch "$nvme/vs-deepspeed" --out "$out/stage4-deepspeed-vs.md"
finish
