"""The C library's allocator, told to give large freed blocks back to the system.

glibc serves allocations above ``M_MMAP_THRESHOLD`` with their own mappings (returned to
the system on free) and the rest from its heaps (kept for reuse). By default the threshold
moves up to the largest block freed so far, so after the first step the activations of a
block (megabytes each) come from the heaps, where freed space is fragmented and stays in the
process: measured here (6-layer d=256 model, 1024 tokens, 5 steps), peak RSS grew to 253 MiB
recomputing and 360 MiB offloading, against 105 and 188 MiB with the threshold fixed at
1 MiB. Setting it (``mallopt``, process-wide, ``memory.mmap_threshold_kib``) fixes that, at a
price: every large tensor is then mapped and faulted in afresh, and steps of a 4-layer
d=768 Llama at 1024 tokens took 15-25% longer (7.2 -> 9.0 s kept, 8.9 -> 10.3 s recomputed).
The default leaves the library's behaviour (speed); runs that must stay within their budget
set it.

``trim_heap`` is the cheaper remedy, and the default (``memory.trim_heap``): ``malloc_trim``
after a unit step gives each heap's free pages back (every thread's arena), so what a unit
step freed does not stay in the process through the next one, whatever the tensors' sizes.
``HeapTrim`` does it only where the process has grown near its budget: past it less the
working set a training step's unit step holds (the pages given back are faulted in again by
the next unit step: a cost where the budget has room). That room is the steps' own, not
initialisation's: a LoRA step holds no unit beyond its slots, and trimming as if it held the
two units initialisation does trimmed after all 66 unit steps of the 2.46 B Llama's step at a
fifth of peft's RSS (5 with the steps' room); the faults cost 11-18% of its step (alternated
A/B). Within a unit step the M micro-batches repeat one pattern of allocations, which the
heap serves again from what it freed. Measured (4 blocks d=2048, M = 32 x 64 tokens, budget
2300 MiB): peak RSS 2078 -> 1886-1969 MiB recomputing and 2234 -> 1940-2029 MiB offloading,
for about 10 ms per trim (0.1 s of a 40 s step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import resource

import psutil

__all__ = ["fix_mmap_threshold", "trim_heap", "HeapTrim", "host_rss", "host_peak_rss", "reset_peak_rss"]

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
log = logging.getLogger("tiertrain")
_done: int | None = None
_libc = None


def _c_library():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _libc = False
    return _libc


def fix_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (once per process); False where the C library
    has no ``mallopt`` (musl, macOS) or refuses the value."""
    global _done
    if nbytes <= 0 or _done == nbytes:
        return _done == nbytes
    try:
        ok = bool(_c_library().mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
    except AttributeError:
        ok = False
    if ok:
        _done = nbytes
    else:
        log.info("memory.mmap_threshold_kib: this C library has no mallopt; large blocks are kept as it decides")
    return ok


def trim_heap() -> bool:
    """Give the free pages of every heap back to the system (glibc ``malloc_trim(0)``); False
    where the C library has none (musl, macOS), where nothing is done."""
    trim = getattr(_c_library(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


class HeapTrim:
    """``trim_heap`` after a unit step, where the process has grown near its budget: its
    resident set above ``limit`` bytes (read from /proc/self/statm: microseconds); ``limit``
    None: after every unit step. Trimming after every one gives back pages the next one faults
    in again: 20-40% of the step of a 0.2 B model in memory (25 units, 2 x 64 tokens) here.
    With ``limit`` the budget less the working set it reserves, the heap keeps what a unit step
    freed while there is room, and gives it back before the next step could pass the budget."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.trims = limit, 0
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return host_rss()

    def __call__(self) -> None:
        if self.limit is None or self._rss() > self.limit:
            trim_heap()
            self.trims += 1


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
