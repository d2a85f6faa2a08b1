#!/usr/bin/env bash
# The whole GPU window in one command of a given length (a lent machine may give only one): the
# stages in order of what they answer (12: where the GPU is the bound, in TFLOPS, issue 52 first;
# 13: where that step's time goes, profiled;
# 1: does it train on CUDA, exactly; 3: the NVMe figures;
# 7: the speculative update; 8: LoRA; 11: QLoRA; 9: the cost model at scale; 10: a mixture of experts; 5: ranks; 2: the sanitizer; 6: GDS; 4: DeepSpeed), each
# given what is left of the time, capped at its own 540 s. Results: DIR/stageN-<name>.md per
# stage, and DIR.tgz of everything.
#
#   bench/gpu_window/all.sh --out DIR [--seconds S] [--stages "12 13 1 3 7 8 11 9 10 5 2 6 4"] [--dry]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="" seconds=540 stages="12 13 1 3 7 8 11 9 10 5 2 6 4" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    --stages) stages=$2; shift ;;
    --dry) extra+=(--dry) ;;
    *) echo "all.sh: unknown argument $1 (use --out DIR, --seconds S, --stages LIST, --dry)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "all.sh: --out DIR is required" >&2; exit 2; }
mkdir -p "$out" || exit 2
t0=$(date +%s)
rc=0
for n in $stages; do
  script=$(ls "$here"/stage"$n"-*.sh 2> /dev/null | head -n 1)
  [ -n "$script" ] || { echo "all.sh: no stage $n" >&2; rc=2; continue; }
  left=$((seconds - ($(date +%s) - t0) - 10))
  [ "$left" -gt 540 ] && left=540
  if [ "$left" -lt 60 ]; then
    echo "== $(basename "$script"): not run ($left s left of $seconds)"
    rc=1
    continue
  fi
  echo "== $(basename "$script") with $left s"
  bash "$script" --out "$out" --budget "$left" "${extra[@]}" > /dev/null 2>&1 || rc=1
  cat "$out/$(basename "$script" .sh).md"
done
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
exit $rc
