"""Per-block CRC32C checksums, stored in a sidecar file beside the data.

Layout of ``<file>.crc``: a 40-byte header (magic, version, block size, data size, block
count, crc32c of the rest) followed by one little-endian uint32 per block. Block ``i``
covers bytes ``[i*block, min((i+1)*block, size))`` of the data file. The sidecar is
replaced atomically (temp file, fsync, rename), so it is either the old table or the new.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from typing import Iterable

import numpy as np

try:
    import crc32c as _crc
except ImportError as _exc:  # one message wherever tiertrain is first imported
    raise ImportError(
        "tiertrain needs the crc32c package (its checksums): pip install crc32c; on a machine without a "
        "network, carry its wheel along (bench/gpu_window/wheels.sh downloads it into .whl/)"
    ) from _exc

from .align import ALIGN, round_up
from .errors import OutOfSpaceError, StorageError
from .space import free_bytes

__all__ = ["ChecksumTable", "crc32c", "sidecar_path", "sidecar_bytes"]

_MAGIC = b"TTCRC32C"
_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, reserved, block, size, nblocks
_VERSION = 1


def crc32c(data: Iterable[np.ndarray] | np.ndarray, value: int = 0) -> int:
    """CRC32C of one buffer or of several buffers in sequence (GIL released on large ones)."""
    if isinstance(data, np.ndarray):
        return _crc.crc32c(data, value)
    for part in data:
        value = _crc.crc32c(part, value)
    return value


def sidecar_path(path: str) -> str:
    return path + ".crc"


def sidecar_bytes(size: int, block: int) -> int:
    """Disk space the sidecar of a ``size``-byte file checksummed per ``block`` bytes needs: the
    table and, while a save replaces it, its new copy, each in whole 4 KiB filesystem blocks
    (claimed with the file: a disk filled to the data's size failed at the first save)."""
    return 2 * round_up(_HEADER.size + 4 + 4 * -(-size // block), 4096)


class ChecksumTable:
    """The CRC32C of every ``block``-byte block of a file of fixed ``size``."""

    def __init__(self, size: int, block: int, crcs: np.ndarray | None = None) -> None:
        if block <= 0 or block % ALIGN:
            raise ValueError(f"checksum block must be a positive multiple of {ALIGN}, got {block}")
        self.size, self.block = size, block
        self.nblocks = -(-size // block)
        self._lock = threading.Lock()
        if crcs is None:
            crcs = np.full(self.nblocks, self._zero_crc(block), dtype=np.uint32)
            if self.nblocks and size % block:
                crcs[-1] = self._zero_crc(size % block)
        self.crcs = crcs

    @staticmethod
    def _zero_crc(n: int) -> int:
        return _crc.crc32c(bytes(n))

    def block_len(self, i: int) -> int:
        return min(self.block, self.size - i * self.block)

    def set(self, i: int, value: int) -> None:
        self.crcs[i] = value

    def expected(self, i: int) -> int:
        return int(self.crcs[i])

    # -- persistence -------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        body = self.crcs.astype("<u4").tobytes()
        head = _HEADER.pack(_MAGIC, _VERSION, 0, self.block, self.size, self.nblocks)
        return head + struct.pack("<I", _crc.crc32c(body, _crc.crc32c(head))) + body

    def save(self, path: str) -> None:
        """Write the sidecar at ``path``: a new one atomically (temp file, fsync, rename); one
        already there at its size rewritten in place (fsync). The temporary copy of a rewrite
        needed room never claimed: a disk filled during a run failed the engines' next save and
        lost the run. In place is safe: a table cut by a crash fails its own CRC (named damaged,
        never taken as valid), and the files whose tables are rewritten are a run's scratch
        (replaced after a crash) or written under a temporary name until complete."""
        with self._lock:
            data = self.to_bytes()
        try:
            if os.path.getsize(path) == len(data):
                fd = os.open(path, os.O_WRONLY)
                try:
                    if os.pwrite(fd, data, 0) != len(data):
                        raise OSError(errno.EIO, os.strerror(errno.EIO))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                return
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._save_error(exc, path, None, len(data)) from None
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            raise self._save_error(exc, path, tmp, len(data)) from None

    @staticmethod
    def _save_error(exc: OSError, path: str, tmp: str | None, size: int) -> StorageError:
        """A failed save, named (the bare OSError named no file), its temporary copy removed."""
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            need = round_up(size, 4096)  # a filesystem block
            return OutOfSpaceError(path, need, free_bytes(path), "the checksum table of its data file")
        err = exc.errno or errno.EIO
        return StorageError(err, path, f"saving the checksum table {path} failed: {os.strerror(err)}")

    @classmethod
    def load(cls, path: str) -> "ChecksumTable":
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise StorageError(
                errno.ENOENT, path, f"checksum file {path} is missing (was the data written with checksum=False?)"
            ) from None
        n = _HEADER.size + 4
        if len(data) < n:
            raise StorageError(errno.EIO, path, f"checksum file {path} is truncated ({len(data)} bytes)")
        magic, version, _, block, size, nblocks = _HEADER.unpack_from(data)
        (stored,) = struct.unpack_from("<I", data, _HEADER.size)
        body = data[n:]
        if magic != _MAGIC or version != _VERSION:
            raise StorageError(errno.EIO, path, f"{path} is not a tiertrain checksum file (bad magic or version)")
        if len(body) != 4 * nblocks or _crc.crc32c(body, _crc.crc32c(data[: _HEADER.size])) != stored:
            raise StorageError(errno.EIO, path, f"checksum file {path} is corrupt (its own crc32c does not match)")
        return cls(size, block, np.frombuffer(body, dtype="<u4").astype(np.uint32))
