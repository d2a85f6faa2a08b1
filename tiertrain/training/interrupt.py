"""Ctrl-C and SIGTERM during training: stop at the next step boundary (``StopFlag``)."""

from __future__ import annotations

import logging
import signal
import threading

from ..dist.launch import launcher_gone

__all__ = ["StopFlag"]

log = logging.getLogger("tiertrain")


class StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM (schedulers, ``docker stop``) sets ``set`` to the signal's
    name (``signum`` to its number): the loop stops at the next step boundary. A second one
    interrupts at once, as does the SIGTERM a rank is sent when its launcher dies (nothing is
    left to report to or to resume from: ``launch.py``). Only installed in the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    _current: "StopFlag | None" = None  # the innermost one entered (a rank's start-up flag, then the run's)

    def __init__(self, *, announce: bool = True, until: str = "after this step") -> None:
        self.set: str = ""
        self.signum = 0
        self.agreed_on = ""  # what ``agreed`` last answered (every rank alike)
        self.announce = announce  # say so (with ranks, rank 0 alone speaks for them)
        self.until = until  # when the first signal stops the run, as said
        self._old: dict = {}
        self._outer: StopFlag | None = None

    @staticmethod
    def name(signum: int) -> str:
        return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name

    def _handler(self, signum, frame) -> None:
        if launcher_gone():
            raise KeyboardInterrupt("the launcher died: stopped at once")
        if self.set:
            raise KeyboardInterrupt
        self.signum, self.set = signum, self.name(signum)
        if self.announce:
            log.warning("%s: stopping %s (again to stop at once)", self.set, self.until)

    def agreed(self, group) -> str:
        """Why every rank of ``group`` stops now ('' to go on): a signal that reached any rank.
        With ranks, agreed at every step boundary (one 8-byte all-reduce): a signal to one rank
        alone (as torchrun users send one) stops every rank after the same step, where that
        rank would otherwise save alone while the others wait in the next step's collectives."""
        mine = self.signum  # read once: a signal may arrive while the ranks agree
        signum = group.max(mine)
        self.agreed_on = "" if not signum else self.set if signum == mine else f"{self.name(signum)} to another rank"
        return self.agreed_on

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            # a signal the flag around this one took (a rank's, while the ranks started) is this one's:
            # every rank stops at the first boundary they agree at
            self._outer, StopFlag._current = StopFlag._current, self
            if self._outer is not None and self._outer.set:
                self.set, self.signum = self._outer.set, self._outer.signum
            self._old = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}
        if StopFlag._current is self:
            StopFlag._current, self._outer = self._outer, None
