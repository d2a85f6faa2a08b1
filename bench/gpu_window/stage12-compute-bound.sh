#!/usr/bin/env bash
# GPU window, stage 12: where the GPU is the bound (issue 52). Dense models of 3-8 B at seq 2048,
# bf16 compute with fp32 master weights and moments, at the tokens a step `tiertrain plan` names
# as compute-bound (bench/compute_bound.py: the plan's knee, then each system in a process of
# its own), against plain PyTorch + fused AdamW in device memory (activation checkpointing where
# its activations do not fit), in tokens/s and TFLOPS:
# - a Qwen2.5-3B shape (goal: at least 0.9x plain's tokens/s), tiertrain twice: the host's update
#   (in place), then its optimizer states in device memory (memory.optim_device_mib planned);
# - a 5.6 B Llama (40 x 3584), its states on the device (goal: TFLOPS at least the 272 MegaTrain
#   publishes for 7 B on an H100);
# - last, a Llama-3-8B shape whose states partly spill to the drive, tiertrain alone, with its
#   breakdown and the knee (the likeliest to run out of time).
#
#   bench/gpu_window/stage12-compute-bound.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage12-compute-bound
source "$(dirname "$0")/lib.sh" "$@"

if [ "$dry" = 1 ]; then
  step "bench/compute_bound.py on CPU, a Qwen2 of 2 layers of 256 (tied embedding, as Qwen2.5-3B) against plain PyTorch, the plan's micro-batches (dry run)" 0 150 \
    "$PY" bench/compute_bound.py --device cpu --shape qwen2:2x256 --seq-len 64 --steps 3 \
    --also memory.optim_device_mib=none --scratch "$nvme/cb" --out "$out/stage12-compute-bound-3b.md"
  step "bench/compute_bound.py on CPU, tiertrain alone, 4 micro-batches (dry run)" 0 100 \
    "$PY" bench/compute_bound.py --device cpu --shape 2x128 --seq-len 64 --steps 2 --micro-batches 4 --plain off \
    --scratch "$nvme/cb" --out "$out/stage12-compute-bound-8b.md"
else
  step "Qwen2.5-3B shape, seq 2048, bf16 on CUDA, the plan's tokens a step: tiertrain (default host budget; then its optimizer states in device memory, planned) vs plain PyTorch in device memory (bench/compute_bound.py)" \
    1 290 "$PY" bench/compute_bound.py --device cuda --shape qwen2.5-3b --seq-len 2048 --steps 4 \
    --also memory.optim_device_mib=none --scratch "$nvme/cb" --out "$out/stage12-compute-bound-3b.md"
  step "Llama 40 x 3584 (5.6 B), seq 2048, bf16 on CUDA, host budget 108 GiB, its optimizer states in device memory (planned): tiertrain vs plain PyTorch in device memory" \
    1 220 "$PY" bench/compute_bound.py --device cuda --shape 40x3584 --seq-len 2048 --steps 3 \
    --set memory.optim_device_mib=none --host-mib 110592 --scratch "$nvme/cb" --out "$out/stage12-compute-bound-5b.md"
  step "Llama-3-8B shape, seq 2048, bf16 on CUDA, host budget 96 GiB (the rest of its states on the drive): tiertrain alone, its breakdown and knee" \
    1 150 "$PY" bench/compute_bound.py --device cuda --shape llama3-8b --seq-len 2048 --steps 3 --plain off \
    --host-mib 98304 --scratch "$nvme/cb" --out "$out/stage12-compute-bound-8b.md"
fi
finish
