"""``StripedFile``: one logical file spread over several storage paths (one per SSD).

Stripe ``k`` (bytes ``[k*S, (k+1)*S)`` of the logical file, ``S = stripe_bytes``) lives
on path ``k % P`` at local offset ``(k // P) * S``. A contiguous logical range therefore
maps, on each path, to one contiguous local range, fed from several pieces of the
caller's buffer: each path gets a single vectored request and all paths work at once.
With one path the local file *is* the logical file.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from . import gds
from .align import ALIGN, as_bytes
from .future import IOFuture, PositionalIO
from .handle import FileHandle
from .workers import IOWorkers

__all__ = ["StripedFile", "local_size"]


def local_size(size: int, path_index: int, paths: int, stripe: int) -> int:
    """Bytes of a ``size``-byte striped file that land on path ``path_index``."""
    full, rest = divmod(size, stripe)
    n = (full // paths + (1 if path_index < full % paths else 0)) * stripe
    if rest and full % paths == path_index:
        n += rest
    return n


class StripedFile(PositionalIO):
    """A logical file striped over ``dirs``; same calls as ``FileHandle``.

    ``workers[i]`` is the thread pool of ``dirs[i]``, shared with the other files there.
    """

    def __init__(
        self,
        dirs: Sequence[str],
        name: str,
        mode: str = "r",
        *,
        workers: Sequence[IOWorkers],
        size: int | None = None,
        stripe_bytes: int = 4 << 20,
        direct: bool = True,
        checksum: bool = False,
        checksum_block: int = 1 << 20,
    ) -> None:
        if len(dirs) != len(workers) or not dirs:
            raise ValueError(f"need one IOWorkers per path: {len(dirs)} paths, {len(workers)} workers")
        if stripe_bytes <= 0 or stripe_bytes % ALIGN:
            raise ValueError(f"stripe_bytes must be a positive multiple of {ALIGN}, got {stripe_bytes}")
        self.name, self.stripe, self.paths = name, stripe_bytes, len(dirs)
        self.handles: list[FileHandle] = []
        try:
            for i, d in enumerate(dirs):
                local = None if size is None else local_size(size, i, self.paths, stripe_bytes)
                self.handles.append(
                    FileHandle(
                        os.path.join(d, name),
                        mode,
                        size=local,
                        direct=direct,
                        checksum=checksum,
                        checksum_block=checksum_block,
                        workers=workers[i],
                    )
                )
        except BaseException:
            for h in self.handles:
                h.close()
            raise

    @property
    def size(self) -> int:
        if self.paths == 1:
            return self.handles[0].size
        return _logical_size([h.size for h in self.handles], self.stripe)

    @property
    def direct(self) -> bool:
        return all(h.direct for h in self.handles)

    def verify(self) -> int:
        return sum(h.verify() for h in self.handles)

    def flush(self) -> None:
        for h in self.handles:
            h.flush()

    def close(self, *, cancel: bool = False) -> None:
        errors = []
        for h in self.handles:
            try:
                h.close(cancel=cancel)
            except BaseException as exc:  # close every handle, then report the first error
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> "StripedFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StripedFile({self.name!r}, paths={self.paths}, stripe={self.stripe}, size={self.size})"

    def _io(self, kind: str, buf: Any, size: int | None, off: int, buf_off: int) -> IOFuture:
        if self.paths == 1:
            return self.handles[0]._io(kind, buf, size, off, buf_off)
        if isinstance(buf, torch.Tensor) and buf.device.type != "cpu" or gds.is_device(buf):
            return self._device_io(kind, buf, size, off, buf_off)
        arr = as_bytes(buf, writable=(kind == "r"))
        size = self._clip(kind, len(arr), size, off, buf_off)
        futs = []
        for i, (local_off, pieces) in self._runs(off, size).items():
            segs = [arr[buf_off + s : buf_off + s + n] for s, n in pieces]
            h = self.handles[i]
            futs.append(h.preadv(segs, local_off) if kind == "r" else h.pwritev(segs, local_off))
        return IOFuture.gather(futs)

    def _device_io(self, kind: str, t: torch.Tensor, size: int | None, off: int, buf_off: int) -> IOFuture:
        """A device tensor: one request per stripe piece, each a contiguous slice of it (the
        handles send each straight to the device or through their staging)."""
        if not t.is_contiguous():
            raise ValueError("tensor must be contiguous for I/O; call .contiguous() first")
        flat = t.detach().reshape(-1).view(torch.uint8)
        size = self._clip(kind, flat.numel(), size, off, buf_off)
        futs = []
        for i, (local_off, pieces) in self._runs(off, size).items():
            for s, n in pieces:  # the pieces of one path follow each other in its local file
                futs.append(self.handles[i]._io(kind, flat[buf_off + s : buf_off + s + n], None, local_off, 0))
                local_off += n
        return IOFuture.gather(futs)

    def _clip(self, kind: str, buf_len: int, size: int | None, off: int, buf_off: int) -> int:
        size = buf_len - buf_off if size is None else size
        if buf_off < 0 or size < 0 or buf_off + size > buf_len:
            raise ValueError(f"buffer range [{buf_off}, {buf_off + size}) is outside the {buf_len}-byte buffer")
        if off < 0:
            raise ValueError(f"file offset must be >= 0, got {off}")
        if kind == "r":  # stop at the logical end, as FileHandle does
            size = max(0, min(size, self.size - off))
        return size

    def _runs(self, off: int, size: int) -> dict[int, tuple[int, list[tuple[int, int]]]]:
        """Per path: (local offset, [(start, length) in the caller's range, ...]) of the
        logical range ``[off, off + size)``."""
        runs: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        pos, end, S, P = off, off + size, self.stripe, self.paths
        while pos < end:
            k, within = divmod(pos, S)
            take = min(S - within, end - pos)
            path, local = k % P, (k // P) * S + within
            if path in runs:
                runs[path][1].append((pos - off, take))
            else:
                runs[path] = (local, [(pos - off, take)])
            pos += take
        return runs


def _logical_size(local_sizes: list[int], stripe: int) -> int:
    """The logical end: the furthest logical byte that any local file holds."""
    end, paths = 0, len(local_sizes)
    for i, n in enumerate(local_sizes):
        if n:
            j = (n - 1) // stripe  # last local stripe that holds data
            end = max(end, (j * paths + i) * stripe + n - j * stripe)
    return end
