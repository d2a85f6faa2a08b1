"""A generation's key/value cache on two tiers: host memory within ``memory.kv_host_mib``, the
rest on the storage tier.

One cache per (block, micro-batch) pair, each ``[rows, kv heads, max_len, head dim]`` keys and
values (transformers' static cache layer: sized at start, never grown; a sliding layer's holds
its window, ``min(sliding_window, max_len)`` positions, rewritten whole each step; keys and values of
different widths, multi-head latent attention's, are stored at the larger and seen as the
leading part of it, ``dims``). Pairs are placed in
order, block by block, in host memory while the budget lasts (allocated at start); the others
get a region each in one file, ``kv.bin`` on the first ``io.paths`` entry (its space claimed
and checksummed like every state), and a buffer from a pool of two only while their block
runs for their micro-batch (pairs in the budget and those buffers are checked against the
device's free memory at start). A region is position-major (``[max_len, 2, rows, heads, head
dim]``), so that the positions a pair holds are one contiguous run and each step's new ones
another: ``bring`` reads the positions written so far (waiting for the read started ahead),
into a staging buffer, and lays them out as the cache's (the rest of the buffer zeroed: never
attended to, but finite); ``send(layer, m, new)`` writes back the ``new`` positions the block
just added, alone. So a step reads what the cache holds and writes what it added: the I/O
grows with the tokens so far, not with ``max_len``. The read of the next pair in unit order
starts as soon as a buffer is free (``ahead``), under the compute of this one. With separate
device memory (CUDA) the cache's buffers are on the device, each with a position-major device
twin of its (pinned) staging buffer: ``bring`` uploads the positions held into the twin (the
compute stream waits for the copy, the host does not) and lays them out there, ``send`` lays
out the new positions in the twin and downloads those alone, waiting (a sync point) before the
write. So what crosses the bus per step is what the file gives and takes, not ``max_len``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..io import FileHandle, IOFuture, aligned_empty, round_up
from ..io.scratch import ScratchLock

__all__ = ["TieredKV"]

log = logging.getLogger("tiertrain")

NAME = "kv.bin"
# Regions start on whole checksum blocks: a pair's read ahead never shares a block with another
# pair's write in flight.
_BLOCK = 64 << 10


@dataclass
class _Pair:
    layer: int
    micro_batch: int
    shape: tuple[int, int, int, int]
    nbytes: int
    offset: int | None = None  # in the file, where spilled
    filled: int = 0  # positions written so far (spilled pairs: what the region holds)
    buffer: int | None = None  # the pool buffer holding it, while brought in
    read: IOFuture | None = None
    write: IOFuture | None = None


class TieredKV:
    """``caches``: one transformers static cache per micro-batch; ``rows``/``max_len`` per
    micro-batch; ``budget``: bytes in host memory (None: all); ``path``: the directory of the
    file for the rest. A context manager (closing removes the file)."""

    def __init__(
        self,
        caches: list,
        rows: list[int],
        max_len: list[int],
        *,
        kv_heads: int,
        head_dim: int,
        dims: tuple[int, int] | None = None,
        dtype: torch.dtype,
        dev,
        budget: int | None,
        path: str,
        checksum: bool,
    ) -> None:
        self.caches, self.dtype, self.dev, self.device = caches, dtype, dev, dev.device
        # keys and values of other widths (multi-head latent attention): stored at head_dim, the larger
        self.dims = dims or (head_dim, head_dim)
        if max(self.dims) != head_dim:
            raise ValueError(f"key/value widths {self.dims}: head_dim must be the larger, not {head_dim}")
        layers = len(caches[0].layers)
        self.pairs: dict[tuple[int, int], _Pair] = {}
        used, offset, spilled = 0, 0, 0
        for layer in range(layers):  # placed first, allocated once the device has said it has room
            for m, (r, n) in enumerate(zip(rows, max_len)):
                n = min(n, getattr(caches[m].layers[layer], "max_cache_len", n))  # a sliding layer: its window
                p = _Pair(layer, m, (r, kv_heads, n, head_dim), 2 * r * kv_heads * n * head_dim * dtype.itemsize)
                if budget is None or used + p.nbytes <= budget:
                    used += p.nbytes
                else:
                    p.offset, offset = offset, offset + round_up(p.nbytes, _BLOCK)
                    spilled += p.nbytes
                self.pairs[layer, m] = p
        self.host_bytes, self.spilled_bytes, self.file_bytes = used, spilled, offset  # the file: regions block-aligned
        biggest = round_up(max((p.nbytes for p in self.pairs.values() if p.offset is not None), default=0), 4096)
        if dev.separate:  # the pairs in the budget and the spilled pairs' two buffers and their twins
            dev.check_capacity(
                {"key/value cache": used, "key/value buffers": 2 * 2 * biggest},
                "lower memory.kv_host_mib (the rest of the cache goes to the storage tier)",
            )
        for p in self.pairs.values():
            if p.offset is None:
                self._install(p, torch.zeros(2, *p.shape, dtype=dtype, device=self.device))
            else:
                self._prepare(p)
        self.read_bytes = self.written_bytes = 0
        self.file = self.pool = self.device_pool = self.device_stage = None
        self.lock: ScratchLock | None = None
        self._writing: list[_Pair] = []  # written back, oldest first: their buffers come back in this order
        if offset:
            # position-major, as in the file (pinned where they cross to the device)
            self.stage = [aligned_empty(biggest, pin=dev.pin) for _ in range(2)]
            if dev.separate:  # the cache as the compute reads it, and a position-major twin of each stage
                self.device_pool = [dev.empty(biggest // dtype.itemsize, dtype) for _ in range(2)]
                self.device_stage = [dev.empty(biggest // dtype.itemsize, dtype) for _ in range(2)]
            else:  # the compute reads the cache in host memory
                self.pool = [aligned_empty(biggest) for _ in range(2)]
            self._free = [0, 1]
            # one user of the directory at a time: a second generation (or a run) sharing it would
            # take this one's file for a killed one's and replace it under it
            self.lock = ScratchLock([path])
            stale = os.path.join(path, NAME)
            try:  # a kv.bin no tiertrain run there made is the user's: never replaced
                self.lock.claim([NAME])  # (and named: a generation killed from here on leaves it to the next)
            except BaseException:
                self.lock.release(remove=True)  # (kept where it names a run's files still here)
                raise
            if os.path.exists(stale):  # a generation that was killed left it: nothing in it is this one's
                log.warning(
                    "replacing %s, left by a generation that did not finish (%.1f MiB)",
                    stale,
                    os.path.getsize(stale) / 2**20,
                )
            try:
                self.file = FileHandle(
                    stale, "w", size=offset, checksum=checksum, checksum_block=_BLOCK
                )  # nothing is read from a region before it is written
            except BaseException:
                self.lock.release(remove=True)
                raise
        self.order = [k for k in self.pairs if self.pairs[k].offset is not None]  # unit order: layer, micro-batch

    def _layer(self, p: _Pair):
        return self.caches[p.micro_batch].layers[p.layer]

    def _prepare(self, p: _Pair) -> None:
        """A spilled pair's cache layer: initialised (no lazy allocation), its tensors absent."""
        layer = self._layer(p)
        layer.device, layer.batch_size, layer.num_heads = self.device, p.shape[0], p.shape[1]
        layer.k_head_dim, layer.v_head_dim = self.dims
        if isinstance(layer.cumulative_length, torch.Tensor):  # transformers' (the built-in GPT's: a host int)
            layer.cumulative_length = layer.cumulative_length.to(self.device)
        layer.keys = layer.values = None
        layer.is_initialized = True

    def _install(self, p: _Pair, kv: torch.Tensor) -> None:
        self._prepare(p)
        layer = self._layer(p)
        k, v = self.dims
        layer.keys, layer.values = kv[0][..., :k], kv[1][..., :v]

    def _staged(self, p: _Pair, device: bool = False) -> torch.Tensor:
        """``p``'s staging buffer (``device``: its device twin) as ``[max_len, 2, rows, heads,
        head dim]`` (the file's layout)."""
        r, h, n, d = p.shape
        if device:
            return self.device_stage[p.buffer][: p.nbytes // self.dtype.itemsize].view(n, 2, r, h, d)
        return self.stage[p.buffer][: p.nbytes].view(self.dtype).view(n, 2, r, h, d)

    def _pos_bytes(self, p: _Pair) -> int:
        return p.nbytes // p.shape[2]

    def _view(self, p: _Pair, device: bool = False) -> torch.Tensor:
        if device:
            return self.device_pool[p.buffer][: p.nbytes // self.dtype.itemsize].view(2, *p.shape)
        return self.pool[p.buffer][: p.nbytes].view(self.dtype).view(2, *p.shape)

    def _start_read(self, p: _Pair) -> bool:
        """Start reading ``p`` into a free buffer (True), or say none is free (False). A pair
        whose last write-back still holds its buffer is not read before that write is done."""
        if p.read is not None:
            return True
        if p.write is not None or not self._free:
            return False
        p.buffer = self._free.pop()
        size = p.filled * self._pos_bytes(p)
        p.read = self.file.pread(self.stage[p.buffer], size, p.offset) if size else IOFuture.completed(0)
        return True

    def bring(self, layer: int, m: int) -> None:
        """Before block ``layer`` runs for micro-batch ``m``: its keys and values in memory."""
        p = self.pairs[layer, m]
        if p.offset is None:
            return
        while not self._start_read(p):  # its own write-back, or both buffers', gives one back first
            self._reclaim()
        self.read_bytes += p.read.get()  # sync point on the I/O
        p.read = None
        f, separate = p.filled, self.device_pool is not None
        if separate and f:  # the positions held cross, position-major; the compute stream waits, the host does not
            # after the compute stream's last read of the device buffer (the previous pair's copy)
            dst = self._staged(p, device=True)[:f]
            self.dev.wait(self.dev.upload(dst, self._staged(p)[:f], after=self.dev.event()))
        view = self._view(p, device=separate)
        view[:, :, :, :f].copy_(self._staged(p, device=separate)[:f].permute(1, 2, 3, 0, 4))
        view[:, :, :, f:].zero_()
        self._install(p, view)

    def send(self, layer: int, m: int, new: int) -> None:
        """After: the ``new`` positions block ``layer`` just added for micro-batch ``m`` written
        to its region (from the buffer, given back when written; a sliding layer's whole window,
        which every step moves once full); the next spilled pair's read started."""
        p = self.pairs[layer, m]
        if p.offset is None:
            return
        layer_ = self._layer(p)
        layer_.keys = layer_.values = None
        f, step, separate = p.filled, self._pos_bytes(p), self.device_pool is not None
        if getattr(layer_, "is_sliding", False):  # its window moved (rolled, or cut to the last positions): all of it
            f, new = 0, min(layer_.cumulative_length_int, p.shape[2])
        if f + new > p.shape[2]:
            raise ValueError(
                f"key/value cache of block {layer}, micro-batch {m}: {f} + {new} positions, more than its {p.shape[2]}"
            )
        added = self._staged(p, device=separate)[f : f + new]
        added.copy_(self._view(p, device=separate)[:, :, :, f : f + new].permute(3, 0, 1, 2, 4))
        if separate:  # the new positions alone cross; sync point: on the host before they are written
            self.dev.sync(self.dev.download(self._staged(p)[f : f + new], added))
        p.write = self.file.pwrite(self.stage[p.buffer], new * step, p.offset + f * step, f * step)
        p.filled = f + new
        self._writing.append(p)
        i = self.order.index((p.layer, p.micro_batch))
        nxt = self.pairs[self.order[(i + 1) % len(self.order)]]
        if nxt is not p:
            self._reclaim_done()
            self._start_read(nxt)  # ahead, under this pair's successors' compute

    def restart(self, m: int) -> None:
        """Micro-batch ``m``'s cache emptied, in every layer: the next step adds every position
        again from the first (a family that computes its cache again, ``generate._Decoding.again``).
        Its pairs in host memory are written over; its spilled regions from their start (a pair's
        earlier write is done before its next read, so never under the new one)."""
        for (_, mb), p in self.pairs.items():
            if mb != m:
                continue
            p.filled = 0
            layer = self._layer(p)
            if isinstance(layer.cumulative_length, torch.Tensor):
                layer.cumulative_length.zero_()
            else:
                layer.cumulative_length = 0
            if hasattr(layer, "cumulative_length_int"):  # a sliding layer's count of positions seen
                layer.cumulative_length_int = 0

    def _reclaim(self) -> None:
        p = self._writing.pop(0)
        self.written_bytes += p.write.get()
        p.write, self._free, p.buffer = None, self._free + [p.buffer], None

    def _reclaim_done(self) -> None:
        while self._writing and self._writing[0].write.done():
            self._reclaim()

    def close(self) -> None:
        """Wait for what is in flight and remove the file, also after an error (a checksum
        error of a read, a failed write: raised again once the file is gone)."""
        try:
            while self._writing:
                self._reclaim()
            for p in self.pairs.values():
                if p.read is not None:
                    p.read.get()
        finally:
            self._writing = []
            for p in self.pairs.values():
                p.read = None
            try:
                if self.file is not None:
                    path, f, self.file = self.file.path, self.file, None
                    try:
                        f.close()
                    finally:
                        for name in (path, path + ".crc"):
                            if os.path.exists(name):
                                os.remove(name)
            finally:
                if self.lock is not None:
                    self.lock.release(remove=True)
                    self.lock = None

    def __enter__(self) -> "TieredKV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
