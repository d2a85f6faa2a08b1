"""Where the trainer listens for its update engines: a fresh directory for one Unix socket.

Named for the trainer's pid, so that a start killed before it could remove its directory
(SIGKILL while the engines connect) leaves nothing for long: the next start removes every
such directory whose trainer is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile

__all__ = ["socket_dir", "remove_stale_socket_dirs"]

PREFIX = "tiertrain-engines-"  # + the trainer's pid + "-" + a random suffix
SUN_PATH_MAX = 107  # sockaddr_un.sun_path on Linux, less the terminating NUL


def socket_dir() -> str:
    """A new directory for the socket ``<dir>/socket``, in the temp directory, or in /tmp where
    that path would be too long for a Unix socket (a test's TMPDIR, a deep home); the stale
    ones of trainers that are gone are removed from there first."""
    prefix = f"{PREFIX}{os.getpid()}-"
    tmp = tempfile.gettempdir()
    if len(os.fsencode(os.path.join(tmp, prefix + "x" * 8, "socket"))) > SUN_PATH_MAX:
        tmp = "/tmp"
    remove_stale_socket_dirs(tmp)
    return tempfile.mkdtemp(prefix=prefix, dir=tmp)


def remove_stale_socket_dirs(tmp: str) -> list[str]:
    """Remove the socket directories in ``tmp`` whose trainers no longer run; their paths."""
    gone = []
    for name in os.listdir(tmp):
        pid = name.removeprefix(PREFIX).split("-")[0]
        if not name.startswith(PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its trainer still runs (or the pid was reused: left alone either way)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        gone.append(os.path.join(tmp, name))
    return gone
