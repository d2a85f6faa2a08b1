#!/usr/bin/env bash
# GPU window, stage 7 of 9: the speculative update (update.speculate = on) against the overlapped path
# and plain PyTorch in device memory, bf16, states beyond 1 GiB of host memory on the drive
# (bench/speculate.py). Where compute does not share the update's cores (on the 2-core VM it
# does), this is the figure #35 asks for: the speculative step within 1.15x of max(compute, I/O)
# and faster than the overlapped one.
#   1. fine-tuning (a model plain PyTorch trained 200 steps first, lr 1e-5, clip 8: the clip
#      rarely acts, the speculation holds)
#   2. the clip acting in every step (from the initialisation, clip 1e-3): what a redone step costs
#   3. (time left) fine-tuning again with the update engines too, without and with speculation
#
#   bench/gpu_window/stage7-speculate.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage7-speculate
source "$(dirname "$0")/lib.sh" "$@"

if [ "$dry" = 1 ]; then
  step "bench/speculate.py on CPU, the built-in GPT of 2 layers, fine-tuning after 3 pretraining steps (dry run)" 0 200 \
    "$PY" bench/speculate.py --device cpu --model kind=gpt,n_layers=2,d_model=64,n_heads=4,d_ff=128,vocab_size=512 \
    --micro-batches 2 --steps 2 --rounds 1 --host-mib 700 --io-mib 64 --pretrain-steps 3 --engines \
    --scratch "$nvme/spec" --out "$out/stage7-speculate-finetune.md"
else
  step "fine-tuning, Llama 134 M, bf16 on CUDA: speculative vs overlapped vs plain PyTorch (bench/speculate.py)" 1 270 \
    "$PY" bench/speculate.py --device cuda --dtype bfloat16 --workload finetune --rounds 2 \
    --scratch "$nvme/spec" --out "$out/stage7-speculate-finetune.md"
  step "the clip acting in every step (bench/speculate.py --workload clip)" 1 230 \
    "$PY" bench/speculate.py --device cuda --dtype bfloat16 --workload clip --rounds 1 \
    --scratch "$nvme/spec-clip" --out "$out/stage7-speculate-clip.md"
  step "fine-tuning with the update engines too, one round (bench/speculate.py --engines)" 1 240 \
    "$PY" bench/speculate.py --device cuda --dtype bfloat16 --workload finetune --rounds 1 --engines \
    --scratch "$nvme/spec-engines" --out "$out/stage7-speculate-engines.md"
fi
finish
