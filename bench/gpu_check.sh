#!/usr/bin/env bash
# Everything a lent GPU window must check, in one command of at most 25 minutes, into one
# results file:
#   1. the device, torch and CUDA versions, kvikio's version and compatibility mode
#   2. the GPU tests (pytest -m gpu: CUDA vs CPU parity in fp32, bf16 update paths, syncs and
#      device memory per step)
#   3. the default model trained on CUDA under PyTorch's CUDA sanitizer, with host-resident
#      parameters, and with every block recomputed
#   4. device memory over 20 steps
#   5. host synchronisations per step, counted by torch.cuda.set_sync_debug_mode("warn")
#   6. a Llama step with every state on the NVMe: baseline and engines, bf16, checksums on
#      and off, against plain PyTorch in device memory (bench/train.py)
#   7. GPUDirect Storage: the default model with --io.gds=on (parameters read from the NVMe
#      straight into GPU memory through kvikio, checksums verified on the GPU)
#   8. tiertrain vs DeepSpeed ZeRO-Infinity on the GPU in bf16 (bench/vs_deepspeed.py; needs
#      DeepSpeed installed on the machine)
#   9. the storage tier against fio on the NVMe (tiertrain bench io)
#  10. 2 ranks on CUDA (tiertrain train --nproc 2; the GPU tests hold them to the CPU run)
#
#   bench/gpu_check.sh [--nvme DIR] [--out FILE] [--dry]
#
# --dry (a machine without a GPU): runs what does not need CUDA (the GPU tests, which skip;
# a short CPU run; a small I/O benchmark) and says, step by step, what it skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TT=${TIERTRAIN:-.venv/bin/tiertrain}
dry=0
nvme=./tiertrain-scratch/gpu-check
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) dry=1 ;;
    --nvme) nvme=$2; shift ;;
    --out) out=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --nvme DIR, --out FILE, --dry)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$dry" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check.sh: no CUDA device here; run with --dry to check the script itself" >&2
  exit 2
fi
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
out=${out:-bench/results/gpu-check-$device.md}
mkdir -p "$(dirname "$out")" "$nvme" || exit 2
: > "$out" || exit 2
start=$(date +%s)
budget=$((25 * 60))
fails=0

say() { printf '%s\n' "$*" | tee -a "$out"; }
left() { echo $((budget - ($(date +%s) - start))); }
# run NAME CUDA_ONLY(0/1) LIMIT_S command...: run it within its limit (and the budget), keep
# the tail of its output in the results file
run() {
  local name=$1 cuda=$2 limit=$3; shift 3
  if [ "$dry" = 1 ] && [ "$cuda" = 1 ]; then
    say "- **$name**: skipped (dry run: needs CUDA)"
    return
  fi
  local l; l=$(left)
  [ "$limit" -gt "$l" ] && limit=$l
  if [ "$limit" -le 10 ]; then
    say "- **$name**: skipped (the 25-minute budget is spent)"
    return
  fi
  local t0 rc; t0=$(date +%s)
  timeout "$limit" "$@" > /tmp/gpu_check.$$ 2>&1
  rc=$?
  [ "$rc" = 0 ] || fails=$((fails + 1))
  say "- **$name**: exit $rc in $(($(date +%s) - t0)) s$([ "$rc" = 124 ] && echo " (hit its ${limit} s limit)")"
  { echo; echo '```'; tail -n 40 /tmp/gpu_check.$$; echo '```'; echo; } >> "$out"
  rm -f /tmp/gpu_check.$$
}

say "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')$([ "$dry" = 1 ] && echo ' (dry run, no GPU)')"
say ""
run "environment" 0 60 "$PY" - <<'EOF'
import platform, subprocess, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", "capability", f"{p.major}.{p.minor}")
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
else:
    print("no CUDA device")
try:
    import kvikio, kvikio.defaults
    print("kvikio", kvikio.__version__, "compat mode", kvikio.defaults.compat_mode())
except Exception as exc:  # noqa: BLE001
    print("kvikio: not usable here:", type(exc).__name__, exc)
EOF
run "GPU tests (pytest -m gpu)" 0 600 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider
run "default model under the CUDA sanitizer, host-resident parameters" 1 240 \
  env TORCH_CUDA_SANITIZER=1 "$TT" train --train.device=cuda --train.steps=5 --memory.host_param_mib=64 \
  --io.paths="$nvme/san1" --train.run_dir="$nvme/san1-run" --train.overwrite=true
run "default model under the CUDA sanitizer, every block recomputed" 1 240 \
  env TORCH_CUDA_SANITIZER=1 "$TT" train --train.device=cuda --train.steps=5 --memory.activations=recompute \
  --io.paths="$nvme/san2" --train.run_dir="$nvme/san2-run" --train.overwrite=true
run "device memory over 20 steps" 1 300 "$PY" - "$nvme" <<'EOF'
import json, os, subprocess, sys
nvme = sys.argv[1]
run = os.path.join(nvme, "mem-run")
subprocess.run([sys.executable, "-m", "tiertrain.cli", "train", "--train.device=cuda", "--train.steps=20",
                f"--io.paths={nvme}/mem", f"--train.run_dir={run}", "--train.overwrite=true",
                "--train.progress=false"], check=True)
peaks = [json.loads(l)["peak_device_bytes"] / 2**20 for l in open(os.path.join(run, "metrics.jsonl"))]
print("peak device MiB per step:", " ".join(f"{p:.0f}" for p in peaks))
print("steps 2..20 within", f"{max(peaks[1:]) - min(peaks[1:]):.1f} MiB")
sys.exit(0 if max(peaks[2:]) <= peaks[1] * 1.05 + 8 else 1)
EOF
run "host synchronisations per step (set_sync_debug_mode warn)" 1 300 "$PY" - "$nvme" <<'EOF'
import sys, warnings, torch
from tiertrain.config import load_config
from tiertrain.train import Trainer
nvme = sys.argv[1]
cfg = load_config(None, ["--train.device=cuda", f"--io.paths={nvme}/sync", f"--train.run_dir={nvme}/sync-run",
                         "--train.overwrite=true", "--model.kind=llama", "--model.n_layers=8", "--memory.stash_host_mib=0"])
with Trainer(cfg) as tr:
    tr.initialize(progress=False)
    tr.train_step()
    for step in range(3):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            rec = tr.train_step()
            torch.cuda.set_sync_debug_mode(0)
        print(f"step {rec.step}: {len(w)} synchronising calls, {tr.dev.syncs} waited device syncs so far, "
              f"{len(tr.layout.units)} units x {cfg.data.micro_batches} micro-batches")
EOF
run "Llama step with states on the NVMe, bf16 (bench/train.py)" 1 600 \
  "$PY" bench/train.py --device cuda --dtype bfloat16 --modes baseline,engines --micro-batches 1,4 \
  --checksums on,off --steps 5 --scratch "$nvme/bench" --out "${out%.md}-train.md"
run "2 ranks on CUDA (tiertrain train --nproc 2, collectives on host memory over Gloo)" 1 300 \
  "$TT" train --nproc 2 --train.device=cuda --train.steps=5 --data.micro_batches=2 \
  --io.paths="$nvme/ranks" --train.run_dir="$nvme/ranks-run" --train.overwrite=true
run "GPUDirect Storage: default model with --io.gds=on, checksums on" 1 240 \
  "$TT" train --train.device=cuda --train.steps=5 --io.gds=on \
  --io.paths="$nvme/gds" --train.run_dir="$nvme/gds-run" --train.overwrite=true
run "tiertrain vs DeepSpeed ZeRO-Infinity, cuda, bf16 (bench/vs_deepspeed.py)" 1 600 \
  "$PY" bench/vs_deepspeed.py --device cuda --dtype bfloat16 --steps 4 --rounds 1 \
  --scratch "$nvme/vs-deepspeed" --out "${out%.md}-vs-deepspeed.md"
if [ "$dry" = 1 ]; then
  run "storage tier, small (dry run)" 0 120 "$TT" bench io --path "$nvme/io" --size-gib 0.1 --repeats 1 --no-fio
  run "default job on CPU, 3 steps (dry run)" 0 180 "$TT" train --train.device=cpu --train.steps=3 --model.n_layers=2 \
    --io.paths="$nvme/cpu" --train.run_dir="$nvme/cpu-run" --train.overwrite=true
else
  run "storage tier on the NVMe vs fio (tiertrain bench io)" 0 300 "$TT" bench io --path "$nvme/io"
fi
say ""
say "$fails step(s) failed; $(($(date +%s) - start)) s in all; results in $out"
rm -rf "$nvme"
[ "$fails" = 0 ]
