#!/usr/bin/env bash
# GPU window, stage 2 of 9: the default model under PyTorch's CUDA sanitizer (races between the
# compute, upload and download streams), and device memory and host syncs over 20 steps.
# (The sanitizer follows the main thread's kernels and copies; the I/O threads' staged copies and
# device CRCs are outside what it checks.)
#   1. parameters streamed from the storage tier, hidden states spilled: every copy path
#   2. parameters in host memory (uploaded from pinned memory, no file)
#   3. every block recomputed in the backward
#   4. device memory per step (flat after the first steps) and host synchronisations per step
#      (the device's count and PyTorch's set_sync_debug_mode("warn")), a Llama of 8 layers
#
#   bench/gpu_window/stage2-sanitizer.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage2-sanitizer
source "$(dirname "$0")/lib.sh" "$@"

san() {  # san NAME FLAGS...: the default model, 5 steps on CUDA under the sanitizer
  local name=$1; shift
  step "CUDA sanitizer: $name" 1 120 env TORCH_CUDA_SANITIZER=1 "${TT[@]}" train --train.device=cuda \
    --train.steps=5 --train.progress=false --train.predict=false --checkpoint.at_end=false \
    --train.overwrite=true --io.paths="$nvme/san" \
    --train.run_dir="$nvme/san-run" "$@"
  rm -rf "$nvme/san" "$nvme/san-run"
}
san "parameters streamed from the tier, hidden states spilled" --memory.host_param_mib=0 --memory.stash_host_mib=0
san "parameters in host memory" --memory.host_param_mib=64
san "every block recomputed" --memory.activations=recompute
if [ "$dry" = 1 ]; then
  step "device memory and host syncs per step, CPU, 2 layers, 3 steps (dry run)" 0 120 \
    "$PY" bench/gpu_window/steps_check.py --scratch "$nvme/steps" --device cpu --steps 3 --set model.n_layers=2
else
  step "device memory and host syncs over 20 steps" 1 150 \
    "$PY" bench/gpu_window/steps_check.py --scratch "$nvme/steps" --device cuda --steps 20
fi
finish
