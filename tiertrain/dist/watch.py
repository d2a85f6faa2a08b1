"""Which rank stopped a run: every rank's signs of life, published in the run's store.

A collective that fails tells a rank only that some peer did not answer. To name it, every
rank publishes, once a second from a daemon thread, a beat counter and where its main thread
is: the step, how many collectives it has started on each process group, and the last one.
When a collective fails, the rank reads every other rank's record twice, ``2 x period``
apart, and names:

- a rank whose beat did not move: if its process is on this machine and still there, it is
  not responding (stopped, e.g. by SIGSTOP or Ctrl-Z, or stuck where its beat cannot run);
  otherwise it died (or its machine stopped): ``kill -9``, a crash;
- a rank whose beat moved but that has started fewer collectives than this rank: it is alive
  and has not reached the collective this rank waited in (it hangs, or is far behind).

The step is published as soon as a step starts (``at_step`` wakes the thread), not at the
next beat, so a rank that dies is named with the step it died in.

Beats are compared with themselves, never with another machine's clock. The store is the
one ``torch.distributed`` formed the group with (``torchrun``'s agent holds it, so it
outlives any rank; started by other means, rank 0 holds it). A store whose holder died fails
at once (its connections close); one whose holder is stopped never answers: a TCPStore read
waits on its socket without any timeout, whatever the store's own. So the main thread never
touches the store itself: the thread publishes, and every read after a failure runs in a
thread of its own, waited for ``2 x period`` at most; a store that does not answer names its
holder as not responding (rank 0: its process, read once at the start, says how). Cost: one
small store write a second per rank, off the main thread.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field

__all__ = ["Progress", "Watch"]

_KEY = "tiertrain/alive/{}"


class _Silent(Exception):
    """The store did not answer in time (its holder is stopped, or stuck)."""


@dataclass
class Progress:
    """Where a rank's main thread is: set by it, published by the watch's thread."""

    step: int = 0
    ops: int = 0  # collectives started on the main group
    gathers: int = 0  # parameter gathers started on their own group
    at: str = "start"  # the last one started
    beat: int = 0  # counted by the publishing thread
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)


class Watch:
    """Publishes this rank's ``progress`` every ``period`` seconds to ``store`` until closed;
    ``culprits`` names the ranks that stopped. ``store`` None: nothing published or named."""

    def __init__(self, store, rank: int, world: int, period: float = 1.0) -> None:
        self.store, self.rank, self.world, self.period = store, rank, world, period
        self.progress = Progress()
        self.holder: Progress | None = None  # rank 0's first record (its process), read by the thread
        self._wake = threading.Event()  # set by ``at_step`` and ``close``: publish now
        self._stop = threading.Event()
        self._thread = None
        if store is not None:
            self._publish()  # the group has just formed: the store answers
            self._thread = threading.Thread(target=self._run, name=f"tiertrain-watch-{rank}", daemon=True)
            self._thread.start()

    def _publish(self) -> None:
        self.progress.beat += 1
        self.store.set(_KEY.format(self.rank), json.dumps(asdict(self.progress)))

    def at_step(self, step: int) -> None:
        """This rank starts optimizer step ``step``: published by the thread now, never by the
        caller (a store whose holder is stopped would hold it for ever)."""
        self.progress.step = step
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.period)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._publish()
                if self.holder is None and self.rank != 0:
                    self.holder = self._record(0)
            except Exception:  # noqa: BLE001 - the store is gone (its holder died): nothing left to tell
                return

    def _record(self, r: int) -> Progress | None:
        key = _KEY.format(r)
        return Progress(**json.loads(self.store.get(key))) if self.store.check([key]) else None

    def _read(self) -> dict[int, Progress | None]:
        """Every other rank's record, read in a thread of its own: ``_Silent`` where the store
        has not answered within ``2 x period``."""
        box: dict = {}

        def read() -> None:
            try:
                box["records"] = {r: self._record(r) for r in range(self.world) if r != self.rank}
            except Exception as exc:  # noqa: BLE001 - said by the caller
                box["error"] = exc

        t = threading.Thread(target=read, name=f"tiertrain-watch-read-{self.rank}", daemon=True)
        t.start()
        t.join(2 * self.period)
        if "error" in box:
            raise box["error"]
        if "records" not in box:
            raise _Silent
        return box["records"]

    def culprits(self) -> str:
        """The ranks that stopped, in words (empty when none can be named). Takes ``2 x
        period`` seconds, or ``4 x period`` at most where the store does not answer: called
        once a collective has failed."""
        if self.store is None:
            return ""
        try:
            before = self._read()
            time.sleep(2 * self.period)
            after = self._read()
        except _Silent:
            return self._silent_store()
        except Exception as exc:  # noqa: BLE001 - the store's holder is gone with its process
            return f"{_holder()} died: the run's store, which it holds, closed its connections ({type(exc).__name__})"
        me, words = self.progress, []
        for r, now in after.items():
            was = before[r]
            if now is None or (was is not None and now.beat == was.beat):
                last = f" (last seen at step {now.step}, after {now.at})" if now is not None else ""
                state = _process_state(now)
                if state:
                    words.append(f"rank {r} is not responding: its process {now.pid} {state}, with no sign of life "
                                 f"for {2 * self.period:.0f} s{last}")
                else:
                    words.append(f"rank {r} died: no sign of life for {2 * self.period:.0f} s{last}")
            elif now.ops < me.ops or now.gathers < me.gathers:
                words.append(f"rank {r} is alive but has not reached this collective: it is at step {now.step}, "
                             f"after {now.at} ({now.ops} collectives and {now.gathers} gathers started; this rank "
                             f"{me.ops} and {me.gathers})")
        return "; ".join(words)

    def _silent_store(self) -> str:
        """The store's holder named, where the store did not answer."""
        waited = f"the run's store, which it holds, has not answered for {2 * self.period:.0f} s"
        h = self.holder if _holder() == "rank 0" else None
        state = _process_state(h)
        if h is not None and state:
            return f"rank 0 is not responding: its process {h.pid} {state}; {waited}"
        return f"{_holder()} is not responding or died: {waited}"

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:  # a publish takes milliseconds; one that hangs on a stopped store is left
            self._thread.join(timeout=0.5)


def _holder() -> str:
    """Who holds the run's store: torchrun's agent (it sets TORCHELASTIC_RUN_ID), else rank 0."""
    return "torchrun's agent" if "TORCHELASTIC_RUN_ID" in os.environ else "rank 0"


def _process_state(p: Progress | None) -> str:
    """How a silent rank's process is, where it runs on this machine and is still there ('' if
    it is gone, a zombie, or elsewhere: it died)."""
    import psutil

    if p is None or p.host != socket.gethostname() or p.pid == os.getpid():
        return ""
    try:
        status = psutil.Process(p.pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return ""
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "is stopped (suspended: SIGSTOP, Ctrl-Z or a debugger)"
    return "is there but silent (stuck where its beat cannot run)"
