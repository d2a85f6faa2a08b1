"""The hidden-state stash: block inputs kept from the forward for the backward.

With ``L`` blocks and ``M`` micro-batches there are ``L * M`` entries, all of one shape,
named by ``(block, micro-batch)`` (an int is the entry's place in forward order). They are
placed once, at start: entries produced last in the forward (consumed first in the
backward) get host slots while ``host_bytes`` lasts; the earlier ones spill to
``stash.bin`` on the storage tier and are prefetched back as the backward approaches
them. Host slots, spill buffers and the file are sized from the config and never grow.

On CPU a host slot is handed to the block as is; on CUDA entries cross to and from
pinned host slots on the copy stream.
"""

from __future__ import annotations

import math
import time

import torch

from ..io import ALIGN, BufferPool, IOFuture, PoolBuffer, Storage, aligned_empty, round_up
from ..state.decl import FileDecl, StateDecl
from ..state.device import Device

__all__ = ["HiddenStash"]

FILE = "stash.bin"
OWNER = "hidden-state stash"


class HiddenStash:
    def __init__(
        self,
        storage: Storage,
        dev: Device,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        entries: int,
        host_bytes: int,
        spill_buffers: int = 3,
        micro_batches: int = 1,
    ) -> None:
        self.dev, self.shape, self.dtype, self.entries = dev, tuple(shape), dtype, entries
        self.micro_batches = micro_batches
        self.numel = math.prod(shape)
        self.entry_bytes, self.host_slots, self.spilled = self.plan(shape, dtype, entries, host_bytes)
        self._host = aligned_empty(self.host_slots * self.entry_bytes, pin=dev.cuda)
        block = storage.block_for(self.entry_bytes)  # entries sit on whole checksum blocks
        self._file = storage.create(FILE, self.spilled * self.entry_bytes, checksum_block=block) if self.spilled else None
        self._spill = (
            BufferPool(spill_buffers, self.entry_bytes, pin=dev.cuda, name="stash-spill") if self.spilled else None
        )
        self._writes: list[tuple[IOFuture, PoolBuffer]] = []
        self._reads: dict[int, tuple[IOFuture, PoolBuffer]] = {}
        self._held: dict[int, PoolBuffer] = {}
        self._ready: dict[int, "torch.cuda.Event | None"] = {}
        self.wait_s = 0.0

    @classmethod
    def declare(cls, shape: tuple[int, ...], dtype: torch.dtype, entries: int, host_bytes: int) -> StateDecl:
        """The stash's state: host slots and the spill file (not checkpointed: rebuilt every step)."""
        entry, host, spilled = cls.plan(shape, dtype, entries, host_bytes)
        files = (FileDecl(FILE, spilled * entry),) if spilled else ()
        return StateDecl("stash", dtype, OWNER, checkpointed=False, host_bytes=host * entry, files=files)

    def _index(self, key) -> int:
        """An entry's place in forward order, from its ``(block, micro-batch)``."""
        if isinstance(key, int):
            return key
        block, m = key
        return block * self.micro_batches + m

    @staticmethod
    def plan(shape: tuple[int, ...], dtype: torch.dtype, entries: int, host_bytes: int) -> tuple[int, int, int]:
        """(bytes per entry, entries in host slots, entries spilled to the file). Entries
        ``0 .. spilled-1`` (the earliest blocks) go to the file."""
        entry = round_up(math.prod(shape) * dtype.itemsize, ALIGN)
        host = min(entries, host_bytes // entry)
        return entry, host, entries - host

    @property
    def pool_bytes(self) -> int:
        return self._host.numel() + (self._spill.size_bytes if self._spill else 0)

    def _host_view(self, i: int) -> torch.Tensor:
        j = i - self.spilled
        return self._host[j * self.entry_bytes : j * self.entry_bytes + self.numel * self.dtype.itemsize].view(
            self.dtype
        ).view(self.shape)

    @staticmethod
    def _buf_view(buf: PoolBuffer, numel: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return buf.tensor[: numel * dtype.itemsize].view(dtype).view(shape)

    def put(self, key, h: torch.Tensor) -> None:
        """Keep entry ``key`` (a device tensor) until ``get``."""
        i = self._index(key)
        if tuple(h.shape) != self.shape:
            raise ValueError(f"stash entries are {self.shape}, got {tuple(h.shape)}")
        ready = self.dev.event()
        if i >= self.spilled:
            with self.dev.on_copy_stream(after=ready):
                self._host_view(i).copy_(h, non_blocking=True)
            self._ready[i] = self.dev.copy_event()
            return
        buf = self._acquire_spill()
        host = self._buf_view(buf, self.numel, self.dtype, self.shape)
        with self.dev.on_copy_stream(after=ready):
            host.copy_(h, non_blocking=True)
        Device.sync(self.dev.copy_event())  # the bytes must be in host memory before the write
        self._writes.append((self._file.pwrite(buf.tensor, self.entry_bytes, i * self.entry_bytes), buf))

    def _acquire_spill(self) -> PoolBuffer:
        while True:
            self._reap(block=False)
            buf = self._spill.try_acquire()
            if buf is not None:
                return buf
            if self._writes:
                self._reap(block=True)
            elif self._reads:  # every buffer holds a prefetch: drop the furthest one, re-read later
                fut, victim = self._reads.pop(max(self._reads))
                fut.get()
                victim.release()
            else:
                raise RuntimeError(
                    f"all {self._spill.count} stash spill buffers are held by entries not yet freed "
                    f"({sorted(self._held)}); free entries after their backward"
                )

    def _reap(self, block: bool) -> None:
        still = []
        for k, (fut, buf) in enumerate(self._writes):
            if fut.done() or (block and k == 0):
                t0 = time.perf_counter()
                fut.get()
                self.wait_s += time.perf_counter() - t0
                buf.release()
            else:
                still.append((fut, buf))
        self._writes = still

    def prefetch(self, key) -> None:
        """Start bringing spilled entry ``key`` back (no-op for host entries or when busy)."""
        i = self._index(key)
        if i < 0 or i >= self.spilled or i in self._reads or i in self._held:
            return
        self._reap(block=False)
        buf = self._spill.try_acquire()
        if buf is None:
            return
        self._wait_writes()
        self._reads[i] = (self._file.pread(buf.tensor, self.entry_bytes, i * self.entry_bytes), buf)

    def _wait_writes(self) -> None:
        while self._writes:
            self._reap(block=True)

    def get(self, key) -> torch.Tensor:
        """Entry ``key`` on the device. Spilled entries stay held until ``free(key)``."""
        i = self._index(key)
        if i >= self.spilled:
            if self.dev.cuda:
                Device.sync(self._ready.pop(i, None))
                return self._host_view(i).to(self.dev.device, non_blocking=True)
            return self._host_view(i)
        if i not in self._reads:
            self._wait_writes()
            buf = self._acquire_spill()
            self._reads[i] = (self._file.pread(buf.tensor, self.entry_bytes, i * self.entry_bytes), buf)
        fut, buf = self._reads.pop(i)
        t0 = time.perf_counter()
        fut.get()  # sync point: the entry is back from the storage tier
        self.wait_s += time.perf_counter() - t0
        self._held[i] = buf
        h = self._buf_view(buf, self.numel, self.dtype, self.shape)
        return h.to(self.dev.device, non_blocking=True) if self.dev.cuda else h

    def free(self, key) -> None:
        """The backward is done with entry ``key``."""
        buf = self._held.pop(self._index(key), None)
        if buf is not None:
            if self.dev.cuda:
                Device.sync(self.dev.event())  # the H2D copy out of this buffer has run
            buf.release()

    def close(self) -> None:
        self._wait_writes()
        for fut, buf in self._reads.values():
            fut.get()
            buf.release()
        self._reads.clear()
        if self._file is not None:
            self._file.close()
