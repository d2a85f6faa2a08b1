"""``tiertrain train --nproc N``: N ranks of this command on this machine.

Each rank is ``python -m tiertrain train ...`` with the environment ``torchrun`` would give it
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; ``OMP_NUM_THREADS``, where unset, the machine's cores shared out), started
by this launcher rather than by ``torchrun``, so that what a user sees of a run is tiertrain's:

- signals: every rank runs in a process group of its own, so a terminal's Ctrl-C reaches the
  launcher alone, which passes each SIGINT or SIGTERM on to every rank exactly once (the first:
  every rank finishes its step, saves and stops; a second: they stop at once). A signal sent
  to one rank alone stops them all too: the ranks agree at every step boundary (``Trainer``).
- the launcher's death: a rank is sent SIGTERM when the launcher dies (Linux:
  ``PR_SET_PDEATHSIG``), which stops it at once (``launcher_gone``: no one is left to report
  to or to resume), and ends itself ``_ORPHAN_GRACE_S`` later where that did not
  (``end_with_launcher``: stuck where no signal handler runs). No rank outlives it for long.
- faults: once a rank has failed, the others fail at once in their next collective (its
  connections closed) and then take the naming window (``Watch``: 2 s, 4 s at most) to say
  which rank stopped; the launcher waits ``grace_s`` for that, then stops what is left. A rank
  that failed on another's fault (``PEER_FAULT``: it waited out ``ranks.timeout_s`` and named
  the rank that hangs) has said everything: what is still running a second later is that rank,
  and it is killed. A rank that is suspended (SIGSTOP) is killed as soon as another has failed:
  it would never see the failure. So a run with a hung rank ends within ``ranks.timeout_s``,
  the naming window and a second or two, and one with a dead rank within the naming window
  and the exits. The ranks' own processes (update engines, sessions of their own) still there
  once the ranks are gone are continued where suspended, so that each sees its rank gone and
  exits cleaning up, and killed 5 s later where one did not (``_release``): none is left behind.
- start-up: until every rank has joined the process group (``mark_joined``: its signal handlers
  set from then on), a rank may be importing, with no handler, or waiting for the others in
  C++ where no handler runs. A signal to the launcher then ends every rank at once (nothing of
  the run has begun) and the run exits 130; a rank that ends before the group formed ends the
  others at once too (they would wait out ``ranks.timeout_s`` for it). After a second signal to
  the launcher, a rank still running ``_STOP_AFTER_TERM_S`` later (in a collective, waiting for a
  rank that stopped) is killed: a second Ctrl-C always ends the run.
- exit status: 0 when every rank finished; 130 when the run was interrupted and every rank
  stopped as asked (rank 0 prints the one resume command; the launcher says "interrupted" where
  rank 0 could not); otherwise 1, with a line naming a rank that ended by a signal (which says
  nothing itself: ``kill -9``, the OOM killer).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import psutil

__all__ = ["launch", "resume_command", "launcher_gone", "end_with_launcher", "mark_joined", "LAUNCHED", "PEER_FAULT"]

log = logging.getLogger("tiertrain")
LAUNCHED = "TIERTRAIN_LAUNCHED"  # the launcher's pid, in the ranks' environment: it reports for them
JOINED = "TIERTRAIN_JOINED"  # a directory where each rank notes that the ranks' process group formed
PEER_FAULT = 3  # a rank's exit status where it stopped on another rank's fault (a RankError naming it)
INTERRUPTED = 130  # a rank's exit status where it stopped on a signal, as asked
CONFIG_ERROR = 2  # a rank's exit status where the config was refused
_ASKED = (INTERRUPTED, -signal.SIGINT, -signal.SIGTERM)  # a signal taken, or one that came before a handler
GRACE_S = 5.0  # after a rank failed: the others' naming window (2 s, 4 s at most) and their exits
_AFTER_NAMED_S = 1.0  # after a rank named another's fault: for the others that time out with it to exit
_STOP_AFTER_TERM_S = 3.0  # a rank asked to stop (SIGTERM) that has not, is killed after this
_ORPHAN_GRACE_S = 15.0  # a rank whose launcher died ends itself after this, stopped or not


def resume_command(run_dir: str, world: int = 1, checkpoint: str | None = None) -> str:
    """``tiertrain train --resume ...`` for a run (its latest checkpoint, or ``checkpoint``) on
    ``world`` ranks (the launcher's ``--nproc``)."""
    return f"tiertrain train --resume {checkpoint or run_dir}" + (f" --nproc {world}" if world > 1 else "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the rank, before it runs: SIGTERM when the launcher dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def mark_joined(rank: int) -> None:
    """In a rank this launcher started: the process group has formed and this rank's signal
    handlers are set (a signal is theirs to take from now on)."""
    where = os.environ.get(JOINED)
    if where:
        with contextlib.suppress(OSError):
            open(os.path.join(where, str(rank)), "w").close()


def launcher_gone() -> bool:
    """In a rank this launcher started: whether the launcher has died (the rank was re-parented)."""
    pid = os.environ.get(LAUNCHED, "")
    return pid.isdigit() and os.getppid() != int(pid)


def end_with_launcher(period: float = 0.5) -> None:
    """In a rank this launcher started: a daemon thread that ends the process ``_ORPHAN_GRACE_S``
    after the launcher died, where the SIGTERM that its death sent (which stops a rank at once,
    its scratch files removed) did not end it: a rank stuck where no signal handler runs would
    otherwise hold its scratch directories, memory and drives for ever."""
    if not os.environ.get(LAUNCHED, "").isdigit():
        return

    def watch() -> None:
        while not launcher_gone():
            time.sleep(period)
        time.sleep(_ORPHAN_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="tiertrain-launcher-watch", daemon=True).start()


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


@dataclass
class _Run:
    """What the launcher knows of its ranks."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    signals: list[int] = field(default_factory=list)  # the signals the launcher was sent
    kids: dict[int, float] = field(default_factory=dict)  # the ranks' own processes (``_children_of``)
    joined: str = ""  # the ranks' marks (``mark_joined``)
    nproc: int = 0
    formed: bool = False
    killed: set[int] = field(default_factory=set)  # the ranks the launcher ended itself
    second_at: float = 0.0  # when the second signal came

    def all_joined(self) -> bool:
        if not self.formed:
            with contextlib.suppress(OSError):
                self.formed = len(os.listdir(self.joined)) >= self.nproc
        return self.formed

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.killed.add(p.pid)
                p.kill()


def launch(args: Sequence[str], nproc: int, *, grace_s: float = GRACE_S, poll_s: float = 0.1) -> int:
    """Run ``python -m tiertrain *args`` as ranks 0 .. ``nproc - 1``; their exit status (see
    the module docstring). ``grace_s``: how long the others may take, after a rank failed, to
    fail by themselves and say why."""
    port = free_port()
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    run = _Run(joined=tempfile.mkdtemp(prefix="tiertrain-ranks-"), nproc=nproc)

    def forward(signum, frame) -> None:
        run.signals.append(signum)
        if len(run.signals) == 2:
            run.second_at = time.monotonic()
        if not run.all_joined():  # a rank may have no handler yet, or wait in C++: nothing has begun
            run.kill_all()
            return
        for p in run.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for r in range(nproc):
            if run.signals:  # interrupted while starting the ranks
                break
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(nproc),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": threads,
                LAUNCHED: str(os.getpid()),
                JOINED: run.joined,
            }
            run.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tiertrain", *args],
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            )
        if run.signals:
            run.kill_all()
        return _supervise(run, grace_s, poll_s)
    finally:
        for p in run.procs:  # the launcher itself is being stopped (an error here): the ranks go with it
            if p.poll() is None:
                p.kill()
                p.wait()
        _release(run.kids)
        shutil.rmtree(run.joined, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def _children_of(procs: list[subprocess.Popen], kids: dict[int, float]) -> None:
    """Note the ranks' processes (their update engines: sessions of their own) in ``kids``
    (pid -> start time), for ``_release`` once the ranks are gone."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(p.pid).children(recursive=True):
                kids.setdefault(c.pid, c.create_time())


def _release(kids: dict[int, float], wait_s: float = 5.0) -> None:
    """The ranks' processes still there once the ranks are gone (an engine a rank killed or
    failed never stopped): continued where stopped (SIGSTOP: a stopped engine never sees its
    rank's connection close, and was left stopped for good), so that each finds its rank gone
    and exits, cleaning up; killed after ``wait_s`` where one did not."""
    left = []
    for pid, t in kids.items():
        with contextlib.suppress(psutil.Error):
            c = psutil.Process(pid)
            if c.create_time() == t and c.status() != psutil.STATUS_ZOMBIE:  # the same process, alive
                if c.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                    c.resume()
                left.append(c)
    _, alive = psutil.wait_procs(left, timeout=wait_s)
    for c in alive:
        with contextlib.suppress(psutil.Error):
            c.kill()


def _supervise(run: _Run, grace_s: float, poll_s: float) -> int:
    procs = run.procs
    failed_at = 0.0
    first: tuple[int, int] | None = None  # (rank, status) of the first that failed
    early: tuple[int, int] | None = None  # (rank, status) of one that ended before the group formed
    termed: set[int] = set()  # the ranks sent SIGTERM
    looked = 0.0
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if now - looked >= 1.0:  # once a second: engines start once, at the ranks' start
            _children_of(procs, run.kids)
            looked = now
        if early is None and not run.all_joined():
            # (one that failed says why, and so may the others: the grace below, as after the start)
            ended = [(r, c) for r, c in enumerate(codes) if c in (0, *_ASKED)]
            if ended:  # the group can never form: the others would wait out ranks.timeout_s for it
                early = ended[0]
                run.kill_all()
        for r, c in enumerate(codes):
            if c not in (None, 0, INTERRUPTED) and first is None and procs[r].pid not in run.killed:
                first, failed_at = (r, c), now
        if run.second_at and now - run.second_at > _STOP_AFTER_TERM_S:
            run.kill_all()  # asked twice: a rank waiting in a collective for one that stopped
        if first is not None:
            for p, c in zip(procs, codes):
                if c is None:
                    _stop(p, now - failed_at, first[1], grace_s, termed)
        time.sleep(poll_s)
    return _status(run, first, early)


def _status(run: _Run, first: tuple[int, int] | None, early: tuple[int, int] | None) -> int:
    """The run's exit status from its ranks' (see the module docstring), said where no rank did."""
    procs, n = run.procs, len(run.procs)
    codes = [p.returncode for p in procs]
    if all(c == 0 for c in codes):
        return 0
    # asked twice, to stop at once: a rank whose collective failed on one that did ("rank 1 died") was asked too
    asked = (*_ASKED, PEER_FAULT) if len(run.signals) >= 2 else _ASKED
    failed = [c for p, c in zip(procs, codes) if c not in (0, *asked) and p.pid not in run.killed]
    why = ""
    if (run.signals and not failed) or all(c in (0, INTERRUPTED) for c in codes):
        why = " "  # a signal to the launcher, or to any one rank (the ranks agree on a stop)
    elif early is not None and early[1] in _ASKED:
        why = f" (rank {early[0]} of {n}, before the ranks had started; the other ranks were stopped)"
    if why:
        if not procs or codes[0] != INTERRUPTED:  # rank 0 says it where it stopped as asked
            print(f"tiertrain: interrupted{why.rstrip()}", file=sys.stderr)
        return INTERRUPTED
    if failed and all(c == CONFIG_ERROR for c in failed):
        return CONFIG_ERROR  # the config's fault on every rank that failed: as one process says it
    for r, c in enumerate(codes):
        if c < 0 and procs[r].pid not in run.killed and (first is None or r == first[0]):
            name = signal.Signals(-c).name if -c in signal.valid_signals() else f"signal {-c}"
            print(f"tiertrain: rank {r} of {n} was ended by {name}; the other ranks were stopped", file=sys.stderr)
            break
    return 1


def _stop(p: subprocess.Popen, since: float, first: int, grace_s: float, termed: set[int]) -> None:
    """Rank ``p``, still running ``since`` seconds after another failed with exit status ``first``."""
    if _stopped(p.pid):
        p.kill()  # suspended: it would never see that another rank failed
    elif first == PEER_FAULT:
        if since > _AFTER_NAMED_S:
            p.kill()  # the rank that hangs: the one that failed named it
    elif since > grace_s + _STOP_AFTER_TERM_S:
        p.kill()
    elif since > grace_s and p.pid not in termed:
        termed.add(p.pid)
        p.terminate()
