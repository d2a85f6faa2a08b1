"""Alignment rules and buffer conversion for direct I/O.

O_DIRECT on Linux needs the file offset, the length and the memory address of every
request to be multiples of the device's logical block size. We use 4 KiB everywhere
(the page size, and a multiple of every common logical block size), so a buffer that
satisfies 4 KiB works on any device.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch

__all__ = ["ALIGN", "round_up", "round_down", "is_aligned", "aligned_empty", "as_bytes"]

#: Alignment, in bytes, of offsets, sizes and addresses used with O_DIRECT.
ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align


def round_down(n: int, align: int = ALIGN) -> int:
    """Largest multiple of ``align`` that is <= ``n``."""
    return (n // align) * align


def is_aligned(n: int, align: int = ALIGN) -> bool:
    return n % align == 0


class _PinnedMap(mmap.mmap):
    """An anonymous mapping page-locked with ``cudaHostRegister``; unregistered when the
    last tensor over it is gone, before it is unmapped."""

    _unpin = None

    def register(self, t: torch.Tensor) -> None:
        self._unpin = pin_in_place(t)

    def __del__(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None


def pin_in_place(t: torch.Tensor):
    """Page-lock ``t``'s memory with CUDA (``cudaHostRegister``, e.g. shared memory mapped by
    another process too); return the function that unlocks it (call it before ``t`` goes)."""
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {size} bytes failed (error {int(err)}); lower the host budgets "
            "(memory.*_mib) or raise the locked-memory limit (ulimit -l)"
        )
    return lambda: torch.cuda.cudart().cudaHostUnregister(ptr)


def aligned_empty(nbytes: int, *, pin: bool = False, touch: bool = True) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``nbytes`` whose address is 4 KiB aligned.

    The memory comes from an anonymous mmap, which is page aligned and, unlike
    over-allocating and slicing, wastes nothing; ``pin=True`` page-locks it in place for
    asynchronous copies to a CUDA device (exactly ``nbytes`` rounded up to 4 KiB). ``touch=True`` writes every page once now:
    first touch of fresh memory is slow on virtual machines, and a pool is meant to pay
    that cost at start, not in the middle of a step.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    size = max(round_up(nbytes), ALIGN)
    if pin:
        # Registered with CUDA in place (cudaHostRegister), not through torch's pinned caching
        # allocator, which rounds every request up to a power of two: a pool pins what it says.
        m = _PinnedMap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(m, dtype=torch.uint8)  # the tensor keeps the mapping alive
        m.register(t)
    else:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(m, dtype=torch.uint8)  # the tensor keeps the mmap alive
    if touch:
        t.zero_()
    return t[:nbytes]


def as_bytes(buf: Any, *, writable: bool) -> np.ndarray:
    """View ``buf`` as a flat uint8 numpy array without copying.

    Accepts CPU torch tensors (any dtype, contiguous), numpy arrays, bytearray, bytes
    (read-only: only as a write source) and memoryview. Raises ``TypeError`` or
    ``ValueError`` naming what is wrong.
    """
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"expected a CPU tensor here, got one on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous for I/O; call .contiguous() first")
        t = buf.detach().reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
        return t.numpy()
    if isinstance(buf, np.ndarray):
        if not buf.flags["C_CONTIGUOUS"]:
            raise ValueError("numpy array must be C-contiguous for I/O")
        arr = buf.reshape(-1).view(np.uint8)
    elif isinstance(buf, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(buf, dtype=np.uint8)
    else:
        raise TypeError(f"cannot do I/O with a {type(buf).__name__}; pass a tensor, array or bytes-like object")
    if writable and not arr.flags["WRITEABLE"]:
        raise ValueError("the destination buffer of a read is read-only (bytes?); pass a bytearray or tensor")
    return arr
