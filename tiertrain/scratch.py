"""Directories a run owns: one run per scratch directory and per run directory, and what a
dead run left behind.

``DirLock`` is an exclusive ``flock`` on ``<dir>/.tiertrain.lock`` that records who holds it;
a record still marked ``running`` when the next run takes the lock means that run died (the
kernel drops a dead process's lock). ``ScratchLock`` holds one per scratch path; the run
directory's lock is in ``rundir.py``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from typing import Iterable

from .errors import TiertrainError

__all__ = ["DirLock", "DirInUseError", "ScratchLock", "ScratchInUseError", "clean_stale", "is_state_file"]

log = logging.getLogger("tiertrain")
LOCK = ".tiertrain.lock"


class DirInUseError(TiertrainError, RuntimeError):
    """Another tiertrain run holds this directory."""


class ScratchInUseError(DirInUseError):
    """Another tiertrain run holds this scratch directory."""


class DirLock:
    """An exclusive lock on directory ``path`` (made if missing) for this process.

    ``busy(path, holder)`` makes the error raised when another run holds it. ``created``
    says whether this lock made the directory (so that a run that fails at start can leave
    nothing behind).
    """

    def __init__(self, path: str, busy) -> None:
        self.path = os.path.abspath(path)
        self.created = not os.path.isdir(self.path)
        os.makedirs(self.path, exist_ok=True)
        self.file = os.path.join(self.path, LOCK)
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read(fd)
            os.close(fd)
            who = f"pid {info.get('pid', '?')}, started {info.get('started', '?')}" if info else "unknown process"
            raise busy(self.path, who) from None
        self.previous = _read(fd)  # the record the last holder left
        self.unclean = self.previous.get("state") == "running"
        _write(fd, {"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "state": "running"})
        self._fd: int | None = fd

    def release(self, *, remove: bool = False) -> None:
        """Give the lock up; ``remove``: delete the lock file (and the directory if this lock
        made it and nothing else is in it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if remove:
                os.unlink(self.file)
                if self.created and not os.listdir(self.path):
                    os.rmdir(self.path)
            else:
                _write(fd, {"pid": os.getpid(), "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "state": "finished"})
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # the lock goes with the descriptor anyway
        finally:
            os.close(fd)


def _scratch_busy(path: str, who: str) -> ScratchInUseError:
    return ScratchInUseError(
        f"scratch directory {path} is in use by another tiertrain run ({who}); "
        "wait for it to finish, stop it, or give this run other --io.paths"
    )


class ScratchLock:
    """A ``DirLock`` on every scratch path."""

    def __init__(self, paths: Iterable[str]) -> None:
        self.locks: list[DirLock] = []
        try:
            for p in paths:
                self.locks.append(DirLock(p, _scratch_busy))
        except BaseException:
            self.release()
            raise

    @property
    def unclean(self) -> list[dict]:
        """Records of earlier runs that did not finish, with their path."""
        return [{**lk.previous, "path": lk.path} for lk in self.locks if lk.unclean]

    def release(self, *, remove: bool = False) -> None:
        for lk in self.locks:
            lk.release(remove=remove)
        self.locks = []


def _read(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4096)
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}


def _write(fd: int, info: dict) -> None:
    data = json.dumps(info).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def is_state_file(name: str, known: Iterable[str]) -> bool:
    """A file tiertrain makes on the scratch tier: a known state file, an engine's file, or
    their checksum sidecars and temporary files."""
    base = name[:-4] if name.endswith(".crc") else name
    return base in set(known) or (base.startswith("engine") and base.endswith(".bin")) or ".tmp" in name


def clean_stale(paths: Iterable[str], known: Iterable[str], keep: Iterable[str] = ()) -> list[tuple[str, int]]:
    """Remove tiertrain state files (``known`` names, engines' files, their checksums and
    temporary files) that this run will not use; return what was removed. Files it will use
    (``keep``) are recreated anyway."""
    keep, known = set(keep), set(known)
    removed = []
    for p in paths:
        if not os.path.isdir(p):
            continue
        for name in os.listdir(p):
            base = name[:-4] if name.endswith(".crc") else name
            if is_state_file(name, known) and (base not in keep or ".tmp" in name):
                full = os.path.join(p, name)
                removed.append((full, os.path.getsize(full)))
                os.remove(full)
    return removed
