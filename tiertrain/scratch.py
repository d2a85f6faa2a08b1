"""Scratch hygiene: one run per scratch directory, and what a dead run left behind."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from typing import Iterable

__all__ = ["ScratchLock", "ScratchInUseError", "clean_stale", "STATE_FILES"]

log = logging.getLogger("tiertrain")
LOCK = ".tiertrain.lock"
STATE_FILES = ("params.bin", "grads.bin", "exp_avg.bin", "exp_avg_sq.bin", "momentum.bin", "master.bin", "stash.bin", "residual.bin")


class ScratchInUseError(RuntimeError):
    """Another tiertrain run holds this scratch directory."""


class ScratchLock:
    """An exclusive ``flock`` on ``<path>/.tiertrain.lock`` for every scratch path.

    The lock file records who holds it; a record still marked ``running`` when the next run
    takes the lock means that run died (the kernel drops a dead process's lock).
    """

    def __init__(self, paths: Iterable[str]) -> None:
        self._fds: list[int] = []
        self.unclean: list[dict] = []  # records of earlier runs that did not finish
        try:
            for p in paths:
                self._take(os.path.abspath(p))
        except BaseException:
            self.release()
            raise

    def _take(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        lock = os.path.join(path, LOCK)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read(fd)
            os.close(fd)
            who = f"pid {info.get('pid', '?')}, started {info.get('started', '?')}" if info else "unknown process"
            raise ScratchInUseError(
                f"scratch directory {path} is in use by another tiertrain run ({who}); "
                "wait for it to finish, stop it, or give this run other --io.paths"
            ) from None
        info = _read(fd)
        if info.get("state") == "running":
            self.unclean.append({**info, "path": path})
        _write(fd, {"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "state": "running"})
        self._fds.append(fd)

    def release(self) -> None:
        for fd in self._fds:
            try:
                _write(fd, {"pid": os.getpid(), "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "state": "finished"})
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._fds = []


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


def clean_stale(paths: Iterable[str], keep: Iterable[str]) -> list[tuple[str, int]]:
    """Remove tiertrain state files (and their checksums, and temp files) that this run will
    not use; return what was removed. Files it will use are recreated anyway."""
    keep = set(keep)
    removed = []
    for p in paths:
        if not os.path.isdir(p):
            continue
        for name in os.listdir(p):
            base = name[:-4] if name.endswith(".crc") else name
            ours = base in STATE_FILES or (base.startswith("engine") and base.endswith(".bin"))
            stale = (ours and base not in keep) or ".tmp" in name
            if stale:
                full = os.path.join(p, name)
                removed.append((full, os.path.getsize(full)))
                os.remove(full)
    return removed
