"""How the trainer starts its update engines (``launch``) and where it listens for them: a
fresh directory for one Unix socket.

Named for the trainer's pid, so that a start killed before it could remove its directory
(SIGKILL while the engines connect) leaves nothing for long: the next start removes every
such directory whose trainer is gone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, Listener

from ...paths import pid_alive
from .protocol import EngineError

__all__ = ["launch", "socket_dir", "remove_stale_socket_dirs"]

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
        if pid_alive(int(pid), os.path.join(tmp, name)):
            continue  # its trainer still runs
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        gone.append(os.path.join(tmp, name))
    return gone


def _wake(listener: Listener) -> None:
    """Wake an ``accept`` blocked on ``listener`` (it raises): on Linux, closing a listening
    socket does not, and the thread would sit on a closed descriptor that a later file or
    socket reuses. ``shutdown`` does. The socket is multiprocessing's own attribute."""
    sock = getattr(getattr(listener, "_listener", None), "_socket", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def launch(specs: list[dict], paths: list[str], wait_s: float, procs: list) -> list[Connection]:
    """Start one engine per spec (``python -m tiertrain.update.engines.worker``) and return
    their connections in engine order, each sent its ``(path, spec)``. Each process is
    appended to ``procs`` as it starts (the caller stops them, whatever happens here). Raises
    ``EngineError`` where not every engine connected within ``wait_s`` or one exited first.

    Fresh interpreters, connected back over an authenticated Unix socket: unlike
    multiprocessing's spawn, nothing of the trainer's own script is re-run in them, and unlike
    fork, no thread or lock is copied. Each in a session of its own: Ctrl-C at the terminal
    reaches the trainer only, which stops at a step boundary and then stops the engines."""
    n, key = len(specs), secrets.token_bytes(16)
    sockdir = socket_dir()
    try:  # connected, failed or interrupted: nothing left in the temp dir
        address = os.path.join(sockdir, "socket")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        try:
            env = dict(os.environ, TIERTRAIN_ENGINE_KEY=key.hex())
            for i in range(n):
                cmd = [sys.executable, "-m", "tiertrain.update.engines.worker", address, str(i)]
                procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            accepted: list = []

            def accept_all() -> None:
                try:
                    for _ in range(n):
                        accepted.append(listener.accept())
                except OSError:  # the listener closed under it: the start failed, which is said below
                    pass

            t = threading.Thread(target=accept_all, daemon=True, name="tiertrain-engine-accept")
            t.start()
            deadline = time.time() + wait_s
            while t.is_alive() and time.time() < deadline and all(p.poll() is None for p in procs):
                t.join(0.2)  # a start that never connects must not hang us
        finally:
            _wake(listener)
            listener.close()  # unlinks the socket
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
    t.join(5.0)  # woken: it returns at once
    if len(accepted) < n:
        dead = {i: p.returncode for i, p in enumerate(procs) if p.poll() is not None}
        raise EngineError(f"update engines did not start: {len(accepted)} of {n} connected; exit codes {dead}")
    conns: list = [None] * n
    for conn in accepted:
        _, i = conn.recv()
        conn.send((paths[i], specs[i]))
        conns[i] = conn
    return conns
