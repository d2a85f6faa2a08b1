#!/usr/bin/env bash
# The wheels a bare GPU machine lacks for the GPU window, downloaded here (where there is a
# network) into .whl/ (git-ignored), to be carried along with the checkout. Each stage installs
# what it finds there into a private folder before it starts (lib.sh).
#
# The GPU image (Python 3.12, x86_64, torch 2.11 with CUDA 13, transformers, safetensors, tqdm,
# psutil, numpy, cupy) lacks:
#   crc32c                       tiertrain's checksums (required)
#   kvikio-cu13, libkvikio-cu13,
#   rapids-logger                GPUDirect Storage (stage 6; the stage is skipped without them)
# and, with --qlora (stage 11; skipped without it):
#   bitsandbytes                 QLoRA's 4-bit formats and CUDA kernels (43 MB)
# and, with --deepspeed (stage 4; skipped without them):
#   deepspeed                    published as source only: built here into a pure-Python wheel,
#                                its ops left to build on first use there (the image has nvcc and
#                                ninja); needs torch here to build (PYTHON with torch)
#   hjson, pydantic(-core), annotated-types, typing-inspection
#                                its requirements the image lacks
#   libaio1, libaio-dev (.deb)   its NVMe path compiles against libaio; stage 4 unpacks them into a
#                                private prefix (apt-get download, Debian's x86_64 packages)
#
#   bench/gpu_window/wheels.sh [--dest DIR] [--python-version 3.12] [--cuda 13] [--deepspeed] [--qlora]
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl
pyver=3.12
cuda=13
deepspeed=0
qlora=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) dest=$2; shift ;;
    --python-version) pyver=$2; shift ;;
    --cuda) cuda=$2; shift ;;
    --deepspeed) deepspeed=1 ;;
    --qlora) qlora=1 ;;
    *) echo "wheels.sh: unknown argument $1 (use --dest DIR, --python-version X.Y, --cuda N, --deepspeed, --qlora)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# pinned: one version of each (two of one package stop the install there)
wanted=(crc32c==2.9.post0 "kvikio-cu$cuda==26.10.0" "libkvikio-cu$cuda==26.10.0" rapids-logger==0.3.0)
[ "$deepspeed" = 1 ] && wanted+=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
                                   typing-inspection==0.4.5)
[ "$qlora" = 1 ] && wanted+=(bitsandbytes==0.50.2)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d "$dest" "${wanted[@]}"
if [ "$deepspeed" = 1 ]; then
  build=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$build" deepspeed==0.19.8
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$build"/deepspeed-*.tar.gz
  rm -rf "$build"
  (cd "$dest" && apt-get download libaio1 libaio-dev)
fi
# with --no-deps nothing checked that the carried wheels agree: each one's requirements on another
# carried one must be met (a libkvikio built for another rapids-logger fails only at import there)
"$PY" - "$dest" <<'EOF'
import re, sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = {}
for w in Path(sys.argv[1]).glob("*.whl"):
    name, version = w.name.split("-")[:2]
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    wheels[norm(name)] = (version, [Requirement(l.split(":", 1)[1].strip()) for l in meta.splitlines()
                                    if l.startswith("Requires-Dist:")])
bad = []
for name, (_, reqs) in wheels.items():
    for r in reqs:
        if r.marker is not None and "extra" in str(r.marker):
            continue
        have = wheels.get(norm(r.name))
        if have is not None and not r.specifier.contains(have[0], prereleases=True):
            bad.append(f"{name} needs {r}, but {r.name} {have[0]} is carried")
if bad:
    sys.exit("wheels.sh: the carried wheels disagree: " + "; ".join(bad))
print("the carried wheels agree with each other")
EOF
echo "wheels in $dest ($(du -sh "$dest" | cut -f1)):"
ls -1 "$dest"
