"""The I/O resources of one storage path: a thread pool, bounce buffers and counters."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable

import torch

from .align import ALIGN, round_up
from .pool import BufferPool
from .stats import PathStats

__all__ = ["IOWorkers", "DEFAULT_THREADS", "DEFAULT_CHUNK_BYTES"]

#: Defaults measured on the development machine (bench/results/io-*.md): 8 threads of
#: 16 MiB requests reached the disk's own limit from Python in both directions.
DEFAULT_THREADS = 8
DEFAULT_CHUNK_BYTES = 16 << 20


class IOWorkers:
    """A pool of ``threads`` I/O threads shared by every file on one storage path.

    Requests are split into chunks of ``chunk_bytes`` (at absolute file offsets that are
    multiples of it) and each chunk runs as one task. Tasks that cannot go straight to
    the caller's memory (unaligned edges, partial checksum blocks) borrow one of
    ``bounce_buffers`` aligned buffers of ``chunk_bytes`` plus two 4 KiB edge blocks; that
    pool is made on first use and is fixed from then on. Any chunk size works; multiples of
    4 KiB keep every chunk of an aligned request on the direct path. Device tensors without GPUDirect Storage are staged
    through a separate pinned pool of the same shape.
    """

    def __init__(
        self,
        name: str,
        *,
        threads: int = DEFAULT_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        bounce_buffers: int = 2,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if bounce_buffers < 1:
            raise ValueError(f"bounce_buffers must be >= 1, got {bounce_buffers}")
        self.name, self.threads, self.chunk_bytes = name, threads, chunk_bytes
        self.bounce_buffers = bounce_buffers
        self.stats = PathStats(name)
        self._executor = cf.ThreadPoolExecutor(threads, thread_name_prefix="tiertrain-io")
        self._lock = threading.Lock()
        self._pools: dict[str, BufferPool] = {}
        self._closed = False

    def _pool(self, kind: str, pin: bool) -> BufferPool:
        with self._lock:
            if kind not in self._pools:
                nbytes = round_up(self.chunk_bytes) + 2 * ALIGN  # a chunk's covering aligned blocks
                self._pools[kind] = BufferPool(self.bounce_buffers, nbytes, pin=pin, name=f"{self.name}:{kind}")
            return self._pools[kind]

    def bounce(self) -> BufferPool:
        """Aligned host buffers for unaligned or partial-block requests."""
        return self._pool("bounce", pin=False)

    def staging(self) -> BufferPool:
        """Pinned host buffers for device tensors that go through the host."""
        return self._pool("staging", pin=torch.cuda.is_available())  # no CUDA context otherwise

    @property
    def pool_bytes(self) -> int:
        with self._lock:
            return sum(p.size_bytes for p in self._pools.values())

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        if self._closed:
            raise RuntimeError(f"I/O workers of {self.name} are shut down")
        return self._executor.submit(fn, *args)

    def shutdown(self, *, cancel: bool = False) -> None:
        """Stop the threads: wait for running tasks; with ``cancel`` drop queued ones."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=cancel)

    def __enter__(self) -> "IOWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
