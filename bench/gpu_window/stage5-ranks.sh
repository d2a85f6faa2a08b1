#!/usr/bin/env bash
# GPU window, stage 5 of 9: ranks on the GPU (each rank a process on the one GPU, the collectives
# on host memory over Gloo).
#   1. the GPU test: 2 ranks on CUDA train the 2-rank CPU run's model (tests/test_gpu.py -k ranks)
#   2. tiertrain train --nproc 2 on CUDA, states on the NVMe, 5 steps
#   3. resumed: 3 steps, then --resume to 6; the same last loss as 6 steps straight
#
#   bench/gpu_window/stage5-ranks.sh --out DIR [--dry] [--nvme DIR]     (see lib.sh)
STAGE=stage5-ranks
source "$(dirname "$0")/lib.sh" "$@"

device=cuda
small=()
if [ "$dry" = 1 ]; then
  device=cpu
  small=(--model.kind=gpt --model.n_layers=2 --model.d_model=64)
fi
step "GPU test: 2 ranks on CUDA against 2 ranks on CPU" 0 180 \
  "$PY" -m pytest -q -rs --tb=short -p no:cacheprovider -m gpu tests/test_gpu.py -k ranks --basetemp="$nvme/pytest-ranks"
flags=(--train.device=$device --data.micro_batches=2 --train.progress=false --memory.host_param_mib=0
       --memory.optim_host_mib=0 "${small[@]}")
# (a dry run leaves this one out: the next step runs tiertrain train --nproc 2 three times)
step "tiertrain train --nproc 2 on $device, states on the drive, 5 steps" 1 120 \
  "${TT[@]}" train --nproc 2 "${flags[@]}" --train.steps=5 --io.paths="$nvme/ranks" \
  --train.run_dir="$nvme/ranks-run" --train.overwrite=true
step "2 ranks on $device: 3 steps, resumed to 6, against 6 straight" 0 220 \
  "$PY" bench/gpu_window/ranks_resume.py --scratch "$nvme/resume" --nproc 2 "${flags[@]}"
finish
