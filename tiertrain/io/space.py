"""Claiming disk space at start, so a full disk is found before training, not during it."""

from __future__ import annotations

import errno
import os
import shutil
from collections import defaultdict
from typing import Callable, Iterable, TypeVar

from .errors import OutOfSpaceError, StorageError

__all__ = ["check_space", "preallocate", "free_bytes", "existing_dir", "device_of"]

T = TypeVar("T")


def existing_dir(path: str) -> str:
    """The nearest directory at or above ``path`` that exists (where its filesystem is)."""
    d = os.path.abspath(path)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    return d if os.path.isdir(d) else os.path.dirname(d)


def _at_existing(path: str, fn: Callable[[str], T]) -> T:
    """``fn`` of the nearest existing directory at or above ``path``; again one level up where
    that directory goes meanwhile (another process's clean-up: ranks failing at start)."""
    while True:
        d = existing_dir(path)
        try:
            return fn(d)
        except FileNotFoundError:
            path = os.path.dirname(d)


def free_bytes(path: str) -> int:
    """Bytes free to this user on the filesystem that holds ``path`` (or would hold it)."""
    return _at_existing(path, lambda d: shutil.disk_usage(d).free)


def device_of(path: str) -> int:
    """The filesystem (``st_dev``) that holds ``path``, or would hold it."""
    return _at_existing(path, lambda d: os.stat(d).st_dev)


def _allocated(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def check_space(needs: Iterable[tuple[str, int]], *, reserve: int = 0) -> None:
    """Raise ``OutOfSpaceError`` unless every filesystem can hold the bytes asked of it.

    ``needs`` lists ``(path, bytes)``; paths on the same filesystem are added up, and
    bytes already allocated to an existing file at that path count as available (the
    file will be reused). ``reserve`` is kept free on each filesystem besides.
    """
    per_fs: dict[int, list] = defaultdict(lambda: [None, 0])
    for path, nbytes in needs:
        existing = _allocated(path)
        entry = per_fs[device_of(path)]
        entry[0] = entry[0] or path
        entry[1] += max(0, nbytes - existing)
    for path, needed in per_fs.values():
        free = free_bytes(path)
        if needed + reserve > free:
            raise OutOfSpaceError(path, needed + reserve, free)


def preallocate(fd: int, size: int, path: str) -> None:
    """Give the open file ``size`` bytes of real disk blocks now (posix_fallocate).

    Unlike ftruncate, which makes a sparse file that can still fail with ENOSPC on a
    later write, this reserves the blocks: later writes inside ``size`` cannot run out of
    space. Filesystems without fallocate support get glibc's emulation (zero writes).
    """
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OutOfSpaceError(path, size, free_bytes(path)) from None
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # e.g. some network filesystems
            os.ftruncate(fd, size)
            return
        raise StorageError.from_os(exc, path, "preallocation", 0, size) from None
