#!/usr/bin/env bash
# GPU window, stage 13: where a compute-bound step's time goes (issue 52), for what stage 12 cannot
# say. On the first GPU run of stage 12 (2026-11-29) tiertrain's forward took 1.2 s of compute
# and its backward 1.3 s at the Qwen2.5-3B shape's 16,384 tokens a step, where plain PyTorch's
# whole step took 1.5 s: bench/profile_step.py prints the host's AdamW and copy rates, the step
# lines, and one step under torch's profiler (operators by their own device time and CPU time),
# with the optimizer's states on the device (planned) and then on the host.
#
#   bench/gpu_window/stage13-profile.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage13-profile
source "$(dirname "$0")/lib.sh" "$@"

if [ "$dry" = 1 ]; then
  step "bench/profile_step.py on CPU, a Qwen2 of 2 layers of 256, 2 micro-batches (dry run)" 0 120 \
    "$PY" bench/profile_step.py --device cpu --shape qwen2:2x256 --seq-len 64 --micro-batches 2 --steps 2 \
    --rows 10 --host-elements 1000000 --set memory.optim_device_mib=none --scratch "$nvme" \
    --log "$out/stage13-profile-device.log"
else
  step "Qwen2.5-3B shape, seq 2048, 8 micro-batches, bf16 on CUDA, the optimizer's states on the device (planned): one profiled step" \
    1 240 "$PY" bench/profile_step.py --device cuda --shape qwen2.5-3b --seq-len 2048 --micro-batches 8 --steps 3 \
    --set memory.optim_device_mib=none --scratch "$nvme" --log "$out/stage13-profile-device.log"
  step "the same with the states on the host (the update in place): one profiled step" \
    1 240 "$PY" bench/profile_step.py --device cuda --shape qwen2.5-3b --seq-len 2048 --micro-batches 8 --steps 3 \
    --host-elements 0 --scratch "$nvme" --log "$out/stage13-profile-host.log"
fi
finish
