"""A generation's key/value cache on two tiers: host memory within ``memory.kv_host_mib``, the
rest on the storage tier.

One cache per (block, micro-batch) pair, each ``[rows, kv heads, max_len, head dim]`` keys and
values (transformers' static cache layer: sized at start, never grown). Pairs are placed in
order, block by block, in host memory while the budget lasts (allocated at start); the others
get a region each in one file, ``kv.bin`` on the first ``io.paths`` entry (its space claimed
and checksummed like every state), and a buffer from a pool of two only while their block
runs for their micro-batch: ``bring`` reads the region in (waiting for it if the read started
ahead has not finished), ``send`` writes the whole region back. The read of the next pair in
unit order starts as soon as a buffer is free (``ahead``), under the compute of this one.
With separate device memory (CUDA) each host buffer (pinned) has a device twin: ``bring``
uploads into it (the compute stream waits for the copy, the host does not), ``send``
downloads from it and waits (a sync point) before the write.

Written whole rather than by the new positions only: a pair's region is ``2 x rows x heads
x max_len x head_dim`` elements, read and written once per decoding step (I/O per step grows
with ``max_len``, not with the tokens so far).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .io import FileHandle, IOFuture, aligned_empty, round_up

__all__ = ["TieredKV"]

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
    buffer: int | None = None  # the pool buffer holding it, while brought in
    read: IOFuture | None = None
    write: IOFuture | None = None


class TieredKV:
    """``caches``: one transformers static cache per micro-batch; ``rows``/``max_len`` per
    micro-batch; ``budget``: bytes in host memory (None: all); ``path``: the directory of the
    file for the rest. A context manager (closing removes the file)."""

    def __init__(self, caches: list, rows: list[int], max_len: list[int], *, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, dev, budget: int | None, path: str, checksum: bool) -> None:
        self.caches, self.dtype, self.dev, self.device = caches, dtype, dev, dev.device
        layers = len(caches[0].layers)
        self.pairs: dict[tuple[int, int], _Pair] = {}
        used, offset, spilled = 0, 0, 0
        for layer in range(layers):
            for m, (r, n) in enumerate(zip(rows, max_len)):
                shape = (r, kv_heads, n, head_dim)
                p = _Pair(layer, m, shape, 2 * r * kv_heads * n * head_dim * dtype.itemsize)
                if budget is None or used + p.nbytes <= budget:
                    used += p.nbytes
                    self._install(p, torch.zeros(2, *shape, dtype=dtype, device=self.device))
                else:
                    p.offset, offset = offset, offset + round_up(p.nbytes, _BLOCK)
                    spilled += p.nbytes
                    self._prepare(p)
                self.pairs[layer, m] = p
        self.host_bytes, self.spilled_bytes, self.file_bytes = used, spilled, offset  # the file: regions block-aligned
        self.read_bytes = self.written_bytes = 0
        self.file = self.pool = self.device_pool = None
        self._writing: list[_Pair] = []  # written back, oldest first: their buffers come back in this order
        if offset:
            biggest = max(p.nbytes for p in self.pairs.values() if p.offset is not None)
            self.pool = [aligned_empty(round_up(biggest, 4096), pin=dev.pin) for _ in range(2)]
            if dev.separate:  # the compute reads the cache in device memory: one device buffer per host one
                self.device_pool = [dev.empty(round_up(biggest, 4096) // dtype.itemsize, dtype) for _ in range(2)]
            self._free = [0, 1]
            self.file = FileHandle(os.path.join(path, NAME), "w", size=offset, checksum=checksum,
                                   checksum_block=_BLOCK)
            zeros = torch.zeros(2, *max((p.shape for p in self.pairs.values()), key=lambda s: s[0] * s[2]),
                                dtype=dtype)
            for p in self.pairs.values():  # every region starts as an empty cache, as the host ones do
                if p.offset is not None:
                    self.file.write(zeros.view(-1)[: p.nbytes // dtype.itemsize].view(torch.uint8), p.nbytes, p.offset)
        self.order = [k for k in self.pairs if self.pairs[k].offset is not None]  # unit order: layer, micro-batch

    def _layer(self, p: _Pair):
        return self.caches[p.micro_batch].layers[p.layer]

    def _prepare(self, p: _Pair) -> None:
        """A spilled pair's cache layer: initialised (no lazy allocation), its tensors absent."""
        layer = self._layer(p)
        layer.device, layer.batch_size, layer.num_heads = self.device, p.shape[0], p.shape[1]
        layer.k_head_dim = layer.v_head_dim = p.shape[3]
        if isinstance(layer.cumulative_length, torch.Tensor):  # transformers' (the built-in GPT's: a host int)
            layer.cumulative_length = layer.cumulative_length.to(self.device)
        layer.keys = layer.values = None
        layer.is_initialized = True

    def _install(self, p: _Pair, kv: torch.Tensor) -> None:
        self._prepare(p)
        layer = self._layer(p)
        layer.keys, layer.values = kv[0], kv[1]

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
        p.read = self.file.pread(self.pool[p.buffer], p.nbytes, p.offset)
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
        if self.device_pool is None:
            self._install(p, self._view(p))
            return
        # separate device memory: uploaded, the compute stream ordered after the copy (no host block)
        self.dev.wait(self.dev.upload(self._view(p, device=True), self._view(p)))
        self._install(p, self._view(p, device=True))

    def send(self, layer: int, m: int) -> None:
        """After: a spilled pair's region written back (from its buffer, given back when
        written); the next spilled pair's read started."""
        p = self.pairs[layer, m]
        if p.offset is None:
            return
        layer_ = self._layer(p)
        layer_.keys = layer_.values = None
        if self.device_pool is not None:  # sync point: the host buffer holds the step's cache before it is written
            self.dev.sync(self.dev.download(self._view(p), self._view(p, device=True)))
        p.write = self.file.pwrite(self.pool[p.buffer], p.nbytes, p.offset)
        self._writing.append(p)
        i = self.order.index((p.layer, p.micro_batch))
        nxt = self.pairs[self.order[(i + 1) % len(self.order)]]
        if nxt is not p:
            self._reclaim_done()
            self._start_read(nxt)  # ahead, under this pair's successors' compute

    def _reclaim(self) -> None:
        p = self._writing.pop(0)
        self.written_bytes += p.write.get()
        p.write, self._free, p.buffer = None, self._free + [p.buffer], None

    def _reclaim_done(self) -> None:
        while self._writing and self._writing[0].write.done():
            self._reclaim()

    def close(self) -> None:
        while self._writing:
            self._reclaim()
        for p in self.pairs.values():
            if p.read is not None:
                p.read.get()
        if self.file is not None:
            path = self.file.path
            self.file.close()
            for f in (path, path + ".crc"):
                if os.path.exists(f):
                    os.remove(f)

    def __enter__(self) -> "TieredKV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
