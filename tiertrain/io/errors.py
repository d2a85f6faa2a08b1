"""Errors of the storage tier. All are ``OSError`` subclasses carrying errno and path."""

from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "StorageError",
    "ChecksumError",
    "TruncatedFileError",
    "OutOfSpaceError",
    "human_bytes",
    "run_dir_write_failed",
]


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units with three significant figures (``2.65 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"


class StorageError(OSError):
    """An I/O request failed. ``errno`` and ``filename`` are those of the failing call."""

    quiet = False  # with ranks: another rank of this machine reports the same, this one need not

    def __init__(self, err: int, path: str, message: str, offset: int | None = None) -> None:
        super().__init__(err, message, path)
        self.offset = offset

    @classmethod
    def from_os(cls, exc: OSError, path: str, op: str, offset: int, length: int) -> "StorageError":
        """Wrap an error of a system call, keeping its errno."""
        err = exc.errno or _errno.EIO
        return cls(err, path, f"{op} of {length} bytes at offset {offset} of {path} failed: {os.strerror(err)}", offset)

    def __str__(self) -> str:
        return f"[Errno {self.errno}] {self.strerror}"

    def __reduce__(self):  # subclasses take other __init__ arguments; rebuild without calling them
        return (_rebuild, (type(self), self.errno, self.filename, self.strerror, self.offset, dict(self.__dict__)))


def run_dir_write_failed(path: str, what: str, exc: OSError) -> StorageError:
    """Writing ``what`` (a run directory's file ``path``) failed: one line naming the file and
    the fix (a full disk: make room or give the run another directory)."""
    err = exc.errno or _errno.EIO
    fix = (
        "free space on its filesystem or give the run another --train.run_dir"
        if err in (_errno.ENOSPC, _errno.EDQUOT)
        else "check the run directory (train.run_dir) is writable"
    )
    return StorageError(err, path, f"writing {what} to {path} failed: {os.strerror(err)}; {fix}")


def _rebuild(cls: type, err: int, path: str, message: str, offset: int | None, state: dict) -> StorageError:
    exc = OSError.__new__(cls, err, message, path)
    StorageError.__init__(exc, err, path, message, offset)
    exc.__dict__.update(state)
    return exc


class ChecksumError(StorageError):
    """Data read back does not match the checksum stored beside it."""

    def __init__(self, path: str, offset: int, length: int, expected: int, actual: int) -> None:
        super().__init__(
            _errno.EIO,
            path,
            f"checksum mismatch in {path} at offset {offset} (block of {length} bytes): "
            f"expected crc32c {expected:#010x}, found {actual:#010x}; the file is corrupt",
            offset,
        )
        self.expected, self.actual = expected, actual


class TruncatedFileError(StorageError):
    """A file is shorter than its recorded size."""

    def __init__(self, path: str, expected: int, actual: int) -> None:
        msg = f"{path} is truncated: expected {expected} bytes, found {actual} (data ends at offset {actual})"
        super().__init__(_errno.EIO, path, msg, actual)
        self.expected, self.actual = expected, actual


class OutOfSpaceError(StorageError):
    """Not enough free space to claim the files a run needs."""

    def __init__(self, path: str, needed: int, free: int, detail: str = "") -> None:
        super().__init__(
            _errno.ENOSPC,
            path,
            f"not enough space on the filesystem of {path}: need {needed} bytes ({human_bytes(needed)}"
            f"{'; ' + detail if detail else ''}), {free} bytes free ({human_bytes(free)}); free "
            f"{human_bytes(needed - free)} more or choose another path",
        )
        self.needed, self.free = needed, free
