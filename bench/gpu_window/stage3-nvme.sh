#!/usr/bin/env bash
# GPU window, stage 3 of 9: a Llama with every state on the NVMe, bf16, the three update paths
# (baseline, overlap, engines) against plain PyTorch with everything in device memory, with the
# drive's bandwidth and each step's I/O floor measured in the same run (bench/train.py). Then the
# same on a second shape, as the figures must hold on shapes they were not tuned on.
#
#   bench/gpu_window/stage3-nvme.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage3-nvme
source "$(dirname "$0")/lib.sh" "$@"

if [ "$dry" = 1 ]; then
  step "bench/train.py on CPU, the built-in GPT of 2 layers, baseline, 2 steps (dry run)" 0 150 "$PY" bench/train.py --device cpu \
    --dtype float32 --modes baseline,overlap --micro-batches 2 --checksums on --steps 2 --io-gib 0.0625 \
    --model kind=gpt,n_layers=2,d_model=64,n_heads=4,d_ff=128,vocab_size=512 --scratch "$nvme/bench" \
    --out "$out/stage3-nvme-train.md"
else
  step "Llama 134 M, bf16, states on the NVMe: baseline / overlap / engines vs plain PyTorch (bench/train.py)" 1 300 \
    "$PY" bench/train.py --device cuda --dtype bfloat16 --modes baseline,overlap,engines --micro-batches 4 \
    --checksums on --steps 4 --scratch "$nvme/bench" --out "$out/stage3-nvme-train.md"
  step "second shape: 16 layers, d 1024 (bench/train.py)" 1 200 \
    "$PY" bench/train.py --device cuda --dtype bfloat16 --modes baseline,overlap --micro-batches 4 \
    --checksums on --steps 3 --model n_layers=16,d_model=1024,n_heads=16,d_ff=2816 --scratch "$nvme/bench2" \
    --out "$out/stage3-nvme-train-2.md"
fi
finish
