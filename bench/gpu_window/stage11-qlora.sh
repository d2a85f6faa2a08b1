#!/usr/bin/env bash
# GPU window, stage 11: QLoRA streamed (issue 51). LoRA on a frozen 2.46 B Llama whose base is
# on the drive in bf16, int8 and NF4 (bitsandbytes' formats, dequantized in the device's slots),
# the three alternated (bench/qlora.py --device cuda): bytes read a step, the step against each
# one's floors. Goal: the NF4 step at most 0.35x the bf16 step where the drive bounds both. Needs
# bitsandbytes carried (bench/gpu_window/wheels.sh --qlora); skipped without it.
#
#   bench/gpu_window/stage11-qlora.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage11-qlora
source "$(dirname "$0")/lib.sh" "$@"

if ! BNB_WHY=$("$PY" -c "import bitsandbytes" 2>&1); then
  skip "QLoRA (bench/qlora.py)" "bitsandbytes is not importable here: carry it (bench/gpu_window/wheels.sh --qlora); $(printf '%s' "$BNB_WHY" | tail -n 1)"
elif [ "$dry" = 1 ]; then
  step "bench/qlora.py on CPU, 2 layers of 256, bf16, int8 and NF4 bases (dry run)" 0 200 \
    "$PY" bench/qlora.py --device cpu --shape 2x256 --rounds 1 --steps 2 --host-mib 1024 \
    --base-dtypes bfloat16,int8,nf4 --probe-mib 64 --scratch "$nvme/qlora" --out "$out/stage11-qlora-bench.md"
else
  step "LoRA rank 16 on a frozen 2.46 B Llama, base on the drive in bf16, int8 and NF4, bf16 on CUDA (bench/qlora.py)" \
    1 520 "$PY" bench/qlora.py --device cuda --rounds 1 --steps 3 --base-dtypes bfloat16,int8,nf4 \
    --scratch "$nvme/qlora" --out "$out/stage11-qlora-bench.md"
fi
finish
