"""Autograd activations on the storage tier ("offload" path, as in TBA / SSDTrain).

For a ``(block, micro-batch)`` pair whose activations go to SSD, the forward runs under
``saved_tensors_hooks`` as for kept graphs (``keep.py``), but every tensor autograd saves is
copied, as it is saved, into one *record*: a pool buffer the size of the pair's saved bytes,
written to ``acts.bin`` on the storage tier as soon as the pair's forward is done. The
backward reads the records back ahead of time, in the order it consumes them (``pump``),
and autograd unpacks views of the buffer.

Nothing is stored twice:

- parameter views stay references to their unit (``UnitViews``), as for kept graphs;
- a storage saved by several ops (or as several views) is copied once per version;
- the block's input is not copied: it is in the hidden-state stash already (the executor
  stashes it, as for a recomputed pair) and is unpacked from the stash's entry.

The graph of an offloaded pair holds no activation memory at all: it starts at a 0-element
leaf through ``_Entry`` (which hands the input's gradient out) and ends in a 0-element root
through ``_Exit`` (which takes the output's gradient in), so neither the input nor the
output are kept alive by it; everything else is a packed handle.

Space and memory are fixed at start: ``record_bytes`` (one pair's saved bytes, measured by
``measure`` on one block before the first step) times the pairs offloaded is the file;
``buffers`` records of pinned (CUDA) or plain host memory are the pool, shared by the
forward's writes and the backward's reads (``buffers - 1`` read ahead). A pair that saves
more than ``record_bytes`` stops the step with ``ActivationPlanError``. Each record is on
whole checksum blocks of a checksummed file: a corrupt or truncated record fails the read
with the file and offset named.

Where device memory is separate (CUDA) a saved tensor goes down on the download stream
after the compute that made it; the record's write starts once its downloads are seen done.
The record comes back up as one upload the compute stream waits for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import TiertrainError
from ..io import ALIGN, BufferPool, IOFuture, PoolBuffer, Storage, round_up
from ..state.decl import FileDecl, StateDecl
from .keep import UnitViews, _ParamRef

__all__ = ["OffloadedGraphs", "ActivationPlanError", "measure_record"]

FILE = "acts.bin"
OWNER = "activations on the storage tier"
PACK_ALIGN = 64  # bytes between saved storages within a record (any dtype's alignment)


class ActivationPlanError(TiertrainError, RuntimeError):
    """A step's saved tensors do not match the record planned at start."""


@dataclass(frozen=True)
class _InputRef:
    """A view of the block's input (unpacked from its stash entry)."""

    key: tuple[int, int]
    offset: int  # elements from the input's own first element
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _Saved:
    """A view of a storage copied into the record of pair ``key``."""

    key: tuple[int, int]
    at: int  # bytes from the record's start
    nbytes: int  # the storage's bytes
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class _Box:
    """Gradients crossing the graph's ends: ``dy`` in through the root, ``dx`` out at the entry."""

    dy: torch.Tensor | None = None
    dx: torch.Tensor | None = None


class _Entry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, leaf: torch.Tensor, x: torch.Tensor, box: _Box) -> torch.Tensor:
        ctx.box = box
        return x.detach()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.box.dx = g
        return None, None, None


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, box: _Box) -> torch.Tensor:
        ctx.box = box
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        dy, ctx.box.dy = ctx.box.dy, None
        return dy, None


@dataclass
class _Record:
    key: tuple[int, int]
    slot: int  # its place in the file, in records
    root: torch.Tensor
    box: _Box
    buf: PoolBuffer | None = None  # in memory: being filled, written or read back
    copied: object = None  # the last download into ``buf`` (separate device memory)
    write: IOFuture | None = None
    read: IOFuture | None = None
    written: bool = False


@dataclass
class _Packer:
    """The pack hook of one pair's forward: where each storage went in the record."""

    views: UnitViews
    x: torch.Tensor
    key: tuple[int, int]
    limit: int
    copy: Callable[[int, torch.Tensor], None] | None  # (record offset, bytes of a storage) -> None; None: count only
    cursor: int = 0
    seen: dict = field(default_factory=dict)  # (storage address, version) -> record offset
    alive: list = field(default_factory=list)  # storages copied: no address is reused while the pair records

    def __call__(self, t: torch.Tensor):
        ref = self.views.ref(t)
        if ref is not None:
            return ref
        st = t.untyped_storage()
        if t.numel() == 0 or st.nbytes() == 0 or t.device != self.x.device:
            return t.detach()  # nothing to move (host scalars beside device tensors)
        inp = self._input_ref(t, st)
        if inp is not None:
            return inp
        k = (st.data_ptr(), t._version)
        at = self.seen.get(k)
        if at is None:
            at, n = self.cursor, st.nbytes()
            if at + n > self.limit:
                raise ActivationPlanError(
                    f"block {self.key[0]}, micro-batch {self.key[1]} saves more than the {self.limit:,} bytes planned per "
                    f"record at start (a {tuple(t.shape)} {t.dtype} tensor at byte {at:,}): the block's saved tensors differ "
                    "from those measured at start; run it with memory.activations = 'keep' or 'recompute'"
                )
            if self.copy is not None:
                self.copy(at, torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (n,), (1,)))
            self.seen[k] = at
            self.alive.append(st)
            self.cursor = round_up(at + n, PACK_ALIGN)
        return _Saved(self.key, at, st.nbytes(), t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def close(self) -> None:
        """Drop every tensor this hook holds: autograd keeps the pack hook with each saved
        tensor until the backward, and with it whatever the hook refers to."""
        self.x = self.copy = None
        self.seen, self.alive = {}, []

    def _input_ref(self, t: torch.Tensor, st) -> _InputRef | None:
        x = self.x
        if st.data_ptr() != x.untyped_storage().data_ptr() or t.dtype != x.dtype or not x.is_contiguous():
            return None
        rel = t.storage_offset() - x.storage_offset()
        last = rel + sum((s - 1) * d for s, d in zip(t.size(), t.stride()))
        if rel < 0 or last >= x.numel():
            return None  # reaches outside the input's own elements: copied as any other storage
        return _InputRef(self.key, rel, tuple(t.size()), tuple(t.stride()))


def _run(views: UnitViews, packer: _Packer, unpack, units: tuple[int, ...], fn: Callable, x: torch.Tensor, box: _Box):
    leaf = torch.empty(0, device=x.device, requires_grad=True)
    views.enter(units)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(packer, unpack):
            y = fn(_Entry.apply(leaf, x, box))
            root = _Exit.apply(y, box)
    finally:
        views.exit()
        packer.close()
    return y.detach(), root


def measure_record(
    units: tuple[int, ...],
    bound: Callable[[int], torch.Tensor],
    fn: Callable,
    x: torch.Tensor,
    checksum_block: int = 1 << 20,
    *,
    slack: int = 0,
) -> int:
    """The record bytes one pair of ``fn`` (a block's forward on input ``x``, units bound)
    needs, by one forward with the offload path's own pack hook counting (nothing copied),
    plus ``slack`` (what a data-dependent block may save beyond this forward's)."""
    views = UnitViews(bound)
    packer = _Packer(views, x, (0, 0), 1 << 62, None)
    _run(views, packer, lambda obj: obj, units, fn, x, _Box())
    return record_size(packer.cursor + slack, checksum_block)


def record_size(saved_bytes: int, checksum_block: int = 1 << 20) -> int:
    """A record on whole O_DIRECT blocks and on whole checksum blocks as large as padding of
    at most 1/16 allows (up to the storage's ``checksum_block``): a record is then checked in
    a few calls, not thousands of 4 KiB ones (measured: per-block overhead doubled the CPU the
    checksums of a 60 MiB record took)."""
    n = max(saved_bytes, 1)
    block = ALIGN
    while block * 2 <= min(checksum_block, n // 16):
        block *= 2
    return round_up(n, block)


class OffloadedGraphs:
    def __init__(
        self,
        storage: Storage,
        dev,
        *,
        record_bytes: int,
        records: int,
        buffers: int,
        input_of: Callable[[tuple[int, int]], torch.Tensor],
    ) -> None:
        """``records`` pairs of ``record_bytes`` each on the storage tier; ``buffers`` records in
        memory (>= 2); ``input_of(key)``: the pair's input from the stash, during its backward.
        ``bind`` says where units are bound before the first forward."""
        if buffers < 2:
            raise ValueError(f"offloaded activations need at least 2 buffers, got {buffers}")
        if record_bytes <= 0 or record_bytes % ALIGN:
            raise ValueError(f"record_bytes must be a positive multiple of {ALIGN}, got {record_bytes}")
        self.dev, self.input_of = dev, input_of
        self.views: UnitViews | None = None
        self.record_bytes, self.records = record_bytes, records
        self._file = storage.create(FILE, records * record_bytes, checksum_block=storage.block_for(record_bytes))
        try:
            self._pool = BufferPool(buffers, record_bytes, pin=dev.pin, name="activation records")
        except BaseException:  # (pinning refused: the file's descriptors were left open)
            self._file.close()
            raise
        self._recs: dict[tuple[int, int], _Record] = {}
        self._order: list[tuple[int, int]] = []  # the backward's order of the records not yet read
        self._loaded: dict[tuple[int, int], torch.Tensor] = {}  # records being back-propagated, as the device sees them
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._uploading: list[tuple[PoolBuffer, object]] = []  # buffers whose upload may still run
        self.wait_s = 0.0  # the compute thread waiting: for a buffer (writes behind) or a read
        self.written_bytes = 0  # records written since the last ``take_stats``
        self.pairs = 0

    def bind(self, bound: Callable[[int], torch.Tensor]) -> None:
        """``bound(u)``: unit ``u``'s flat parameter buffer where it is bound right now."""
        self.views = UnitViews(bound)

    @classmethod
    def declare(cls, dtype: torch.dtype, record_bytes: int, records: int, buffers: int) -> StateDecl:
        """The records' file (not checkpointed: rebuilt every step) and their pool."""
        files = (FileDecl(FILE, records * record_bytes, record_bytes=record_bytes),) if records else ()
        return StateDecl(
            "activations", dtype, OWNER, checkpointed=False, host_bytes=buffers * record_bytes, files=files
        )

    @property
    def pool_bytes(self) -> int:
        return self._pool.size_bytes

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._recs

    # -- forward ------------------------------------------------------------------------------------
    def forward(
        self, key: tuple[int, int], slot: int, units: tuple[int, ...], fn: Callable, x: torch.Tensor
    ) -> torch.Tensor:
        """Run ``fn(x)`` with its saved tensors going to record ``slot`` of the file; returns the
        output (detached). The input ``x`` must be in the stash under ``key`` by the backward."""
        if not 0 <= slot < self.records:
            raise ActivationPlanError(
                f"record {slot} of block {key[0]}, micro-batch {key[1]} is outside the {self.records} planned at start"
            )
        buf = self._acquire()
        rec = _Record(key, slot, None, _Box(), buf)
        host = buf.tensor

        def copy(at: int, src: torch.Tensor) -> None:
            dst = host[at : at + src.numel()]
            if self.dev.separate:  # after the compute that made it (download's default); the stream is in order
                rec.copied = self.dev.download(dst, src)
            else:
                dst.copy_(src)

        packer = _Packer(self.views, x, key, self.record_bytes, copy)
        try:
            y, rec.root = _run(self.views, packer, self._unpack, units, fn, x, rec.box)
        except BaseException:  # the buffer back once its downloads ran (it was never given back)
            if rec.copied is not None:
                self.dev.sync(rec.copied)
            buf.release()
            raise
        self._recs[key] = rec
        self.pairs += 1
        self._start_write(rec)
        return y

    def _acquire(self) -> PoolBuffer:
        """A free record buffer, waiting (counted) for the oldest write when every one is busy."""
        while True:
            self._reap(block=False)
            buf = self._pool.try_acquire()
            if buf is not None:
                return buf
            pending = [r for r in self._recs.values() if r.write is not None or (r.buf is not None and r.copied)]
            if not pending and not self._uploading:
                raise RuntimeError(
                    f"all {self._pool.count} activation record buffers are held by records being "
                    "back-propagated; release them after their backward"
                )
            self._reap(block=True)

    def _start_write(self, rec: _Record) -> None:
        if rec.copied is not None and not self.dev.done(rec.copied):
            return  # started by ``_reap`` once its downloads ran
        self.dev.sync(rec.copied)
        rec.copied = None
        rec.write = self._file.pwrite(rec.buf.tensor, self.record_bytes, rec.slot * self.record_bytes)

    def _reap(self, block: bool) -> None:
        """Start writes whose downloads ran; give back the buffers of finished writes and of
        uploads that ran (``block``: wait for the oldest record in flight)."""
        still = []
        for buf, ev in self._uploading:
            if self.dev.done(ev):
                self.dev.release(buf.tensor)
                buf.release()
            else:
                still.append((buf, ev))
        self._uploading = still
        if block and self._uploading:  # the oldest thing in flight: an upload of the backward
            buf, ev = self._uploading.pop(0)
            self.dev.sync(ev)
            self.dev.release(buf.tensor)
            buf.release()
            return
        first = block
        for rec in list(self._recs.values()):
            if rec.buf is None or rec.read is not None or rec.written:
                continue
            if rec.write is None:
                if first:
                    t0 = time.perf_counter()
                    self.dev.sync(rec.copied)
                    self.wait_s += time.perf_counter() - t0
                self._start_write(rec)
                if rec.write is None:
                    continue
            if rec.write.done() or first:
                t0 = time.perf_counter()
                rec.write.get()  # sync point: the record is on the storage tier
                self.wait_s += time.perf_counter() - t0
                self.written_bytes += self.record_bytes
                rec.write, rec.written = None, True
                self.dev.release(rec.buf.tensor)
                rec.buf.release()
                rec.buf = None
                first = False

    # -- backward -----------------------------------------------------------------------------------
    def end_forward(self) -> None:
        """The forward is done: the backward consumes the records blocks last first."""
        self._order = sorted(self._recs, key=lambda k: (-k[0], k[1]))

    def pump(self) -> None:
        """Start reading the next records the backward needs, while buffers are free."""
        self._reap(block=False)
        for key in self._order:
            rec = self._recs[key]
            if rec.read is not None or key in self._loaded:
                continue
            if not rec.written:
                return  # still being written: read in order, later
            buf = self._pool.try_acquire()
            if buf is None:
                return
            rec.buf = buf
            rec.read = self._file.pread(buf.tensor, self.record_bytes, rec.slot * self.record_bytes)

    def backward(self, key: tuple[int, int], grad_out: torch.Tensor) -> torch.Tensor:
        """Back-propagate ``grad_out`` through pair ``key`` (its units bound, its input in the
        stash); returns the gradient of its input and frees the record."""
        rec = self._recs[key]
        while not rec.written:
            self._reap(block=True)
        if rec.read is None:
            self._order.remove(key)
            self._order.insert(0, key)
            self.pump()
            while rec.read is None and self._uploading:
                self._reap(block=True)
                self.pump()
            if rec.read is None:  # every buffer is held by a record being back-propagated
                raise RuntimeError(
                    f"no activation record buffer free to read block {key[0]}, micro-batch {key[1]}: "
                    f"all {self._pool.count} are held; release them after their backward"
                )
        t0 = time.perf_counter()
        rec.read.get()  # sync point: the record is back from the storage tier
        self.wait_s += time.perf_counter() - t0
        self._order.remove(key)
        data, ev = rec.buf.tensor, None
        if self.dev.separate:
            data, ev = self.dev.upload_new(data)
            self.dev.wait(ev)
        self._loaded[key] = data
        self._inputs[key] = self.input_of(key)
        self.pump()  # the next records, while this one computes
        try:
            rec.box.dy = grad_out
            torch.autograd.backward(rec.root, torch.empty(0, device=grad_out.device, dtype=grad_out.dtype))
            dx = rec.box.dx
        finally:
            del self._loaded[key], self._inputs[key], self._recs[key]
            rec.root = None
            if ev is not None:
                self._uploading.append((rec.buf, ev))  # given back once its upload has run, found by query
            else:
                self.dev.release(rec.buf.tensor)
                rec.buf.release()
        return dx

    def _unpack(self, obj):
        if isinstance(obj, _ParamRef):
            return self.views.view(obj)
        if isinstance(obj, _Saved):
            base = self._loaded[obj.key][obj.at : obj.at + obj.nbytes].view(obj.dtype)
            return base.as_strided(obj.size, obj.stride, base.storage_offset() + obj.storage_offset)
        if isinstance(obj, _InputRef):
            x = self._inputs[obj.key]
            return x.as_strided(obj.size, obj.stride, x.storage_offset() + obj.offset)
        return obj

    # -- per step -----------------------------------------------------------------------------------
    def take_stats(self) -> tuple[int, int]:
        """(pairs offloaded, record bytes written) since the last call."""
        out = (self.pairs, self.written_bytes)
        self.pairs = self.written_bytes = 0
        return out

    def clear(self) -> None:
        """Drop every record of a step (one that failed half-way): wait for its I/O."""
        for rec in self._recs.values():
            for fut in (rec.write, rec.read):
                if fut is not None:
                    try:
                        fut.get()
                    except Exception:  # noqa: BLE001 - the step that owned it has failed already
                        pass
            if rec.buf is not None:
                self.dev.sync(rec.copied)
                rec.buf.release()
        self._recs.clear()
        for buf, ev in self._uploading:
            self.dev.sync(ev)
            buf.release()
        self._uploading = []
        self._order, self._loaded, self._inputs = [], {}, {}

    def close(self) -> None:
        self.clear()
        self._file.close()
