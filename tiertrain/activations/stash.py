"""The hidden-state stash: block inputs kept from the forward for the backward.

With ``L`` blocks and ``M`` micro-batches there are ``L * M`` entries, named by ``(block,
micro-batch)`` (an int is the entry's place in forward order), of one shape but for the last
dimension, which is each block's input width (``widths``: layers cut into sub-layer units
hand wider tensors between the MLP's pieces, ``models/sublayers.py``; else the hidden size). They are
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

import contextlib
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
        widths: list[int] | None = None,
    ) -> None:
        self.dev, self.shape, self.dtype, self.entries = dev, tuple(shape), dtype, entries
        self.micro_batches, self.widths = micro_batches, widths
        self._sizes = self.sizes(shape, dtype, entries, widths, micro_batches)
        self.entry_bytes, self.host_slots, self.spilled = self.plan(
            shape, dtype, entries, host_bytes, widths, micro_batches
        )
        # each entry's offset: in the file (spilled, the first ones), else in the host slots
        self._off = [0] * entries
        for i in range(1, entries):
            self._off[i] = 0 if i == self.spilled else self._off[i - 1] + self._sizes[i - 1]
        self._host = aligned_empty(sum(self._sizes[self.spilled :]), pin=dev.pin)
        spilled = self._sizes[: self.spilled]
        block = storage.block_for(math.gcd(*spilled) if spilled else self.entry_bytes)  # on whole checksum blocks
        self._file = storage.create(FILE, sum(spilled), checksum_block=block) if self.spilled else None
        try:
            self._spill = (
                BufferPool(
                    spill_buffers or self.spill_buffers_for(micro_batches, self._widest(shape, widths)),
                    self.entry_bytes,
                    pin=dev.pin,
                    name="stash-spill",
                )
                if self.spilled
                else None
            )
        except BaseException:  # (pinning refused: the file's descriptors were left open)
            if self._file is not None:
                self._file.close()
            raise
        self._writes: list[_Spill] = []  # spilled entries on their way to the file
        self._reads: dict[int, tuple[IOFuture, PoolBuffer]] = {}
        self._held: dict[int, tuple[PoolBuffer, object]] = {}  # spilled entries given out: buffer, upload event
        self._uploading: list[tuple[PoolBuffer, object]] = []  # freed entries whose upload may still run
        self._down: dict[int, object] = {}  # host entry -> its download event
        self._up: dict[int, object] = {}  # host entry -> its last upload event
        self.wait_s = 0.0

    @staticmethod
    def spill_buffers_for(micro_batches: int, widest: float = 1.0) -> int:
        """Spill buffers: the next block's ``M`` prefetched entries plus the one in use (fewer
        and a prefetch is dropped to make room, then read again), at least 3. ``widest``: the
        widest entry over a hidden state's (sub-layer units: 5.5 at 70 B): the buffers hold
        ``M + 1`` hidden states' bytes (a wide piece's entries are prefetched fewer ahead),
        at least 3 of the widest."""
        return max(3, math.ceil((micro_batches + 1) / widest))

    @staticmethod
    def _widest(shape: tuple[int, ...], widths: list[int] | None) -> float:
        return 1.0 if not widths else max(widths) / shape[-1]

    @classmethod
    def declare(
        cls,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        entries: int,
        host_bytes: int,
        widths: list[int] | None = None,
        micro_batches: int = 1,
    ) -> StateDecl:
        """The stash's state: host slots and the spill file (not checkpointed: rebuilt every step)."""
        entry, host, spilled = cls.plan(shape, dtype, entries, host_bytes, widths, micro_batches)
        sizes = cls.sizes(shape, dtype, entries, widths, micro_batches)
        block = math.gcd(*sizes[:spilled]) if spilled else entry  # as the file is made: whole checksum blocks
        files = (FileDecl(FILE, sum(sizes[:spilled]), record_bytes=block),) if spilled else ()
        return StateDecl("stash", dtype, OWNER, checkpointed=False, host_bytes=sum(sizes[spilled:]), files=files)

    def _index(self, key) -> int:
        """An entry's place in forward order, from its ``(block, micro-batch)``."""
        if isinstance(key, int):
            return key
        block, m = key
        return block * self.micro_batches + m

    @staticmethod
    def sizes(
        shape: tuple[int, ...],
        dtype: torch.dtype,
        entries: int,
        widths: list[int] | None = None,
        micro_batches: int = 1,
    ) -> list[int]:
        """Bytes of each entry, in forward order (``widths``: each block's last dimension)."""
        if widths is None:
            return [round_up(math.prod(shape) * dtype.itemsize, ALIGN)] * entries
        rest = math.prod(shape[:-1]) * dtype.itemsize
        return [round_up(rest * widths[i // micro_batches], ALIGN) for i in range(entries)]

    @classmethod
    def plan(
        cls,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        entries: int,
        host_bytes: int,
        widths: list[int] | None = None,
        micro_batches: int = 1,
    ) -> tuple[int, int, int]:
        """(bytes of the largest entry, entries in host slots, entries spilled to the file).
        Entries ``0 .. spilled-1`` (the earliest blocks) go to the file; the last ones get host
        slots while ``host_bytes`` lasts."""
        sizes = cls.sizes(shape, dtype, entries, widths, micro_batches)
        host, room = 0, host_bytes
        for b in reversed(sizes):
            if b > room:
                break
            room, host = room - b, host + 1
        return max(sizes, default=round_up(math.prod(shape) * dtype.itemsize, ALIGN)), host, entries - host

    @property
    def pool_bytes(self) -> int:
        return self._host.numel() + (self._spill.size_bytes if self._spill else 0)

    def _shape(self, i: int) -> tuple[int, ...]:
        """Entry ``i``'s shape: its block's input width last."""
        return self.shape if self.widths is None else (*self.shape[:-1], self.widths[i // self.micro_batches])

    def _host_view(self, i: int) -> torch.Tensor:
        shape = self._shape(i)
        off = self._off[i]
        return self._host[off : off + math.prod(shape) * self.dtype.itemsize].view(self.dtype).view(shape)

    def _buf_view(self, buf: PoolBuffer, i: int) -> torch.Tensor:
        shape = self._shape(i)
        return buf.tensor[: math.prod(shape) * self.dtype.itemsize].view(self.dtype).view(shape)

    def put(self, key, h: torch.Tensor) -> None:
        """Keep entry ``key`` (a device tensor) until ``get``."""
        i = self._index(key)
        if tuple(h.shape) != self._shape(i):
            where = "" if self.widths is None else f" of block {i // self.micro_batches}"
            raise ValueError(f"stash entries{where} are {self._shape(i)}, got {tuple(h.shape)}")
        if i >= self.spilled:  # after the compute that made h, and after the last upload out of the slot
            self._down[i] = self.dev.download(self._host_view(i), h, after=[self.dev.event(), self._up.pop(i, None)])
            return
        buf = self._acquire_spill()
        host = self._buf_view(buf, i)
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
                sp.write = self._file.pwrite(sp.buf.tensor, self._sizes[sp.index], self._off[sp.index])
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
        self._reads[i] = (self._file.pread(buf.tensor, self._sizes[i], self._off[i]), buf)

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
            self._reads[i] = (self._file.pread(buf.tensor, self._sizes[i], self._off[i]), buf)
        fut, buf = self._reads.pop(i)
        t0 = time.perf_counter()
        fut.get()  # sync point: the entry is back from the storage tier
        self.wait_s += time.perf_counter() - t0
        h, ev = self._to_device(self._buf_view(buf, i))
        self._held[i] = (buf, ev)
        return h

    def free(self, key) -> None:
        """The backward is done with entry ``key``."""
        held = self._held.pop(self._index(key), None)
        if held is not None:
            self._uploading.append(held)  # given back once its upload has run, found by query
            self._free_uploaded(block=False)

    def clear(self) -> None:
        """Forget what a step left (one that failed half-way): every copy, write and read waited
        for, every spill buffer given back. (A prefetch left over was taken by the next step for
        its entry of that index, which its ``put`` had rewritten: the old step's hidden state came
        back.) A read's own error is no concern of the next step: it reads again."""
        for ev in [*self._down.values(), *self._up.values()]:  # no copy may still use the host slots
            self.dev.sync(ev)
        self._down, self._up = {}, {}
        self._wait_writes()
        self._uploading += list(self._held.values())
        self._held.clear()
        while self._uploading:
            self._free_uploaded(block=True)
        reads, self._reads = list(self._reads.values()), {}
        for fut, buf in reads:
            with contextlib.suppress(Exception):
                fut.get()
            buf.release()

    def close(self) -> None:
        try:
            self.clear()
        finally:  # (its descriptors, whatever a wait raised)
            if self._file is not None:
                self._file.close()
