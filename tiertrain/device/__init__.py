"""The compute device: where units compute and how data crosses to them (``core.py``: the CPU
and CUDA behind one interface), devices for tests that behave like a GPU on CPU
(``simulated.py``, ``lag.py``), and the host's own memory figures and heap (``host.py``)."""

from __future__ import annotations

from .core import CudaDevice, Device, cpu_has_fast_bf16, make_device, resolve_device, resolve_dtype
from .host import fix_mmap_threshold, host_peak_rss, host_rss, reset_peak_rss, trim_heap
from .lag import LagCpuDevice
from .simulated import AsyncCpuDevice, poison

__all__ = [
    "Device",
    "CudaDevice",
    "AsyncCpuDevice",
    "LagCpuDevice",
    "make_device",
    "resolve_device",
    "resolve_dtype",
    "cpu_has_fast_bf16",
    "host_rss",
    "host_peak_rss",
    "reset_peak_rss",
    "fix_mmap_threshold",
    "trim_heap",
    "poison",
]
