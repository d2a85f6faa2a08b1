"""The hidden-state stash: block inputs kept from the forward for the backward.

With ``L`` blocks and ``M`` micro-batches there are ``L * M`` entries, all of one shape,
named by ``(block, micro-batch)`` (an int is the entry's place in forward order). They are
placed once, at start: entries produced last in the forward (consumed first in the
backward) get host slots while ``host_bytes`` lasts; the earlier ones spill to
``stash.bin`` on the storage tier and are prefetched back as the backward approaches
them. Host slots, spill buffers and the file are sized from the config and never grow.

On CPU a host slot is handed to the block as is. Where device memory is separate (CUDA)
entries go down to pinned host slots or spill buffers on the download stream (the device
keeps the source alive until the copy ran) and come back up on the upload stream, which
the compute stream waits for without blocking the host; a spilled entry's file write starts
once its download is seen done, and a spill buffer is given back once its upload has run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..io import ALIGN, BufferPool, IOFuture, PoolBuffer, Storage, aligned_empty, round_up
from ..state.decl import FileDecl, StateDecl

__all__ = ["HiddenStash"]

FILE = "stash.bin"
OWNER = "hidden-state stash"


@dataclass
class _Spill:
    """A spilled entry on its way to the file: its download, then its write."""

    index: int
    buf: PoolBuffer
    copied: object
    write: IOFuture | None = None


class HiddenStash:
    def __init__(
        self,
        storage: Storage,
        dev,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        entries: int,
        host_bytes: int,
        spill_buffers: int | None = None,
        micro_batches: int = 1,
    ) -> None:
        self.dev, self.shape, self.dtype, self.entries = dev, tuple(shape), dtype, entries
        self.micro_batches = micro_batches
        self.numel = math.prod(shape)
        self.entry_bytes, self.host_slots, self.spilled = self.plan(shape, dtype, entries, host_bytes)
        self._host = aligned_empty(self.host_slots * self.entry_bytes, pin=dev.pin)
        block = storage.block_for(self.entry_bytes)  # entries sit on whole checksum blocks
        self._file = (
            storage.create(FILE, self.spilled * self.entry_bytes, checksum_block=block) if self.spilled else None
        )
        self._spill = (
            BufferPool(
                spill_buffers or self.spill_buffers_for(micro_batches),
                self.entry_bytes,
                pin=dev.pin,
                name="stash-spill",
            )
            if self.spilled
            else None
        )
        self._writes: list[_Spill] = []  # spilled entries on their way to the file
        self._reads: dict[int, tuple[IOFuture, PoolBuffer]] = {}
        self._held: dict[int, tuple[PoolBuffer, object]] = {}  # spilled entries given out: buffer, upload event
        self._uploading: list[tuple[PoolBuffer, object]] = []  # freed entries whose upload may still run
        self._down: dict[int, object] = {}  # host entry -> its download event
        self._up: dict[int, object] = {}  # host entry -> its last upload event
        self.wait_s = 0.0

    @staticmethod
    def spill_buffers_for(micro_batches: int) -> int:
        """Spill buffers: the next block's ``M`` prefetched entries plus the one in use (fewer
        and a prefetch is dropped to make room, then read again), at least 3."""
        return max(3, micro_batches + 1)

    @classmethod
    def declare(cls, shape: tuple[int, ...], dtype: torch.dtype, entries: int, host_bytes: int) -> StateDecl:
        """The stash's state: host slots and the spill file (not checkpointed: rebuilt every step)."""
        entry, host, spilled = cls.plan(shape, dtype, entries, host_bytes)
        files = (FileDecl(FILE, spilled * entry, record_bytes=entry),) if spilled else ()
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
        return (
            self._host[j * self.entry_bytes : j * self.entry_bytes + self.numel * self.dtype.itemsize]
            .view(self.dtype)
            .view(self.shape)
        )

    @staticmethod
    def _buf_view(buf: PoolBuffer, numel: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return buf.tensor[: numel * dtype.itemsize].view(dtype).view(shape)

    def put(self, key, h: torch.Tensor) -> None:
        """Keep entry ``key`` (a device tensor) until ``get``."""
        i = self._index(key)
        if tuple(h.shape) != self.shape:
            raise ValueError(f"stash entries are {self.shape}, got {tuple(h.shape)}")
        if i >= self.spilled:  # after the compute that made h, and after the last upload out of the slot
            self._down[i] = self.dev.download(self._host_view(i), h, after=[self.dev.event(), self._up.pop(i, None)])
            return
        buf = self._acquire_spill()
        host = self._buf_view(buf, self.numel, self.dtype, self.shape)
        self._writes.append(_Spill(i, buf, self.dev.download(host, h)))
        self._reap(block=False)

    def _acquire_spill(self) -> PoolBuffer:
        while True:
            self._reap(block=False)
            buf = self._spill.try_acquire()
            if buf is not None:
                return buf
            if self._uploading:
                self._free_uploaded(block=True)
            elif self._writes:
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
        """Writes of spilled entries: start those whose download ran, finish those that are
        done (``block``: at least the oldest)."""
        still = []
        for k, sp in enumerate(self._writes):
            first = block and k == 0
            if sp.write is None:
                if not (first or self.dev.done(sp.copied)):
                    still.append(sp)
                    continue
                self.dev.sync(sp.copied)  # done, or the one we must wait for
                sp.write = self._file.pwrite(sp.buf.tensor, self.entry_bytes, sp.index * self.entry_bytes)
            if sp.write.done() or first:
                t0 = time.perf_counter()
                sp.write.get()
                self.wait_s += time.perf_counter() - t0
                self.dev.release(sp.buf.tensor)
                sp.buf.release()
            else:
                still.append(sp)
        self._writes = still

    def _free_uploaded(self, block: bool) -> None:
        """Give back spill buffers whose upload has run (``block``: wait for the oldest)."""
        still = []
        for k, (buf, ev) in enumerate(self._uploading):
            if self.dev.done(ev) or (block and k == 0):
                self.dev.sync(ev)
                self.dev.release(buf.tensor)
                buf.release()
            else:
                still.append((buf, ev))
        self._uploading = still

    def prefetch(self, key) -> None:
        """Start bringing spilled entry ``key`` back (no-op for host entries or when busy)."""
        i = self._index(key)
        if i < 0 or i >= self.spilled or i in self._reads or i in self._held:
            return
        self._reap(block=False)
        self._free_uploaded(block=False)
        buf = self._spill.try_acquire()
        if buf is None:
            return
        self._wait_writes()
        self._reads[i] = (self._file.pread(buf.tensor, self.entry_bytes, i * self.entry_bytes), buf)

    def _wait_writes(self) -> None:
        while self._writes:
            self._reap(block=True)

    def _to_device(self, host: torch.Tensor, after=None) -> tuple[torch.Tensor, object]:
        """``host`` as the compute device sees it: itself (CPU), else an upload the compute
        stream waits for (no host block)."""
        if not self.dev.separate:
            return host, None
        d, ev = self.dev.upload_new(host, after=after)
        self.dev.wait(ev)
        return d, ev

    def get(self, key) -> torch.Tensor:
        """Entry ``key`` on the device. Spilled entries stay held until ``free(key)``."""
        i = self._index(key)
        if i >= self.spilled:
            h, self._up[i] = self._to_device(self._host_view(i), after=self._down.pop(i, None))
            return h
        if i not in self._reads:
            self._wait_writes()
            buf = self._acquire_spill()
            self._reads[i] = (self._file.pread(buf.tensor, self.entry_bytes, i * self.entry_bytes), buf)
        fut, buf = self._reads.pop(i)
        t0 = time.perf_counter()
        fut.get()  # sync point: the entry is back from the storage tier
        self.wait_s += time.perf_counter() - t0
        h, ev = self._to_device(self._buf_view(buf, self.numel, self.dtype, self.shape))
        self._held[i] = (buf, ev)
        return h

    def free(self, key) -> None:
        """The backward is done with entry ``key``."""
        held = self._held.pop(self._index(key), None)
        if held is not None:
            self._uploading.append(held)  # given back once its upload has run, found by query
            self._free_uploaded(block=False)

    def close(self) -> None:
        for ev in [*self._down.values(), *self._up.values()]:  # no copy may still use the host slots
            self.dev.sync(ev)
        self._down, self._up = {}, {}
        self._wait_writes()
        while self._uploading:
            self._free_uploaded(block=True)
        for fut, buf in self._reads.values():
            fut.get()
            buf.release()
        self._reads.clear()
        if self._file is not None:
            self._file.close()
