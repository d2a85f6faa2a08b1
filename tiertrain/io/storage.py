"""``Storage``: the storage tier of a run, one or more directories (one per SSD)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from .checksum import sidecar_bytes, sidecar_path
from .space import check_space
from .stats import StatsSnapshot
from .stripe import StripedFile, local_size
from .workers import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS, IOWorkers

if TYPE_CHECKING:  # the I/O layer reads the config section, never imports the config at run time
    from ..config import IOConfig

__all__ = ["Storage", "record_align"]


def record_align(checksum: bool, checksum_block: int) -> int:
    """``Storage.record_align`` of a storage with these settings (known before it exists)."""
    return checksum_block if checksum else 4096


class Storage:
    """Directories on one or more SSDs, each with its own I/O threads and counters.

    Files made here are striped over every path, preallocated to their full size (so
    space is claimed when they are created), and checksummed when ``checksum`` is on.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        threads: int = DEFAULT_THREADS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        stripe_bytes: int = 4 << 20,
        direct: bool = True,
        checksum: bool = True,
        checksum_block: int = 1 << 20,
        bounce_buffers: int = 2,
    ) -> None:
        if not paths:
            raise ValueError("Storage needs at least one path")
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        if len(set(self.paths)) != len(self.paths):
            raise ValueError(f"storage paths must be distinct, got {self.paths}")
        for p in self.paths:
            os.makedirs(p, exist_ok=True)
        self.stripe_bytes, self.direct = stripe_bytes, direct
        self.checksum, self.checksum_block = checksum, checksum_block
        self.workers = [
            IOWorkers(p, threads=threads, chunk_bytes=chunk_bytes, bounce_buffers=bounce_buffers) for p in self.paths
        ]

    @classmethod
    def from_config(cls, cfg: IOConfig, paths: Sequence[str] | None = None) -> Storage:
        return cls(
            paths if paths is not None else cfg.paths,
            threads=cfg.threads,
            chunk_bytes=cfg.chunk_kib << 10,
            stripe_bytes=cfg.stripe_kib << 10,
            direct=cfg.direct,
            checksum=cfg.checksum,
            checksum_block=cfg.checksum_block_kib << 10,
        )

    def _kw(self, checksum: bool | None, block: int | None) -> dict:
        return dict(
            workers=self.workers,
            stripe_bytes=self.stripe_bytes,
            direct=self.direct,
            checksum=self.checksum if checksum is None else checksum,
            checksum_block=block or self.checksum_block,
        )

    @property
    def record_align(self) -> int:
        """Alignment, in bytes, that keeps records of a file on whole checksum blocks (and
        O_DIRECT blocks): requests on such records never need a read-modify-write."""
        return record_align(self.checksum, self.checksum_block)

    def block_for(self, record_bytes: int) -> int:
        """A checksum block for files of ``record_bytes``-sized records (a multiple of 4 KiB):
        the largest power of two dividing the record, at most the storage's block."""
        return min(self.checksum_block, record_bytes & -record_bytes)

    def create(
        self, name: str, size: int, *, checksum: bool | None = None, checksum_block: int | None = None
    ) -> StripedFile:
        """Make (or replace) file ``name`` of ``size`` bytes on every path, space claimed now."""
        return StripedFile(self.paths, name, "w", size=size, **self._kw(checksum, checksum_block))

    def open(
        self, name: str, mode: str = "r+", *, checksum: bool | None = None, checksum_block: int | None = None
    ) -> StripedFile:
        """Open an existing file made by ``create``."""
        return StripedFile(self.paths, name, mode, **self._kw(checksum, checksum_block))

    def exists(self, name: str) -> bool:
        return all(os.path.exists(os.path.join(p, name)) for p in self.paths)

    def remove(self, name: str) -> None:
        for p in self.paths:
            for f in (os.path.join(p, name), os.path.join(p, name) + ".crc"):
                if os.path.exists(f):
                    os.remove(f)

    def space_needs(
        self,
        files: Iterable[tuple[str, int]],
        *,
        placed: Iterable[tuple[str, int]] = (),
        records: Mapping[str, int] | None = None,
    ) -> list[tuple[str, int]]:
        """``(path, bytes)`` of every path's share of ``files`` (``(name, size)``, striped) and of
        ``placed`` (``(full path, size)``, a file on one path: the update engines'), each with its
        checksum sidecar where this storage checksums (``records``: name -> record bytes of the
        files checksummed per record, ``block_for``)."""
        needs = []
        for name, size in files:
            block = self.block_for(records[name]) if records and name in records else self.checksum_block
            for i, p in enumerate(self.paths):
                needs += self._with_sidecar(
                    os.path.join(p, name), local_size(size, i, len(self.paths), self.stripe_bytes), block
                )
        for path, size in placed:
            needs += self._with_sidecar(path, size, self.checksum_block)
        return needs

    def _with_sidecar(self, path: str, size: int, block: int) -> list[tuple[str, int]]:
        if not self.checksum or not size:
            return [(path, size)]
        return [(path, size), (sidecar_path(path), sidecar_bytes(size, block))]

    def check_space(self, files: Iterable[tuple[str, int]]) -> None:
        """Raise ``OutOfSpaceError`` now unless every path can hold its share of ``files``."""
        check_space(self.space_needs(files))

    def stats(self) -> dict[str, StatsSnapshot]:
        """Counters per path (bytes and busy seconds per direction) since start."""
        return {w.name: w.stats.snapshot() for w in self.workers}

    def total(self) -> StatsSnapshot:
        out = StatsSnapshot()
        for s in self.stats().values():
            out = out + s
        return out

    @property
    def pool_bytes(self) -> int:
        """Host memory held by bounce/staging buffers of all paths."""
        return sum(w.pool_bytes for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()

    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
