"""Checks of the directories and files a run will write, made before any work, and the
clean-up of the directories a command made when it leaves nothing in them.

The checks are side-effect free: nothing is created here. Each check raises ``ConfigError``
(or the given error class) naming the setting, the path, what is wrong and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Sequence

from .errors import ConfigError

__all__ = [
    "check_writable_dir",
    "check_input_file",
    "prepare_output_file",
    "missing_dirs",
    "remove_empty_dirs",
    "mode_as_created",
    "pid_alive",
    "remove_dead_temporaries",
    "write_output_file",
    "to_stdout",
    "first_json",
]


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def check_writable_dir(what: str, path: str, error: type[Exception] | None = None) -> None:
    """``path`` is a directory we can write, or can be made as one (``what`` names the
    setting, e.g. ``io.paths``)."""
    err = error or ConfigError
    p = os.path.abspath(path)
    if p.startswith(("/proc/", "/sys/")) or p in ("/proc", "/sys"):
        raise err(f"{what} = {path!r} is inside /{p.split('/')[1]}, a kernel filesystem; give a directory on a disk")
    if os.path.lexists(p) and not os.path.isdir(p):
        raise err(f"{what} = {path!r} is a file, not a directory; give a directory (it is made if missing)")
    base = _nearest_existing(p)
    if not os.path.isdir(base):
        raise err(f"{what} = {path!r} cannot be made: {base} is a file; give a directory elsewhere")
    if not os.access(base, os.W_OK | os.X_OK):
        if os.statvfs(base).f_flag & os.ST_RDONLY:
            raise err(f"{what} = {path!r} is on a read-only filesystem ({base}); choose a writable directory")
        raise err(
            f"{what} = {path!r}: {base} is not writable by this user; choose a writable directory "
            "or change its permissions"
        )
    if base != p:
        return
    probe = os.path.join(p, f".tiertrain-probe-{os.getpid()}")
    try:  # a read-only mount passes os.access for root
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        why = "is on a read-only filesystem" if exc.errno == errno.EROFS else f"cannot be written ({exc.strerror})"
        raise err(f"{what} = {path!r} {why}; choose a writable directory") from None
    os.close(fd)
    os.unlink(probe)


def check_input_file(what: str, path: str, error: type[Exception] | None = None) -> None:
    """``path`` is an existing, readable regular file."""
    err = error or ConfigError
    if not os.path.exists(path):
        raise err(f"{what} = {path!r}: no such file")
    if os.path.isdir(path):
        raise err(f"{what} = {path!r} is a directory; give a file")
    if not os.access(path, os.R_OK):
        raise err(f"{what} = {path!r} is not readable by this user")
    mode = os.stat(path).st_mode
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):  # /dev/zero, /dev/urandom: read until interrupted
        raise err(
            f"{what} = {path!r} is a device, not a file (a stream such as /dev/zero never ends); give a file or a pipe"
        )


def prepare_output_file(
    what: str, path: str, inputs: Sequence[str | None] = (), ours: Callable[[str], bool] | None = None
) -> str:
    """Make the directory of output file ``path`` now (before any long work) and check that
    it can be written there; return the absolute path. Never one of ``inputs`` (the files the
    command reads), nor a file of a checkpoint (a directory with a manifest), nor, where
    ``ours`` is given, an existing file it does not take for an earlier output of the command
    (``eval --out MODEL/config.json`` replaced the model's config, ``generate --out`` its
    weights). Raises ``UsageError`` naming ``what``."""
    from .errors import UsageError

    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise UsageError(f"{what} = {path!r} is a directory; give a file name")
    refuse_overwriting(what, path, inputs, UsageError)
    if ours is not None and os.path.isfile(path) and os.path.getsize(path) and not ours(path):
        raise UsageError(
            f"{what} = {path!r} exists and is not an earlier output of this command: writing it would destroy "
            "it; give a new file (or remove this one)"
        )
    directory = os.path.dirname(path)
    check_writable_dir(f"the directory of {what}", directory, UsageError)
    MADE_FOR_OUTPUT.extend(missing_dirs(directory))  # removed again by a command that fails (``cli.main``)
    os.makedirs(directory, exist_ok=True)
    check_writable_dir(f"the directory of {what}", directory, UsageError)
    return path


MADE_FOR_OUTPUT: list[str] = []  # the directories prepare_output_file made in this process


def fsync_path(path: str) -> None:
    """``path``'s contents on the disk: a file's bytes, or a directory's entries (a rename or a
    new file in it is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_overwriting(what: str, path: str, inputs: Sequence[str | None], error: type[Exception]) -> None:
    """Refuse output ``path`` where writing it would destroy what the command reads (one of
    ``inputs``) or a checkpoint (a file in a directory holding ``manifest.json``)."""
    for given in inputs:
        if given and os.path.exists(path) and os.path.exists(given) and os.path.samefile(given, path):
            raise error(f"{what} = {path!r} is also what the command reads; give another file")
    if os.path.exists(os.path.join(os.path.dirname(path), "manifest.json")):
        raise error(
            f"{what} = {path!r} is inside a checkpoint ({os.path.dirname(path)}): writing it would damage the "
            "checkpoint; give a file elsewhere"
        )


def missing_dirs(path: str) -> list[str]:
    """The directories of ``path`` (itself included) that do not exist yet, outermost first:
    what making it makes, so that a command that fails can remove them again."""
    top, out = _nearest_existing(path), []
    p = os.path.abspath(path)
    while p != top:
        out.append(p)
        p = os.path.dirname(p)
    return out[::-1]


def remove_empty_dirs(dirs: list[str]) -> None:
    """Remove each of ``dirs`` (``missing_dirs``' list, or several) that is a directory and holds
    nothing once those inside it are gone: the deepest first. What holds a file stays."""
    for d in sorted(set(dirs), key=lambda p: p.count(os.sep), reverse=True):
        if os.path.isdir(d) and not os.path.islink(d) and not os.listdir(d):
            os.rmdir(d)


def mode_as_created(path: str) -> None:
    """Give file ``path`` the mode ``open()`` gives a new file, 0666 less the umask: safetensors
    writes through a temporary file, 0600, where every other file of an export is 0644."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:  # read without setting it (os.umask sets it, for every thread)
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def pid_alive(pid: int, made: str | None = None) -> bool:
    """Whether process ``pid`` runs (another user's counts: it cannot be signalled, but it runs).
    What leftovers named by their maker's pid are judged by. ``made``: the leftover (a file or a
    directory its maker wrote into while it ran): a process of that pid started after it was
    last written is not its maker but the pid reused (a reboot, a copy from another machine), and
    counts as gone (such leftovers, a checkpoint's size, were kept for good)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if made is None:
        return True
    import psutil

    try:
        return psutil.Process(pid).create_time() <= os.path.getmtime(made) + 2.0  # (clock ticks' slack)
    except (psutil.Error, OSError):
        return True  # (not told: kept, as before)


def remove_dead_temporaries(path: str) -> list[str]:
    """Remove the ``PATH.tmpPID`` files beside ``path`` that writers killed before they renamed
    them into place left (a full-size copy each, which nothing else would ever remove); those of a
    process still running are kept. Returns the paths removed."""
    import re

    parent, base = os.path.split(os.path.abspath(path))
    pattern, gone = re.compile(rf"^{re.escape(base)}\.tmp(\d+)$"), []
    try:
        names = os.listdir(parent)
    except OSError:
        return gone
    for name in names:
        m = pattern.match(name)
        if m is None or pid_alive(int(m.group(1)), os.path.join(parent, name)):
            continue
        try:
            os.remove(os.path.join(parent, name))
            gone.append(os.path.join(parent, name))
        except OSError:
            pass
    return gone


def first_json(path: str) -> object:
    """The JSON value of the first line of ``path`` (None where it is not JSON, or unreadable)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.loads(f.readline(1 << 20))
    except (OSError, ValueError):
        return None


def write_output_file(what: str, path: str, write: Callable[[object], None]) -> None:
    """Write output file ``path`` whole or not at all: ``write(f)`` into ``PATH.tmpPID`` beside it,
    then renamed over it. A full disk or an I/O error is one line naming ``what`` and saying the
    file is as it was (writing it in place left the earlier file destroyed and half a line)."""
    from .errors import UsageError

    remove_dead_temporaries(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        before = "is as it was" if os.path.exists(path) else "was not written"
        raise UsageError(
            f"{what} {path}: writing it failed ({exc.strerror or exc}); {path} {before}; free space there or "
            "choose another file"
        ) from None


def to_stdout(text: str, what: str) -> None:
    """``text`` to standard output, flushed; a full or failing one (``> /dev/full``) is one line
    naming ``what`` (a closed pipe is the command line's: a quiet exit)."""
    import sys

    from .errors import UsageError

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise UsageError(f"{what}: writing to standard output failed ({exc.strerror or exc})") from None
