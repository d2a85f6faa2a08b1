"""Small helpers for the device side: streams, events and memory figures, CPU or CUDA."""

from __future__ import annotations

import contextlib
import logging
import resource
from typing import Iterator

import psutil
import torch

__all__ = ["Device", "resolve_device", "resolve_dtype", "cpu_has_fast_bf16", "host_rss", "host_peak_rss",
           "reset_peak_rss"]

log = logging.getLogger("tiertrain")


def resolve_device(name: str) -> torch.device:
    from ..config import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = "this PyTorch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"train.device = 'cuda' but {why}; use --train.device=cpu (or 'auto')")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX); without them
    PyTorch's bf16 matrix products on CPU run about 20x slower than fp32 (measured here)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return True  # unknown: say nothing
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matrix products on CPU are two orders of magnitude slower than fp32 here
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_fast_bf16():
        log.warning("train.param_dtype = 'bfloat16' on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16): "
                    "expect steps about 20x slower than with 'float32'")
    return dtype


def host_rss() -> int:
    return psutil.Process().memory_info().rss


def host_peak_rss() -> int:
    """Peak resident set size of this process since start or the last ``reset_peak_rss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not resettable


def reset_peak_rss() -> bool:
    """Start measuring the peak afresh (Linux: clear_refs 5). False where not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Device:
    """The compute device and, on CUDA, a side stream for copies.

    On CPU every method is a no-op or a plain copy, so callers are written once.
    Events order work between streams without blocking the host; ``sync`` marks the
    places that do block.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def event(self) -> "torch.cuda.Event | None":
        """An event recorded now on the compute stream (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @contextlib.contextmanager
    def on_copy_stream(self, after: "torch.cuda.Event | None" = None) -> Iterator[None]:
        """Run the body on the copy stream, after ``after`` (an event of the compute stream)."""
        if not self.cuda:
            yield
            return
        if after is not None:
            self.copy_stream.wait_event(after)
        with torch.cuda.stream(self.copy_stream):
            yield

    def copy_event(self) -> "torch.cuda.Event | None":
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.copy_stream)
        return ev

    def wait(self, ev: "torch.cuda.Event | None") -> None:
        """Make the compute stream wait for ``ev`` (no host block)."""
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    @staticmethod
    def sync(ev: "torch.cuda.Event | None") -> None:
        """Block the host until ``ev`` has happened. A sync point."""
        if ev is not None:
            ev.synchronize()

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.cuda:
            return torch.empty(numel, dtype=dtype, device=self.device)
        from ..io import aligned_empty

        return aligned_empty(numel * dtype.itemsize).view(dtype)
