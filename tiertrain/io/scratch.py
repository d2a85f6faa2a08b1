"""Directories a run owns: one run per scratch directory and per run directory, and what a
dead run left behind.

``DirLock`` is an exclusive ``flock`` on ``<dir>/.tiertrain.lock`` that records who holds it;
a record still marked ``running`` when the next run takes the lock means that run died (the
kernel drops a dead process's lock). ``ScratchLock`` holds one per scratch path; the run
directory's lock is in ``training/rundir.py``.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import logging
import os
import socket
import time
import weakref
from typing import Iterable

from ..errors import TiertrainError
from ..paths import pid_alive
from .errors import StorageError

__all__ = [
    "DirLock",
    "DirInUseError",
    "ScratchLock",
    "ScratchInUseError",
    "clean_stale",
    "clean_other_legs",
    "clean_abandoned",
]

log = logging.getLogger("tiertrain")
LOCK = ".tiertrain.lock"
# Lock records name the files their run made (``ScratchLock.record_files``); records written
# before they did are read with the names those versions used.
_UNRECORDED = (
    "params.bin",
    "grads.bin",
    "exp_avg.bin",
    "exp_avg_sq.bin",
    "momentum.bin",
    "master.bin",
    "stash.bin",
    "residual.bin",
    "engine*.bin",
    "kv.bin",  # a generation's key/value cache (its lock recorded no files before 2026-11-29)
)


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

    def __init__(self, path: str, busy, *, disposable: bool = False, tracks: bool = False) -> None:
        self.path = os.path.abspath(path)
        self.created = not os.path.isdir(self.path)
        self.disposable = disposable  # tiertrain's own directory (a rank's): removed when left empty
        # a scratch directory's lock names the files of tiertrain's runs there (``ScratchLock``): it
        # stays while any of them does, so that a later run knows them from a user's
        self.tracks = tracks
        os.makedirs(self.path, exist_ok=True)
        self.file = os.path.join(self.path, LOCK)
        # no lock file: no tiertrain run has used this directory (or the last one finished and
        # removed it with its files); what is in it is the user's, never a stale file of ours
        self.existed = os.path.exists(self.file)
        fd = self._take(busy)
        self.previous = _read(fd)  # the record the last holder left
        self.unclean = self.previous.get("state") == "running"
        self.record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "state": "running"}  # fmt: skip
        try:
            _write(fd, self.record)
        except OSError as exc:  # a full disk: said before any work, naming the directory
            os.close(fd)
            err = exc.errno or errno.EIO
            raise StorageError(
                err,
                self.file,
                f"writing the lock record {self.file} failed: {os.strerror(err)}; free space on "
                f"{self.path}'s filesystem or give the run another directory",
            ) from None
        self._fd: int | None = fd
        # a holder dropped without release() (a notebook's Trainer deleted unclosed) lets go of the
        # lock when collected: only a restart of the process freed the directory
        self._collected = weakref.finalize(self, os.close, fd)

    def _take(self, busy) -> int:
        """The lock file's descriptor, locked. The lock is on the file, not the name: a holder that
        releases it removes the file while holding it, so a lock taken on a file already unlinked
        (opened just before) is no lock on the name: taken again on the file there now."""
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = _read(fd)
                os.close(fd)
                raise busy(self.path, _who(info)) from None
            try:
                if os.fstat(fd).st_ino == os.stat(self.file).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)  # the file we locked was removed meanwhile

    def note(self, **info) -> None:
        """Add ``info`` to this run's record (kept after it finishes)."""
        self.record.update(info)
        if self._fd is not None:
            _write(self._fd, self.record)

    @property
    def previous_files(self) -> set[str]:
        """The names (or patterns) of the files the last holder's run made here: none where no
        lock file was here (no tiertrain run used the directory, or the last one removed its
        files and the lock); an older record names none: the names those versions used."""
        return set(self.previous.get("files", _UNRECORDED)) if self.existed else set()

    def ours_left(self) -> list[str]:
        """The files tiertrain's runs made here (this one's record, the last holder's) that are
        still here: what the lock file must go on naming."""
        if not self.tracks or not os.path.isdir(self.path):
            return []
        names = set(self.record.get("files", ())) | self.previous_files
        return sorted(n for n in os.listdir(self.path) if n != LOCK and _named(n, names))

    def release(self, *, remove: bool = False) -> None:
        """Give the lock up; ``remove``: delete the lock file (and the directory if this lock
        made it and nothing else is in it), unless files of tiertrain's runs are still here (a
        start that failed before taking over a killed run's): then it stays, naming them."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        self._collected.detach()
        left = self.ours_left()
        try:
            if remove and not left:
                os.unlink(self.file)
                if (self.created or self.disposable) and not os.listdir(self.path):
                    os.rmdir(self.path)
            else:
                done = {"finished": time.strftime("%Y-%m-%d %H:%M:%S"), "state": "finished"}
                _write(fd, {**self.record, **done, **({"files": left} if left else {})})
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # the lock goes with the descriptor anyway
        finally:
            os.close(fd)


def _who(info: dict) -> str:
    """A lock's holder in words, from the record it wrote ('pid N, started ...'), and whether it
    is stopped."""
    if not info:
        return "unknown process"
    # (a notebook's Trainer left open: "another run" of its own process; the host too: containers
    # sharing the directory may run under the same pid)
    if info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
        return (
            f"this very process, since {info.get('started', '?')}: a Trainer (or a generation) of it not closed; "
            "close() it, or use `with Trainer(...) as t:`"
        )
    return f"pid {info.get('pid', '?')}, started {info.get('started', '?')}" + _stopped_note(info.get("pid"))


def _stopped_note(pid) -> str:
    """Where the holder is a stopped process (SIGSTOP, Ctrl-Z: it never ends by itself, even
    once its launcher is gone), how to let it end ('' otherwise)."""
    import psutil

    try:
        stopped = isinstance(pid, int) and psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return ""
    return f"; it is stopped (SIGSTOP or Ctrl-Z): `kill -CONT {pid}` lets it end, or kill it" if stopped else ""


def _scratch_busy(path: str, who: str) -> ScratchInUseError:
    return ScratchInUseError(
        f"scratch directory {path} is in use by another tiertrain run ({who}); "
        "wait for it to finish, stop it, or give this run other --io.paths"
    )


class ScratchLock:
    """A ``DirLock`` on every scratch path; ``disposable``: the paths are tiertrain's own (a
    rank's ``rank<r>`` subdirectories), removed when left empty whoever made them; ``run_dir``:
    the run's directory, locked on its own (never one of the paths)."""

    def __init__(self, paths: Iterable[str], *, disposable: bool = False, run_dir: str | None = None) -> None:
        paths = [os.path.abspath(p) for p in paths]
        for p in paths:  # each a lock of its own: a directory named twice was "in use by another run", itself
            if p == (os.path.abspath(run_dir) if run_dir else None) or paths.count(p) > 1:
                from ..errors import ConfigError

                twice = "train.run_dir and io.paths" if paths.count(p) == 1 else "twice in io.paths"
                raise ConfigError(
                    f"{p} is named as {twice}: give each its own directory (io.paths a subdirectory, e.g. "
                    f"{os.path.join(p, 'scratch')})"
                )
        self.locks: list[DirLock] = []
        try:
            for p in paths:
                self.locks.append(DirLock(p, _scratch_busy, disposable=disposable, tracks=True))
        except BaseException:
            self.release()
            raise

    @property
    def unclean(self) -> list[dict]:
        """Records of earlier runs that did not finish, with their path."""
        return [{**lk.previous, "path": lk.path} for lk in self.locks if lk.unclean]

    def previous_files(self) -> set[str]:
        """Names of the files the last runs on these paths made (what may be stale now)."""
        return set().union(*(lk.previous_files for lk in self.locks))

    def claim(self, names: Iterable[str]) -> None:
        """Take the files ``names`` this run makes, before any is opened. Refused where a scratch
        path holds one of them (or its checksums) that no tiertrain run there recorded making:
        the run would overwrite it, and remove it when it ends; the user's files are never ours
        to replace. Then named in the lock's record (with the last run's still here: this run
        may die before it removes them), for a later run to remove if this one dies."""
        names, ours = set(names), self.previous_files()
        for lk in self.locks:
            theirs = sorted(n for n in os.listdir(lk.path) if _named(n, names) and not _named(n, ours))
            if theirs:
                raise ScratchInUseError(
                    f"io.paths {lk.path} holds {', '.join(theirs)}, which no tiertrain run there recorded making: "
                    f"this run would overwrite {'it' if len(theirs) == 1 else 'them'}; give io.paths an empty "
                    "directory (or one only tiertrain uses)"
                )
        for lk in self.locks:
            lk.note(files=sorted(names | set(lk.ours_left())))

    def release(self, *, remove: bool = False) -> None:
        for lk in self.locks:
            lk.release(remove=remove)
        self.locks = []


def _read(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4096)
        info = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def held_by(path: str) -> str | None:
    """Who holds directory ``path``'s lock now ('pid N, started ...'), None where no live
    process does. Reads only (a probe before the lock is taken: its refusal names the holder)."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _who(_read(fd))
    except OSError:
        return None
    finally:
        os.close(fd)  # (the probe's lock, if it got one, goes with the descriptor)
    return None


def _write(fd: int, info: dict) -> None:
    data = json.dumps(info).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _named(name: str, pats: set[str]) -> bool:
    """File ``name`` (or its checksums, or a temporary copy) is one of ``pats`` (names, or
    patterns such as ``engine*.bin``)."""
    base = name.split(".tmp")[0].removesuffix(".crc")
    return any(fnmatch.fnmatchcase(base, pat) for pat in pats)


def clean_stale(paths: Iterable[str], known: Iterable[str], keep: Iterable[str] = ()) -> list[tuple[str, int]]:
    """Remove the files ``known`` (a previous run's, and their checksum sidecars), and
    temporary files, that this run will not use (``keep``); return what was removed. Files
    it will use are recreated anyway. Nothing else in a scratch directory is touched."""
    keep, known = set(keep), set(known)
    removed = []
    for p in paths:
        if not os.path.isdir(p):
            continue
        for name in os.listdir(p):
            if _dead_probe(name, p):  # a disk probe's file whose process is gone (killed mid-probe)
                stale = True
            elif ".tmp" in name:  # a temporary file of one of ours: always stale
                stale = _named(name, known | keep)
            else:
                stale = _named(name, known) and name.removesuffix(".crc") not in keep
            if stale:
                full = os.path.join(p, name)
                removed.append((full, os.path.getsize(full)))
                os.remove(full)
    return removed


def _dead_probe(name: str, where: str = "") -> bool:
    """``name`` is a disk probe's file (``.tiertrain-probe-<pid>``: ``cost/probe.py``,
    ``paths.py``) whose process no longer runs."""
    prefix = ".tiertrain-probe-"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return False
    pid = int(name[len(prefix) :])
    return pid != os.getpid() and not pid_alive(pid, os.path.join(where, name) if where else None)


def clean_other_legs(paths: Iterable[str], world: int) -> list[tuple[str, int]]:
    """Files a leg of this run on another number of ranks left in ``paths`` (the scratch paths
    as the user gave them): with ranks, a one-rank leg's in the paths themselves; on one rank,
    a ranked leg's in their ``rank<r>`` subdirectories (removed when left empty). Only where no
    run holds them (their lock taken here, then released); what was removed is returned."""
    removed: list[tuple[str, int]] = []
    for path in paths:
        if os.path.isdir(path):
            removed += _clean_unheld(path, [path] if world > 1 else _rank_dirs(path), abandoned_only=False)
    return removed


def clean_abandoned(paths: Iterable[str], who: str) -> list[tuple[str, int]]:
    """The files runs that died left in ``paths`` (the scratch paths as the user gave them) and
    their ``rank<r>`` subdirectories: a rank the launcher ended, a run killed and resumed with
    other io.paths (its states' size, left for good). Only where the lock's record says its run
    never finished and no run holds it now; what was removed is said (``who`` left it) and
    returned."""
    removed: list[tuple[str, int]] = []
    for path in paths:
        if os.path.isdir(path):
            removed += _clean_unheld(path, [path, *_rank_dirs(path)], abandoned_only=True)
    if removed:
        log.info(
            "removed %d file(s), %.2f GB, %s left in %s",
            len(removed),
            sum(n for _, n in removed) / 1e9,
            who,
            ", ".join(sorted({os.path.dirname(f) for f, _ in removed})),
        )
    return removed


def _rank_dirs(path: str) -> list[str]:
    return [os.path.join(path, n) for n in sorted(os.listdir(path)) if fnmatch.fnmatchcase(n, "rank[0-9]*")]


def _clean_unheld(path: str, dirs: list[str], *, abandoned_only: bool) -> list[tuple[str, int]]:
    """Our files in ``dirs`` (``path`` or its rank subdirectories) where no run holds them
    (``abandoned_only``: where their run never finished)."""
    removed: list[tuple[str, int]] = []
    for d in dirs:
        if not os.path.isfile(os.path.join(d, LOCK)):
            continue
        try:
            lock = DirLock(d, _scratch_busy, disposable=d != path)
        except ScratchInUseError:
            continue  # another run's, running now
        try:
            if lock.unclean or not abandoned_only:
                removed += clean_stale([d], lock.previous_files)
        finally:
            lock.release(remove=lock.unclean or not abandoned_only)
    return removed
