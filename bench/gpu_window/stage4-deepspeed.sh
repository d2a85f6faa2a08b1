#!/usr/bin/env bash
# GPU window, stage 4 of 8: tiertrain against DeepSpeed ZeRO-Infinity on the GPU, bf16, states on
# the NVMe, same model and data (bench/vs_deepspeed.py), where DeepSpeed is importable; skipped,
# with the reason, where it is not. It is not in the GPU image, and it is published as source
# only (its ops built on first use, its NVMe path needing libaio): `bench/gpu_window/wheels.sh
# --deepspeed` builds its wheel here (ops left to build on first use, which the image's compilers
# do) and fetches its requirements and libaio's two Debian packages into .whl/.
#
#   bench/gpu_window/stage4-deepspeed.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage4-deepspeed
source "$(dirname "$0")/lib.sh" "$@"

# libaio (DeepSpeed's NVMe path compiles against it on first use): carried as .deb, unpacked into
# a private prefix, never into / (the image's own packages stay as they are)
if compgen -G "$wheels/libaio*.deb" > /dev/null; then
  aio=/tmp/tiertrain-aio
  for d in "$wheels"/libaio*.deb; do dpkg-deb -x "$d" "$aio" || say "- could not unpack $d"; done
  lib=$aio/usr/lib/x86_64-linux-gnu
  [ -e "$lib/libaio.so" ] || ln -sf libaio.so.1 "$lib/libaio.so"
  export CPATH="$aio/usr/include${CPATH:+:$CPATH}" LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "- libaio: carried, unpacked into $aio"
fi
export MAX_JOBS=${MAX_JOBS:-16}  # the ops' first build
if ! why=$("$PY" -c "import deepspeed" 2>&1); then
  skip "tiertrain vs DeepSpeed ZeRO-Infinity" "DeepSpeed is not importable here: $(printf '%s' "$why" | tail -n 1)"
  finish
fi
# DeepSpeed 0.19.8 parses each TORCH_CUDA_ARCH_LIST entry as numbers and stops at the image's "9.0a"
# (seen on an H200): give it the device's capability as plain numbers
case "${TORCH_CUDA_ARCH_LIST:-}" in
  *[a-z]*|"") cap=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2> /dev/null) &&
              export TORCH_CUDA_ARCH_LIST=$cap ;;
esac
step "tiertrain vs DeepSpeed ZeRO-Infinity, cuda, bf16 (bench/vs_deepspeed.py)" 1 500 \
  "$PY" bench/vs_deepspeed.py --device cuda --dtype bfloat16 --steps 4 --rounds 1 --systems deepspeed,baseline,engines \
  --scratch "$nvme/vs-deepspeed" --out "$out/stage4-deepspeed-vs.md"
finish
