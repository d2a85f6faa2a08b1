#!/usr/bin/env bash
# GPU window, stage 8 of 9: LoRA on a frozen 2.4 B Llama streamed from the drive (bench/lora.py
# --device cuda): tiertrain's step against its I/O floor (two reads of the bf16 base at the
# rate probed in the same process; #34's goal: within 1.15x) and against DeepSpeed ZeRO-3 with
# every parameter on NVMe + peft where DeepSpeed is carried (wheels.sh --deepspeed), bf16 compute.
#
#   bench/gpu_window/stage8-lora.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage8-lora
source "$(dirname "$0")/lib.sh" "$@"

if [ "$dry" = 1 ]; then
  step "bench/lora.py on CPU, 2 layers of 256, no peer (dry run)" 0 200 \
    "$PY" bench/lora.py --device cpu --big 2x256 --steps 2 --host-mib 1024 --skip-peer --probe-mib 64 \
    --scratch "$nvme/lora" --out "$out/stage8-lora-bench.md"
else
  # peft in device memory was measured in the window of 2026-11-27 (its step is compute alone, 9x
  # below any run that reads the base from one drive): this stage's time goes to DeepSpeed instead
  ds=()
  if deepspeed_ready; then ds=(--ds-python "$PY"); else skip "DeepSpeed ZeRO-3 + peft" "$DS_WHY"; fi
  step "LoRA rank 16 on a frozen 2.46 B Llama, bf16 on CUDA, base on the drive, vs DeepSpeed ZeRO-3 NVMe + peft (bench/lora.py)" \
    1 520 "$PY" bench/lora.py --device cuda --steps 4 --skip-peer "${ds[@]}" --scratch "$nvme/lora" \
    --out "$out/stage8-lora-bench.md"
fi
finish
