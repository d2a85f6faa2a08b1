# Sourced by every stage of the GPU window (bench/gpu_window/stageN-<name>.sh).
#
# A stage is one command of at most 9 minutes on a bare GPU machine: the machine's own python3
# (with its torch), the project from this checkout (PYTHONPATH), no .venv, no network. What the
# machine lacks travels as wheels in .whl/ (made by bench/gpu_window/wheels.sh where there is a
# network, carried along, git-ignored): they are installed into a private folder first.
#
#   bench/gpu_window/stageN-<name>.sh --out DIR [--dry] [--nvme DIR] [--budget SECONDS]
#
#   --out DIR     where the stage writes its results file, stageN-<name>.md (and any others)
#   --dry         on a machine without a GPU: run what needs no CUDA (on CPU, small shapes) and
#                 say, step by step, what was skipped
#   --nvme DIR    scratch on the drive to measure (default $TIERTRAIN_NVME, or tiertrain-scratch/gpu-window
#                 in the checkout; the results file names its filesystem)
#   --budget S    the stage's time in seconds (default 540: 9 minutes); no step runs past it, and a step
#                 left out for lack of time fails the stage
#
# Environment: PYTHON (default python3), TIERTRAIN_WHEELS (default <checkout>/.whl),
# TIERTRAIN_SITE (where the wheels go; default /tmp/tiertrain-site).

set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# cuBLAS's deterministic workspace (set before CUDA starts): runs compared bit for bit (the GDS
# check) then differ only where the compared thing does
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}

STAGE_T0=$(date +%s)
dry=0
out=""
default_nvme=$ROOT/tiertrain-scratch/gpu-window  # the checkout's drive, not /tmp (a tmpfs there?)
nvme=${TIERTRAIN_NVME:-$default_nvme}
budget=540
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) dry=1 ;;
    --out) out=${2:-}; shift ;;
    --nvme) nvme=${2:-}; shift ;;
    --budget) budget=${2:-}; shift ;;
    *) echo "$STAGE: unknown argument $1 (use --out DIR, --dry, --nvme DIR, --budget SECONDS)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$out" ]; then
  echo "$STAGE: --out DIR is required (where the results file goes)" >&2
  exit 2
fi
mkdir -p "$out" "$nvme" || exit 2
out=$(cd "$out" && pwd)  # relative to where the stage was started, before the cd below
nvme=$(cd "$nvme" && pwd)/$STAGE
cd "$ROOT" || exit 2
rm -rf "$nvme" && mkdir -p "$nvme" || exit 2
results="$out/$STAGE.md"
: > "$results" || exit 2
fails=0
unrun=0
nstep=0
# the stage's scratch goes; the default folders too where they are left empty
trap 'rm -rf "$nvme"; [ "$(dirname "$nvme")" = "$default_nvme" ] && rmdir "$default_nvme" "$ROOT/tiertrain-scratch" 2> /dev/null' EXIT

say() { printf '%s\n' "$*" | tee -a "$results"; }
left() { echo $((budget - ($(date +%s) - STAGE_T0))); }

# The wheels carried along, installed where this stage's python finds them (after the checkout,
# so that tiertrain itself comes from the tree).
wheels=${TIERTRAIN_WHEELS:-$ROOT/.whl}
site=${TIERTRAIN_SITE:-/tmp/tiertrain-site}
carried="none"
if compgen -G "$wheels/*.whl" > /dev/null; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$wheels"/*.whl > "$out/.pip.log" 2>&1; then
    say "# $STAGE: the wheels in $wheels did not install"
    sed -n '1,40p' "$out/.pip.log" | tee -a "$results"
    exit 3
  fi
  carried=$(cd "$wheels" && ls -- *.whl | sed 's/-.*//' | sort -u | tr '\n' ' ')
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
rm -f "$out/.pip.log"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

say "# GPU window, $STAGE, $(date -u '+%Y-%m-%d %H:%M UTC')$([ "$dry" = 1 ] && echo ' (dry run, no GPU)')"
say ""
say "- python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1)"
say "- wheels carried: $carried"

# What tiertrain needs to import; a missing one stops the stage here, named, with the way to carry
# it. One interpreter start for this and the device's name (each start imports torch: seconds).
probe=$("$PY" - <<'EOF'
import importlib
miss = []
for n in ["torch", "numpy", "crc32c", "safetensors", "transformers", "tqdm", "psutil"]:
    try:
        importlib.import_module(n)
    except Exception:  # noqa: BLE001 - missing or broken: either way not usable
        miss.append(n)
if miss:
    print("missing", " ".join(miss))
else:
    import torch
    print("cuda" if torch.cuda.is_available() else "cpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
EOF
)
probe=$(printf '%s\n' "$probe" | tail -n 1)  # what an import printed is not the answer
case "$probe" in
  missing*)
    say "- **missing here: ${probe#missing }**. Make the wheels where there is a network (bench/gpu_window/wheels.sh,"
    say "  which writes .whl/) and carry .whl along with the checkout; each stage installs them first."
    exit 3 ;;
  cpu*)
    if [ "$dry" = 0 ]; then
      say "- no CUDA device here: run with --dry to check the stage itself"
      exit 2
    fi ;;
  cuda*) ;;
  *) say "- $PY could not be probed: $probe"; exit 3 ;;
esac
DEVICE=${probe#* }
say "- device: $DEVICE"
say "- scratch: $nvme ($(findmnt -no SOURCE,FSTYPE -T "$nvme" 2> /dev/null || echo 'filesystem unknown'))"
say ""

# step NAME CUDA_ONLY(0/1) LIMIT_S command...: run it within its limit and what is left of the
# stage's budget, and keep the tail of its output in the results file; a failing step's whole
# output is kept beside it ($STAGE-stepN.log: on a first run the traceback is the result).
step() {
  local name=$1 cuda=$2 limit=$3; shift 3
  nstep=$((nstep + 1))
  if [ "$dry" = 1 ] && [ "$cuda" = 1 ]; then
    say "- **$name**: skipped (dry run: needs CUDA)"
    return
  fi
  local l; l=$(($(left) - 5))
  [ "$limit" -gt "$l" ] && limit=$l
  if [ "$limit" -le 10 ]; then
    say "- **$name**: NOT RUN (the stage's $budget s are spent)"
    unrun=$((unrun + 1))
    return
  fi
  local t0 rc log="$out/$STAGE-step$nstep.log"
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  say "- **$name**: exit $rc in $(($(date +%s) - t0)) s$([ "$rc" = 124 ] && echo " (hit its ${limit} s limit)")"
  { echo; echo '```'; tail -n 40 "$log"; echo '```'; echo; } >> "$results"
  if [ "$rc" = 0 ]; then
    rm -f "$log"
  else
    fails=$((fails + 1))
    say "  (its whole output: $log)"
  fi
}

# skip NAME WHY: a step this machine cannot run, and why.
skip() { say "- **$1**: skipped ($2)"; }

finish() {
  say ""
  say "$fails step(s) failed, $unrun not run for lack of time; $(($(date +%s) - STAGE_T0)) s of $budget s;" \
      "results in $results"
  [ "$fails" = 0 ] && [ "$unrun" = 0 ]
  exit $?
}

# deepspeed_ready: DeepSpeed importable here, set up to build its ops on first use (stages 4 and
# 8); else false with the reason in $DS_WHY. libaio (its NVMe path compiles against it) travels as
# .deb, unpacked into a private prefix, never into / (the image's own packages stay as they are).
deepspeed_ready() {
  if compgen -G "$wheels/libaio*.deb" > /dev/null; then
    local aio=/tmp/tiertrain-aio d lib
    for d in "$wheels"/libaio*.deb; do dpkg-deb -x "$d" "$aio" || say "- could not unpack $d"; done
    lib=$aio/usr/lib/x86_64-linux-gnu
    [ -e "$lib/libaio.so" ] || ln -sf libaio.so.1 "$lib/libaio.so"
    export CPATH="$aio/usr/include${CPATH:+:$CPATH}" LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "- libaio: carried, unpacked into $aio"
  fi
  export MAX_JOBS=${MAX_JOBS:-16}  # the ops' first build
  if ! DS_WHY=$("$PY" -c "import deepspeed" 2>&1); then
    DS_WHY="DeepSpeed is not importable here: $(printf '%s' "$DS_WHY" | tail -n 1)"
    return 1
  fi
  # DeepSpeed 0.19.8 parses each TORCH_CUDA_ARCH_LIST entry as numbers and stops at the image's
  # "9.0a" (seen on an H200): give it the device's capability as plain numbers
  local cap
  case "${TORCH_CUDA_ARCH_LIST:-}" in
    *[a-z]*|"") cap=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2> /dev/null) &&
                export TORCH_CUDA_ARCH_LIST=$cap ;;
  esac
  return 0
}

TT=("$PY" -m tiertrain)
