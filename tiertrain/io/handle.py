"""``FileHandle``: non-blocking, chunked, direct I/O on one file.

Alignment rules (O_DIRECT): a chunk goes straight between the file and the caller's
memory when its file offset, every buffer address and every buffer length are multiples
of 4 KiB (and, with checksums, it covers whole checksum blocks). Anything else goes
through an aligned bounce buffer: reads read the covering aligned blocks and copy out;
writes read the partial edge blocks, patch them and write whole blocks back, under a
per-block lock so that concurrent writers of neighbouring byte ranges never lose each
other's bytes. Callers never see the difference except in speed.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
import threading
from typing import Any, Sequence

import numpy as np
import torch

from . import devcrc, gds
from .align import ALIGN, aligned_empty, as_bytes, round_down, round_up
from .checksum import ChecksumTable, crc32c, sidecar_bytes, sidecar_path
from .errors import ChecksumError, StorageError, TruncatedFileError
from .future import IOFuture, PositionalIO
from .space import check_space, preallocate
from .workers import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS, IOWorkers

__all__ = ["FileHandle"]

log = logging.getLogger("tiertrain")
_warned_buffered: set[int] = set()
_MODES = {"r": os.O_RDONLY, "r+": os.O_RDWR, "w": os.O_RDWR | os.O_CREAT | os.O_TRUNC}
_IOV_MAX = 512  # well under Linux's 1024


def _open(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    """Open with O_DIRECT when asked and supported; say once per filesystem when it is not."""
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise StorageError.from_os(exc, path, "open", 0, 0) from None
        dev = os.stat(os.path.dirname(os.path.abspath(path))).st_dev
        if dev not in _warned_buffered:
            _warned_buffered.add(dev)
            log.warning("the filesystem of %s does not support O_DIRECT (tmpfs?); using buffered I/O there", path)
    try:
        return os.open(path, flags, 0o644), False
    except OSError as exc:
        raise StorageError.from_os(exc, path, "open", 0, 0) from None


def _advance(segs: list[np.ndarray], n: int) -> list[np.ndarray]:
    """The segments left after the first ``n`` bytes."""
    while segs and n >= len(segs[0]):
        n -= len(segs[0])
        segs = segs[1:]
    if segs and n:
        segs = [segs[0][n:]] + segs[1:]
    return segs


class FileHandle(PositionalIO):
    """One open file, read and written by chunk tasks on a pool of I/O threads.

    ``mode``: ``"r"`` read only; ``"r+"`` read and write an existing file; ``"w"`` create
    or truncate. With ``size`` in mode ``"w"`` the file's space is claimed at once
    (free-space check, then fallocate), so a full disk fails here, naming the path, the
    bytes needed and the bytes free. ``checksum=True`` keeps a CRC32C per
    ``checksum_block`` bytes in ``<path>.crc`` and verifies it on every read; such files
    have a fixed size (given at creation, read from the sidecar afterwards).

    ``workers`` shares a thread pool between the files of one storage path; without it
    the handle makes its own with ``threads`` threads and ``chunk_bytes`` chunks.
    Non-blocking calls (``pread``, ``pwrite``, ``preadv``, ``pwritev``) return an
    ``IOFuture``; ``read`` and ``write`` are the blocking forms. Buffers may be CPU
    tensors of any dtype, numpy arrays or bytes-like objects; CUDA tensors go through
    GPUDirect Storage when kvikio is present, else through pinned staging buffers.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        mode: str = "r",
        *,
        size: int | None = None,
        direct: bool = True,
        checksum: bool = False,
        checksum_block: int = 1 << 20,
        workers: IOWorkers | None = None,
        threads: int = DEFAULT_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.path = os.fspath(path)
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
        if size is not None and (mode != "w" or size < 0):
            raise ValueError(f"size= is for creating a file (mode 'w') and must be >= 0, got {size} in mode {mode!r}")
        if checksum and mode == "w" and size is None:
            raise ValueError("a checksummed file has a fixed size: pass size= when creating it")
        self._own_workers = workers is None
        self.workers = workers or IOWorkers(self.path, threads=threads, chunk_bytes=chunk_bytes)
        if checksum and self.workers.chunk_bytes % checksum_block:
            raise ValueError(f"checksum_block ({checksum_block}) must divide chunk_bytes ({self.workers.chunk_bytes})")
        self.mode, self.writable = mode, mode != "r"
        if mode == "w" and size:
            sidecar = [(sidecar_path(self.path), sidecar_bytes(size, checksum_block))] if checksum else []
            check_space([(self.path, size), *sidecar])
        self._fd, self.direct = _open(self.path, _MODES[mode], direct)
        self._lock = threading.Lock()
        self._inflight: set[cf.Future] = set()
        self._rmw_locks = [threading.Lock() for _ in range(64)]
        self._padded = False
        self._closed = False
        self._dirty = False
        self._cufile = None
        try:
            self._init_size_and_table(mode, size, checksum, checksum_block)
        except BaseException:
            os.close(self._fd)
            raise

    def _init_size_and_table(self, mode: str, size: int | None, checksum: bool, block: int) -> None:
        self._table: ChecksumTable | None = None
        actual = os.fstat(self._fd).st_size
        if mode == "w":
            self._size = size or 0
            if size:
                preallocate(self._fd, size, self.path)
            if checksum:
                self._table = ChecksumTable(self._size, block)
                self._dirty = True
                if size:  # its room claimed now, as the data's: later saves rewrite it in place
                    self._table.save(sidecar_path(self.path))
        elif checksum:
            self._table = ChecksumTable.load(sidecar_path(self.path))
            self._size = self._table.size
            if actual < self._size:
                raise TruncatedFileError(self.path, self._size, actual)
        else:
            self._size = actual
        self.fixed_size = self._table is not None

    # -- public API ----------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Logical size in bytes (fixed for checksummed files; grows with writes otherwise)."""
        return self._size

    @property
    def checksummed(self) -> bool:
        return self._table is not None

    def preadv(self, segments: Sequence[np.ndarray], file_offset: int) -> IOFuture:
        """Read the file range starting at ``file_offset`` into several uint8 arrays in turn."""
        return IOFuture(self._submit("r", file_offset, list(segments)))

    def pwritev(self, segments: Sequence[np.ndarray], file_offset: int) -> IOFuture:
        """Write several uint8 arrays, one after another, starting at ``file_offset``."""
        return IOFuture(self._submit("w", file_offset, list(segments)))

    def checksums(self, offset: int, length: int) -> tuple[int, list[int]]:
        """(first block, CRC32C of every block) covering ``[offset, offset + length)``: what a
        reader of this file in another process needs after this process wrote there."""
        t = self._table
        first, last = offset // t.block, -(-(offset + length) // t.block)
        return first, [int(c) for c in t.crcs[first:last]]

    def set_checksums(self, first: int, values: list[int]) -> None:
        """Take block checksums computed by the writer of this file in another process."""
        with self._lock:
            self._table.crcs[first : first + len(values)] = values

    def verify(self) -> int:
        """Read the whole file and check every checksum block. Returns bytes checked."""
        if self._table is None:
            raise ValueError(f"{self.path} was opened without checksums; nothing to verify")
        # a buffer of its own: a read of an unaligned tail takes a bounce buffer (holding one of the
        # pool here hung with one buffer, or two verifies at once)
        buf, checked = aligned_empty(self.workers.chunk_bytes), 0
        for off in range(0, self._size, self.workers.chunk_bytes):
            checked += self.read(buf, min(self.workers.chunk_bytes, self._size - off), off)
        return checked

    def flush(self) -> None:
        """Wait for in-flight writes, make data durable (fsync) and save the checksum table."""
        self._wait_all()
        self._finish_writes()
        try:
            os.fsync(self._fd)
        except OSError as exc:  # (a bare "[Errno 5] Input/output error" named no file)
            raise StorageError.from_os(exc, self.path, "fsync", 0, self._size) from None

    def close(self, *, cancel: bool = False) -> None:
        """Wait for work in flight (``cancel=True`` drops what has not started), then close.

        The checksum table is saved if anything was written. Safe to call twice.
        """
        if self._closed:
            return
        try:
            if cancel:
                for f in list(self._inflight):
                    f.cancel()
            self._wait_all()
            self._finish_writes()
        finally:
            self._closed = True
            if self._cufile is not None:
                self._cufile.close()
            os.close(self._fd)
            if self._own_workers:
                self.workers.shutdown()

    def __enter__(self) -> "FileHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileHandle({self.path!r}, {self.mode!r}, size={self._size}, direct={self.direct})"

    # -- request splitting ----------------------------------------------------------------
    def _io(self, kind: str, buf: Any, size: int | None, file_offset: int, buf_offset: int) -> IOFuture:
        if gds.is_device(buf) or (isinstance(buf, torch.Tensor) and buf.device.type == "cuda"):
            return self._device_io(kind, buf, size, file_offset, buf_offset)
        arr = as_bytes(buf, writable=(kind == "r"))
        if size is None:
            size = len(arr) - buf_offset
        if buf_offset < 0 or size < 0 or buf_offset + size > len(arr):
            raise ValueError(f"buffer range [{buf_offset}, {buf_offset + size}) is outside the {len(arr)}-byte buffer")
        return IOFuture(self._submit(kind, file_offset, [arr[buf_offset : buf_offset + size]]))

    def _check(self, kind: str, off: int, n: int) -> int:
        if self._closed:
            raise ValueError(f"I/O on closed file {self.path}")
        if off < 0:
            raise ValueError(f"file offset must be >= 0, got {off}")
        if kind == "w":
            if not self.writable:
                raise ValueError(f"{self.path} is open read-only (mode 'r'); open it with 'r+' to write")
            if self.fixed_size and off + n > self._size:
                raise ValueError(
                    f"write of {n} bytes at offset {off} runs past the end of {self.path} (fixed size {self._size})"
                )
            return n
        # reads stop at the logical end, never at O_DIRECT padding past it
        return max(0, min(n, self._size - off))

    def _submit(self, kind: str, off: int, segs: list[np.ndarray]) -> list[cf.Future]:
        total = sum(len(s) for s in segs)
        n = self._check(kind, off, total)
        if n < total:
            segs = _truncate(segs, n)
        if n == 0:
            return [_completed(0)]
        futures = []
        for c_off, c_segs in _split(off, segs, self.workers.chunk_bytes):
            f = self.workers.submit(self._task, kind, c_off, c_segs)
            with self._lock:
                self._inflight.add(f)
            f.add_done_callback(self._done)
            futures.append(f)
        return futures

    def _done(self, f: cf.Future) -> None:
        with self._lock:
            self._inflight.discard(f)

    def _wait_all(self) -> None:
        while True:
            with self._lock:
                pending = list(self._inflight)
            if not pending:
                return
            cf.wait(pending)

    def _finish_writes(self) -> None:
        if not self.writable:
            return
        if self._padded:  # O_DIRECT wrote whole pages past the logical end; cut them off
            try:
                os.ftruncate(self._fd, self._size)
            except OSError as exc:
                raise StorageError.from_os(exc, self.path, "truncate", self._size, 0) from None
            self._padded = False
        if self._table is not None and self._dirty:
            with self._lock:  # cleared before the snapshot: a commit meanwhile marks it again
                self._dirty = False
            self._table.save(sidecar_path(self.path))

    # -- chunk tasks (run on I/O threads) --------------------------------------------------
    def _task(self, kind: str, off: int, segs: list[np.ndarray]) -> int:
        stats, n, done = self.workers.stats, sum(len(s) for s in segs), 0
        stats.begin(kind)
        try:
            done = self._read_chunk(off, segs, n) if kind == "r" else self._write_chunk(off, segs, n)
            return done
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError.from_os(exc, self.path, "read" if kind == "r" else "write", off, n) from None
        finally:
            stats.end(kind, done)

    def _gran(self) -> int:
        return self._table.block if self._table is not None else ALIGN

    def _straight(self, off: int, segs: list[np.ndarray], n: int) -> bool:
        """Can this chunk go between the file and the caller's memory without a bounce buffer?"""
        if self._table is not None:
            b = self._table.block
            if off % b or ((off + n) % b and off + n != self._size):
                return False
        if not self.direct:
            return True
        return off % ALIGN == 0 and all(s.ctypes.data % ALIGN == 0 and len(s) % ALIGN == 0 for s in segs)

    def _block_locks(self, lo: int, hi: int) -> list[threading.Lock]:
        """The locks of the ``gran``-sized blocks in ``[lo, hi)``, in acquisition order.

        Partial-block writers hold their edge blocks' locks while they read, patch, write
        and re-checksum; readers that verify a block hold its lock, so they never see the
        data of one version with the checksum of another.
        """
        gran = self._gran()
        idx = sorted({(b // gran) % len(self._rmw_locks) for b in range(round_down(lo, gran), hi, gran)})
        return [self._rmw_locks[i] for i in idx]

    def _read_chunk(self, off: int, segs: list[np.ndarray], n: int) -> int:
        if self._table is None:
            return self._read_unlocked(off, segs, n)
        locks = self._block_locks(off, off + n)
        for lock in locks:
            lock.acquire()
        try:
            return self._read_unlocked(off, segs, n)
        finally:
            for lock in reversed(locks):
                lock.release()

    def _read_unlocked(self, off: int, segs: list[np.ndarray], n: int) -> int:
        if self._straight(off, segs, n):
            got = self._preadv_full(segs, off)
            if self._table is not None:
                self._verify(off, segs, n, got)
            return got
        gran = self._gran()
        lo, hi = round_down(off, gran), round_up(off + n, gran)
        with self.workers.bounce().acquire() as bounce:
            view = bounce.tensor.numpy()[: hi - lo]
            got = self._preadv_full([view], lo)
            if self._table is not None:
                self._verify(lo, [view], min(hi, self._size) - lo, got)
            avail = max(0, min(off + n, lo + got) - off)
            _scatter(view[off - lo : off - lo + avail], segs)
            return avail

    def _write_chunk(self, off: int, segs: list[np.ndarray], n: int) -> int:
        if self._straight(off, segs, n):
            crcs = self._crcs(off, segs, n)
            self._pwritev_full(segs, off)
            self._commit(off + n, off, crcs)
            return n
        gran = self._gran()
        lo, hi = round_down(off, gran), round_up(off + n, gran)
        edges = sorted({b for b, partial in ((lo, off > lo), (hi - gran, off + n < hi)) if partial})
        locks = sorted({(b // gran) % len(self._rmw_locks) for b in edges})
        for i in locks:  # ascending order everywhere: no deadlock between tasks
            self._rmw_locks[i].acquire()
        try:
            with self.workers.bounce().acquire() as bounce:
                view = bounce.tensor.numpy()[: hi - lo]
                for b in edges:  # read the bytes of the edge blocks that this write must keep
                    part = view[b - lo : b - lo + gran]
                    got = self._preadv_full([part], b)
                    part[got:] = 0
                    if self._table is not None:  # never bless corrupt bytes with a new checksum
                        self._verify(b, [part], min(gran, self._size - b), got)
                _gather(segs, view[off - lo : off - lo + n])
                end = max(self._size, off + n)
                crcs = self._crcs(lo, [view[: min(hi, end) - lo]], min(hi, end) - lo)
                # O_DIRECT: whole pages, not the whole checksum block (a 100-byte tail took 1 MiB past the
                # space claimed until close cut it off)
                wlen = round_up(min(hi, end), ALIGN) - lo if self.direct else min(hi, end) - lo
                self._pwritev_full([view[:wlen]], lo)
                self._commit(off + n, lo, crcs, padded=lo + wlen > end)
            return n
        finally:
            for i in reversed(locks):
                self._rmw_locks[i].release()

    def _commit(self, end: int, lo: int, crcs: list[int] | None, padded: bool = False) -> None:
        with self._lock:
            self._size = max(self._size, end)
            self._padded |= padded
            if crcs is not None:
                first = lo // self._table.block
                for i, c in enumerate(crcs):
                    self._table.set(first + i, c)
                self._dirty = True

    # -- checksums ---------------------------------------------------------------------------
    def _blocks(self, lo: int, segs: list[np.ndarray], n: int):
        """Yield (block index, block length, the slices of ``segs`` that hold it)."""
        t, segs, pos = self._table, list(segs), lo
        while pos < lo + n:
            i = pos // t.block
            blen = t.block_len(i)
            take, parts = blen, []
            while take and segs:
                k = min(take, len(segs[0]))
                parts.append(segs[0][:k])
                segs = _advance(segs, k)
                take -= k
            yield i, blen, parts, blen - take
            pos += blen

    def _crcs(self, lo: int, segs: list[np.ndarray], n: int) -> list[int] | None:
        if self._table is None:
            return None
        return [crc32c(parts) for _, _, parts, _ in self._blocks(lo, segs, n)]

    def _verify(self, lo: int, segs: list[np.ndarray], want: int, got: int) -> None:
        """Check the blocks of ``[lo, lo + want)``, of which ``got`` bytes were read into ``segs``."""
        for i, blen, parts, have in self._blocks(lo, _truncate(segs, got), max(0, want)):
            if have < blen:
                raise TruncatedFileError(self.path, self._size, i * self._table.block + have)
            actual, expected = crc32c(parts), self._table.expected(i)
            if actual != expected:
                raise ChecksumError(self.path, i * self._table.block, blen, expected, actual)

    # -- system calls --------------------------------------------------------------------------
    def _preadv_full(self, segs: list[np.ndarray], off: int) -> int:
        done, want = 0, sum(len(s) for s in segs)
        while segs:
            batch = segs[:_IOV_MAX]
            n = os.preadv(self._fd, batch, off)
            if n == 0:
                break
            done, off = done + n, off + n
            segs = _advance(segs, n)
            if self.direct and n < sum(len(s) for s in batch) and n % ALIGN:
                break  # end of file inside a block: O_DIRECT cannot go on from an unaligned offset
        return min(done, want)

    def _pwritev_full(self, segs: list[np.ndarray], off: int) -> None:
        while segs:
            n = os.pwritev(self._fd, segs[:_IOV_MAX], off)
            if n == 0:
                raise OSError(errno.EIO, "write made no progress")
            off += n
            segs = _advance(segs, n)

    # -- device tensors -----------------------------------------------------------------------------
    def _device_io(self, kind: str, t: torch.Tensor, size: int | None, off: int, buf_off: int) -> IOFuture:
        if not t.is_contiguous():
            raise ValueError("tensor must be contiguous for I/O; call .contiguous() first")
        flat = t.detach().reshape(-1).view(torch.uint8)
        size = flat.numel() - buf_off if size is None else size
        if buf_off < 0 or size < 0 or buf_off + size > flat.numel():
            raise ValueError(f"buffer range [{buf_off}, {buf_off + size}) is outside the {flat.numel()}-byte tensor")
        n = self._check(kind, off, size)
        direct = gds.enabled()
        if direct and self._cufile is None:
            with self._lock:  # one kvikio handle per file, whichever thread asks first
                if self._cufile is None:
                    self._cufile = gds.open_file(self.path, self.writable)
        futures = []
        for c_off, c_len in _ranges(off, n, self.workers.chunk_bytes):
            dev = flat[buf_off + c_off - off : buf_off + c_off - off + c_len]
            task = self._direct if direct and self._whole_blocks(c_off, c_len) else self._staged
            f = self.workers.submit(task, kind, dev, c_off)
            with self._lock:
                self._inflight.add(f)
            f.add_done_callback(self._done)
            futures.append(f)
        return IOFuture(futures)

    def _whole_blocks(self, off: int, n: int) -> bool:
        """Whether ``[off, off + n)`` is whole checksum blocks (always, without checksums):
        the direct path checks or computes a block's CRC only over the whole block."""
        if self._table is None:
            return True
        b = self._table.block
        if b % devcrc.PIECE:  # the device CRC works on whole 4 KiB pieces
            return False
        return off % b == 0 and (n % b == 0 or off + n == self._size)

    def _kvikio(self, op: str, dev: torch.Tensor, off: int) -> int:
        """kvikio's ``pread``/``pwrite`` of all of ``dev`` at ``off``; its errors name the file."""
        try:
            return getattr(self._cufile, op)(dev, dev.numel(), off).get()
        except Exception as exc:  # noqa: BLE001 - kvikio raises RuntimeError subclasses without the path
            raise StorageError(
                errno.EIO,
                self.path,
                f"GPUDirect Storage {op} of {dev.numel()} bytes at offset {off} of {self.path} failed: {exc}",
            ) from exc

    def _direct(self, kind: str, dev: torch.Tensor, off: int) -> int:
        """One chunk between the file and device memory through kvikio (on an I/O thread);
        checksums computed or verified on the device."""
        self.workers.stats.begin(kind)
        n = 0
        try:
            if kind == "w":
                crcs = devcrc.block_crcs(dev, self._table.block) if self._table is not None else None
                n = self._kvikio("pwrite", dev, off)
                if n != dev.numel():
                    raise StorageError(errno.EIO, self.path, f"short write through kvikio ({n} of {dev.numel()} bytes)")
                self._commit(off + n, off, crcs)
                return n
            n = self._kvikio("pread", dev, off)
            if self._table is not None:
                if n < dev.numel():
                    raise TruncatedFileError(self.path, self._size, off + n)
                first = off // self._table.block
                for i, actual in enumerate(devcrc.block_crcs(dev, self._table.block)):
                    if actual != self._table.expected(first + i):
                        blen = self._table.block_len(first + i)
                        raise ChecksumError(
                            self.path, (first + i) * self._table.block, blen, self._table.expected(first + i), actual
                        )
            return n
        finally:
            self.workers.stats.end(kind, n)

    def _staged(self, kind: str, dev: torch.Tensor, off: int) -> int:
        # Runs the chunk in this thread: waiting here on tasks queued behind us could deadlock.
        # The copies run on this thread's side stream, not behind the compute stream's kernels.
        with self.workers.staging().acquire() as stage:
            host = stage.tensor[: dev.numel()]
            if kind == "w":
                with devcrc.side_stream(dev, after_compute=True):  # after the kernels that made it
                    host.copy_(dev)  # sync point: the device-to-host copy completes before the write
                return self._task("w", off, [host.numpy()])
            got = self._task("r", off, [host.numpy()])
            with devcrc.side_stream(dev):
                dev[:got].copy_(host[:got])  # sync point: a blocking copy, done when the future is
            return got


def _completed(n: int) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(n)
    return f


def _ranges(off: int, n: int, chunk: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of ``[off, off + n)`` cut at multiples of ``chunk``."""
    out, pos = [], off
    while pos < off + n:
        end = min(off + n, (pos // chunk + 1) * chunk)
        out.append((pos, end - pos))
        pos = end
    return out


def _split(off: int, segs: list[np.ndarray], chunk: int) -> list[tuple[int, list[np.ndarray]]]:
    """Cut a file range into pieces that end at file offsets that are multiples of ``chunk``."""
    pieces, cur, cur_off, pos = [], [], off, off
    for seg in segs:
        i = 0
        while i < len(seg):
            boundary = (pos // chunk + 1) * chunk
            take = min(len(seg) - i, boundary - pos)
            cur.append(seg[i : i + take])
            i, pos = i + take, pos + take
            if pos == boundary:
                pieces.append((cur_off, cur))
                cur, cur_off = [], pos
    if cur:
        pieces.append((cur_off, cur))
    return pieces


def _truncate(segs: list[np.ndarray], n: int) -> list[np.ndarray]:
    out = []
    for s in segs:
        if n <= 0:
            break
        out.append(s[:n])
        n -= len(out[-1])
    return out


def _scatter(src: np.ndarray, segs: list[np.ndarray]) -> None:
    pos = 0
    for s in segs:
        k = min(len(s), len(src) - pos)
        if k <= 0:
            break
        np.copyto(s[:k], src[pos : pos + k])
        pos += k


def _gather(segs: list[np.ndarray], dst: np.ndarray) -> None:
    pos = 0
    for s in segs:
        np.copyto(dst[pos : pos + len(s)], s)
        pos += len(s)
