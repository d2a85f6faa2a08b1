"""A test device whose copies complete on a logical clock, so that what waits is the same
on every machine.

``AsyncCpuDevice`` runs its copies on worker threads after a real delay: good at catching a
missing wait, but how many of the host's sync points find their copy still running depends
on the machine's speed (a slow CI machine waited at 14 of a step's sync points where this
one waited at 6). ``LagCpuDevice`` has no threads: a copy runs on the calling thread once
the host has made ``lag`` more calls into the device since it was issued (each call is a
tick), or earlier when something waits for it. A sync counts in ``syncs`` when its copy is
not yet due, so the count is a property of the schedule, not of the timing. Copies still
run late (after their source may have been reused) and released memory is still poisoned,
so ordering mistakes show as they do on ``AsyncCpuDevice``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Any, Callable

from .core import _events
from .simulated import AsyncCpuDevice

__all__ = ["LagCpuDevice"]


class _LagEvent:
    def __init__(self, stream: _LagStream, due: int) -> None:
        self.stream, self.due = stream, due
        self.ran = False
        self.error: BaseException | None = None

    def is_set(self) -> bool:
        return self.ran

    def wait(self) -> None:
        self.stream.run_until(self)
        if self.error is not None:
            raise self.error


class _LagStream:
    """Copies in order; each runs when due (``run_due``) or when one after it is waited for."""

    def __init__(self, dev: LagCpuDevice) -> None:
        self.dev = dev
        self._q: deque = deque()

    def submit(self, fn: Callable[[], None], after: Any) -> _LagEvent:
        ev = _LagEvent(self, self.dev.clock + self.dev.lag)
        self._q.append((fn, after, ev))
        return ev

    def _run_one(self) -> None:
        fn, after, ev = self._q.popleft()
        try:
            for a in _events(after):
                a.wait()  # another stream's copy: run it first (single-threaded, no deadlock)
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            ev.error = exc
        ev.ran = True

    def run_due(self) -> None:
        while self._q and self._q[0][2].due <= self.dev.clock:
            self._run_one()

    def run_until(self, ev: _LagEvent) -> None:
        while not ev.ran:
            self._run_one()

    def close(self) -> None:
        while self._q:
            self._run_one()


class LagCpuDevice(AsyncCpuDevice):
    """``AsyncCpuDevice``'s semantics on a logical clock (see the module docstring).
    ``lag``: calls into the device after which an issued copy has run by itself."""

    up: _LagStream  # type: ignore[assignment]  # the parent's streams' interface, run on the clock
    down: _LagStream  # type: ignore[assignment]

    def __init__(self, lag: int = 4) -> None:
        if lag < 1:
            raise ValueError(f"lag={lag}: a copy must take at least one tick (lag >= 1)")
        super().__init__(delay=0.0)
        super().close()  # this device runs its copies itself: no worker threads
        self.lag, self.clock = lag, 0
        self._lock = threading.RLock()  # update engines may call in from their threads
        self.up, self.down = _LagStream(self), _LagStream(self)

    @contextlib.contextmanager
    def _call(self):
        with self._lock:  # one tick per call from the host; due copies run first
            self.clock += 1
            self.up.run_due()
            self.down.run_due()
            yield

    def synchronize(self) -> None:
        with self._lock:
            self.up.close()
            self.down.close()

    def close(self) -> None:
        self.synchronize()
