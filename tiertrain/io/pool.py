"""Fixed pools of aligned (and, with CUDA, pinned) host buffers.

A pool allocates ``count`` buffers of ``nbytes`` once, touches every page once, and then
only lends them out. ``acquire`` blocks while all are lent (back-pressure); the pool
never allocates more, so its memory is known from the config at start.
"""

from __future__ import annotations

import threading
import time

import torch

from .align import ALIGN, aligned_empty, round_up

__all__ = ["BufferPool", "PoolBuffer"]


class PoolBuffer:
    """One buffer lent by a pool. A context manager: leaving the block gives it back."""

    __slots__ = ("pool", "index", "tensor")

    def __init__(self, pool: "BufferPool", index: int, tensor: torch.Tensor) -> None:
        self.pool, self.index, self.tensor = pool, index, tensor

    def release(self) -> None:
        self.pool.release(self)

    def __enter__(self) -> "PoolBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BufferPool:
    """``count`` aligned buffers of ``nbytes`` each, carved from one allocation.

    Each buffer starts on a 4 KiB boundary (the stride is ``nbytes`` rounded up to 4 KiB),
    so any of them can be the target of an O_DIRECT request. ``pin`` page-locks them (for a
    CUDA compute device: asynchronous copies); the caller decides, so a CPU run on a machine
    with a GPU never creates a CUDA context.
    """

    def __init__(self, count: int, nbytes: int, *, pin: bool = False, name: str = "pool") -> None:
        if count < 1:
            raise ValueError(f"{name}: buffer count must be >= 1, got {count}")
        if nbytes < 1:
            raise ValueError(f"{name}: buffer size must be >= 1 byte, got {nbytes}")
        self.name, self.count, self.nbytes, self.pinned = name, count, nbytes, pin
        self.stride = round_up(nbytes, ALIGN)
        self._slab = aligned_empty(self.stride * count, pin=pin)
        self._buffers = [
            PoolBuffer(self, i, self._slab[i * self.stride : i * self.stride + nbytes]) for i in range(count)
        ]
        self._free = list(range(count - 1, -1, -1))
        self._cond = threading.Condition()
        self._high_water = 0
        self.wait_s = 0.0  # total time callers spent blocked in acquire

    @property
    def size_bytes(self) -> int:
        """Bytes the pool holds (what it allocated at start; it never changes)."""
        return self.stride * self.count

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.count - len(self._free)

    @property
    def high_water(self) -> int:
        """Most buffers ever lent at once."""
        return self._high_water

    def acquire(self, timeout: float | None = None) -> PoolBuffer:
        """Borrow a buffer, blocking while all are lent. ``TimeoutError`` after ``timeout`` s."""
        with self._cond:
            if not self._free:
                t0 = time.perf_counter()
                ok = self._cond.wait_for(lambda: bool(self._free), timeout=timeout)
                self.wait_s += time.perf_counter() - t0
                if not ok:
                    raise TimeoutError(f"{self.name}: no buffer free after {timeout} s (all {self.count} in use)")
            buf = self._buffers[self._free.pop()]
            self._high_water = max(self._high_water, self.count - len(self._free))
            return buf

    def try_acquire(self) -> PoolBuffer | None:
        with self._cond:
            if not self._free:
                return None
            buf = self._buffers[self._free.pop()]
            self._high_water = max(self._high_water, self.count - len(self._free))
            return buf

    def release(self, buf: PoolBuffer) -> None:
        with self._cond:
            if buf.pool is not self or buf.index in self._free:
                raise ValueError(f"{self.name}: buffer {buf.index} released twice or to the wrong pool")
            self._free.append(buf.index)
            self._cond.notify()

    def __repr__(self) -> str:
        return (
            f"BufferPool({self.name!r}, {self.count} x {self.nbytes} B = {self.size_bytes / 2**20:.1f} MiB, "
            f"pinned={self.pinned}, high_water={self._high_water})"
        )
