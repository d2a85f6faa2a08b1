"""GPUDirect Storage through kvikio: reads and writes between files and device memory.

kvikio is optional: machines without a GPU never import it. ``TIERTRAIN_GDS=off`` (or
``set_mode("off")``) forces the host path, e.g. to compare the two; the trainer's own
switch is ``io.gds`` (whether its stores hand device memory to the files at all).

``FileHandle`` sends a device tensor here when ``enabled()``; checksummed files keep their
CRC32C, computed on the device (``devcrc``), for requests that cover whole checksum blocks
(the others go through pinned host staging, where the host computes it).

Ordering rule: the direct path is not stream-ordered. A tensor handed to a write must be
complete (its producer synchronised); a tensor a read fills must be unused by queued
kernels until the read's future is done (the caller waits for its last use first).

Tests swap the backend (``set_backend``) for one that emulates kvikio on CPU tensors, so
the direct path's logic (block checks, striping, ordering) runs without a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

__all__ = ["enabled", "set_mode", "set_backend", "is_device", "open_file", "kvikio_package"]

_mode = os.environ.get("TIERTRAIN_GDS", "auto")
_backend: Callable[[str, bool], Any] | None = None  # None: kvikio.CuFile
_device_types: tuple[str, ...] = ("cuda",)


def kvikio_package(cuda: str | None = None) -> str:
    """The kvikio wheel for this PyTorch's CUDA (``torch.version.cuda``, or ``cuda``): its
    packages are built per CUDA major version (``kvikio-cu12``, ``kvikio-cu13``)."""
    cuda = torch.version.cuda if cuda is None else cuda
    major = cuda.split(".")[0] if cuda else "13"
    return f"kvikio-cu{major}"


def set_mode(mode: str) -> None:
    """``"auto"`` (use kvikio when importable and CUDA is present), ``"on"``, or ``"off"``."""
    global _mode
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"gds mode must be 'auto', 'on' or 'off', got {mode!r}")
    _mode = mode
    _available.cache_clear()


def set_backend(open_fn: Callable[[str, bool], Any] | None, device_types: tuple[str, ...] = ("cuda",)) -> None:
    """Use ``open_fn(path, writable)`` instead of ``kvikio.CuFile`` for tensors on
    ``device_types`` (tests); ``None`` restores kvikio. The object it returns must have
    kvikio's ``pread(buf, size, file_offset)`` / ``pwrite(...)`` (futures with ``get()``)
    and ``close()``."""
    global _backend, _device_types
    _backend, _device_types = open_fn, device_types
    _available.cache_clear()


@functools.lru_cache(maxsize=1)
def _available() -> bool:
    if _backend is not None:
        return True
    if not torch.cuda.is_available():
        return False
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    """Whether device tensors go straight to and from files."""
    if _mode == "off":
        return False
    ok = _available()
    if _mode == "on" and not ok:
        raise RuntimeError(
            f"gds='on' but kvikio is not importable or no CUDA device is present; pip install {kvikio_package()}"
        )
    return ok


def is_device(buf: Any) -> bool:
    """Whether ``buf`` is a tensor in device memory (the direct path's kind of buffer)."""
    return isinstance(buf, torch.Tensor) and buf.device.type in _device_types


def open_file(path: str, writable: bool) -> Any:
    if _backend is not None:
        return _backend(path, writable)
    import kvikio

    return kvikio.CuFile(path, "r+" if writable else "r")
