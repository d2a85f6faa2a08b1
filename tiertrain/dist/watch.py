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

The step is published at once when a step starts (``at_step``), not at the next beat, so a
rank that dies is named with the step it died in.

Beats are compared with themselves, never with another machine's clock. The store is the
one ``torch.distributed`` formed the group with (``torchrun``'s agent holds it, so it
outlives any rank; started by other means, rank 0 holds it, and a dead rank 0 is named by
the store's failure). Cost: one small store write a second per rank, off the main thread.
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
        self._lock = threading.Lock()  # the main thread publishes at a step's start, the thread every period
        self._stop = threading.Event()
        self._thread = None
        if store is not None:
            self._publish()
            self._thread = threading.Thread(target=self._run, name=f"tiertrain-watch-{rank}", daemon=True)
            self._thread.start()

    def _publish(self) -> None:
        with self._lock:
            self.progress.beat += 1
            self.store.set(_KEY.format(self.rank), json.dumps(asdict(self.progress)))

    def at_step(self, step: int) -> None:
        """This rank starts optimizer step ``step``: published now (one small store write)."""
        self.progress.step = step
        if self.store is not None:
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store is gone: the collective that follows says so
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store is gone (its host stopped): nothing left to tell
                return

    def _read(self) -> dict[int, Progress | None]:
        out: dict[int, Progress | None] = {}
        for r in range(self.world):
            if r == self.rank:
                continue
            key = _KEY.format(r)
            out[r] = Progress(**json.loads(self.store.get(key))) if self.store.check([key]) else None
        return out

    def culprits(self) -> str:
        """The ranks that stopped, in words (empty when none can be named). Takes ``2 x
        period`` seconds: called once a collective has failed."""
        if self.store is None:
            return ""
        try:
            before = self._read()
            time.sleep(2 * self.period)
            after = self._read()
        except Exception as exc:  # noqa: BLE001 - the store's host is gone with its rank
            return f"the run's store stopped answering ({type(exc).__name__}): the rank that holds it (rank 0) died"
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

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


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
