#!/usr/bin/env bash
# GPU window, stage 1 of 9: does tiertrain train on CUDA, and is it exact? At most 9 minutes;
# worth running alone if the window ends after one command.
#   1. the machine: Python, PyTorch, CUDA, the device, the packages, kvikio's mode, the scratch drive
#   2. the default job (built-in GPT, bundled corpus, the one memory budget) on CUDA, 10 steps
#   3. the GPU tests (tests/test_gpu.py but ranks, which are stage 5): CUDA against the same run on
#      CPU in fp32 (GPT, Llama), the bf16 update paths against each other, host syncs and device
#      memory per step
#   4. the parity suite's fp32 core on this machine's PyTorch, on CPU (bit-identical to plain PyTorch)
#
#   bench/gpu_window/stage1-cuda.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage1-cuda
source "$(dirname "$0")/lib.sh" "$@"

step "the machine" 0 60 "$PY" bench/gpu_window/env_report.py --nvme "$nvme"
if [ "$dry" = 1 ]; then
  step "the default job on CPU, 2 layers, 3 steps (dry run)" 0 120 "${TT[@]}" train --train.device=cpu \
    --train.steps=3 --model.n_layers=2 --io.paths="$nvme/default" --train.run_dir="$nvme/default-run" \
    --train.overwrite=true --train.progress=false
else
  step "the default job on CUDA, 10 steps" 1 120 "${TT[@]}" train --train.device=cuda --train.steps=10 \
    --io.paths="$nvme/default" --train.run_dir="$nvme/default-run" --train.overwrite=true --train.progress=false
fi
step "GPU tests (tests/test_gpu.py, ranks in stage 5)" 0 240 \
  "$PY" -m pytest -q -rs --tb=short -p no:cacheprovider -m gpu tests/test_gpu.py -k "not ranks" --basetemp="$nvme/pytest-gpu"
which=fp32_bit_identical
[ "$dry" = 1 ] && which="test_fp32_bit_identical and 1-gpt"  # a dry run checks the step, on one case
step "fp32 parity with plain PyTorch on this PyTorch, CPU (tests/test_parity.py -k '$which')" 0 110 \
  "$PY" -m pytest -q --tb=short -p no:cacheprovider tests/test_parity.py -k "$which" --basetemp="$nvme/pytest-parity"
finish
