#!/usr/bin/env bash
# GPU window, stage 6 of 9: GPUDirect Storage, where kvikio is importable (carried by wheels.sh):
# parameters read from the NVMe straight into GPU memory, checksums verified on the GPU, the same
# bits as reading through pinned host memory (bench/gpu_window/gds_check.py); then the storage
# tier on the NVMe (tiertrain bench io; against fio where fio is installed).
#
#   bench/gpu_window/stage6-gds.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage6-gds
source "$(dirname "$0")/lib.sh" "$@"

if why=$("$PY" -c "import kvikio" 2>&1); then
  step "GPUDirect Storage: parameters from the tier through kvikio vs through host memory, 5 steps" 1 300 \
    "$PY" bench/gpu_window/gds_check.py --scratch "$nvme/gds" --steps 5
else
  skip "GPUDirect Storage" "kvikio is not importable here: $(printf '%s' "$why" | tail -n 1)"
fi
fio=(--no-fio)
command -v fio > /dev/null && fio=()
size=2
[ "$dry" = 1 ] && size=0.0625
step "storage tier on the drive (tiertrain bench io, $size GiB)" 0 200 \
  "${TT[@]}" bench io --path "$nvme/io" --size-gib "$size" --repeats 2 "${fio[@]}" --out "$out/stage6-gds-io.md"
finish
