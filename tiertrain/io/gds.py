"""GPUDirect Storage through kvikio, used for CUDA tensors when it is available.

kvikio is optional: machines without a GPU never import it. ``TIERTRAIN_GDS=off`` (or
``set_mode("off")``) forces the host path, e.g. to compare the two. Checksummed files
always use the host path, where the checksum is computed on the data as it passes.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch

from .workers import IOWorkers

if TYPE_CHECKING:
    from .future import IOFuture

__all__ = ["enabled", "set_mode", "open_file", "submit"]

_mode = os.environ.get("TIERTRAIN_GDS", "auto")


def set_mode(mode: str) -> None:
    """``"auto"`` (use kvikio when importable and CUDA is present), ``"on"``, or ``"off"``."""
    global _mode
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"gds mode must be 'auto', 'on' or 'off', got {mode!r}")
    _mode = mode
    _available.cache_clear()


@functools.lru_cache(maxsize=1)
def _available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    if _mode == "off":
        return False
    ok = _available()
    if _mode == "on" and not ok:
        raise RuntimeError("gds='on' but kvikio is not importable or no CUDA device is present; pip install kvikio-cu12")
    return ok


def open_file(path: str, writable: bool) -> Any:
    import kvikio

    return kvikio.CuFile(path, "r+" if writable else "r")


def submit(cufile: Any, workers: IOWorkers, kind: str, dev: torch.Tensor, off: int) -> "IOFuture":
    """Start a kvikio read or write of the uint8 device tensor ``dev`` at ``off``."""
    from .future import IOFuture

    op = cufile.pread if kind == "r" else cufile.pwrite
    workers.stats.begin(kind)
    fut = op(dev, dev.numel(), off)

    def wait() -> int:  # runs on an I/O thread so the caller gets an ordinary future
        n = 0
        try:
            n = fut.get()
            return n
        finally:
            workers.stats.end(kind, n)

    return IOFuture([workers.submit(wait)])

