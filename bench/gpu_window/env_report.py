"""What the GPU window runs on: Python, PyTorch, CUDA, the device, the packages tiertrain uses
(and where tiertrain itself was imported from), kvikio's mode, the scratch drive.

    python3 bench/gpu_window/env_report.py [--nvme DIR]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import subprocess


def version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - missing or broken: say which
        return f"not usable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return str(getattr(mod, "__version__", "present"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme", default=".")
    args = ap.parse_args()
    import torch

    print(
        f"python {platform.python_version()} | torch {torch.__version__} | CUDA {torch.version.cuda} "
        f"| cuDNN {torch.backends.cudnn.version() if torch.cuda.is_available() else '-'}"
    )
    print(
        f"{os.cpu_count()} CPU cores | {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM "
        f"| {platform.system()} {platform.release()}"
    )
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(
            f"device {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}, "
            f"{p.multi_processor_count} SMs; {torch.cuda.device_count()} visible"
        )
        smi = shutil.which("nvidia-smi")
        if smi:
            print(subprocess.run([smi], capture_output=True, text=True).stdout)
    else:
        print("no CUDA device")
    for name in (
        "numpy",
        "crc32c",
        "safetensors",
        "transformers",
        "accelerate",
        "tqdm",
        "psutil",
        "peft",
        "deepspeed",
        "kvikio",
    ):
        print(f"{name}: {version(name)}")
    try:
        import kvikio.defaults

        d = kvikio.defaults  # 24.x has compat_mode(); 25.x on get("compat_mode") and the preference
        mode = d.get("compat_mode") if hasattr(d, "get") else d.compat_mode()
        preferred = d.is_compat_mode_preferred() if hasattr(d, "is_compat_mode_preferred") else "?"
        print(f"kvikio compatibility mode: {mode} (preferred: {preferred}; True means POSIX reads, no GDS)")
    except Exception as exc:  # noqa: BLE001
        print("kvikio compatibility mode: -", type(exc).__name__)
    import tiertrain

    print("tiertrain from", os.path.dirname(tiertrain.__file__))
    du = shutil.disk_usage(args.nvme)
    print(f"scratch {os.path.abspath(args.nvme)}: {du.free / 2**30:.1f} GiB free of {du.total / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
