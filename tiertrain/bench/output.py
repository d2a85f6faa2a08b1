"""Where benchmarks write their reports: checked (and the directory made) before any work,
so that a bad ``--out`` costs a second, not the benchmark's minutes and its results."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import UsageError
from ..paths import prepare_output_file

__all__ = ["SCRATCH_HELP", "checked_out", "compute_line", "publish", "scratch_dir"]

SCRATCH_HELP = "folder to work in (default: here); the benchmark uses a fresh folder of its own inside it"


def checked_out(path: str, what: str = "--out") -> str:
    """``path``, absolute, with its directory made and writable; else exit with one line."""
    try:
        return prepare_output_file(what, path)
    except UsageError as exc:
        raise SystemExit(f"{sys.argv[0]}: {exc}") from None


def publish(report: str, out: str | None) -> None:
    """Print ``report`` and, with ``out`` (already ``checked_out``), write it there."""
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)


@contextmanager
def scratch_dir(parent: str | None, name: str) -> Iterator[str]:
    """A fresh folder of the benchmark's own inside ``parent`` (made if missing; default: the
    current directory), removed with everything in it at the end, on error too.

    ``parent`` itself and whatever else it holds are never touched: ``--scratch`` names where the
    benchmark may write, and a user may point it at a folder with their own work in it (an earlier
    version removed the folder given, and with it a checkout)."""
    parent = os.path.abspath(parent or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f"tiertrain-{name}-", dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def compute_line(device: str, dtype: str = "auto") -> str:
    """Where a benchmark's runs computed, for its report: ``train.device`` and
    ``train.param_dtype`` as the config resolves them ("float32 on CPU", "bfloat16 parameters
    (fp32 master and moments) on NVIDIA H100 80GB HBM3")."""
    from ..device import resolve_device, resolve_dtype

    dev = resolve_device(device)
    name = str(resolve_dtype(dtype, dev)).removeprefix("torch.")
    if dev.type == "cuda":
        import torch

        return f"{name} parameters (fp32 master and moments) on {torch.cuda.get_device_name(dev)}"
    return f"{name} on CPU"
