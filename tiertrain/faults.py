"""Fault injection for tests: kill or slow this process at a chosen point of its work.

``TIERTRAIN_KILL_AT=point:n`` sends SIGKILL to this process the ``n``-th time ``point`` is
reached; ``TIERTRAIN_SLOW_AT=point:seconds`` sleeps that long each time (to make one
side of an overlap the slow one), ``point:seconds:n`` only the ``n``-th time. Points: ``forward`` and ``backward`` (each unit and
micro-batch), ``update`` (each optimizer chunk), ``checkpoint`` (each chunk saved or
restored), ``start`` (once, while the trainer is being built), ``join`` (once, a rank before
it joins the ranks' process group). ``TIERTRAIN_KILL_RANK=r``: only
the rank whose ``RANK`` (torchrun's) is ``r`` is killed; ``TIERTRAIN_SLOW_RANK=r``: only that
rank is slowed (a long sleep there is a hung rank). All are read when the process starts.
Unset, a point costs one comparison.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["point", "POINTS", "FaultSpecError"]


POINTS = ("forward", "backward", "update", "checkpoint", "start", "join")


class FaultSpecError(SystemExit):
    """A fault variable that does not parse: one line, no traceback (raised at import)."""


def _point(var: str, spec: str, name: str) -> str:
    if name not in POINTS:  # (a misspelt point never fired: the test it was for passed for nothing)
        raise FaultSpecError(f"tiertrain: {var}={spec!r}: no point {name!r}; the points are {', '.join(POINTS)}")
    return name


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, n = spec.partition(":")
    try:
        return _point("TIERTRAIN_KILL_AT", spec, name), int(n or 1)
    except ValueError:
        raise FaultSpecError(
            f"tiertrain: TIERTRAIN_KILL_AT={spec!r}: expected point or point:n, e.g. update:3"
        ) from None


def _parse_slow(spec: str | None) -> tuple[str, float, int]:
    if not spec:
        return "", 0.0, 0
    name, _, rest = spec.partition(":")
    seconds, _, nth = rest.partition(":")
    try:
        return _point("TIERTRAIN_SLOW_AT", spec, name), float(seconds), int(nth or 0)
    except ValueError:
        raise FaultSpecError(
            f"tiertrain: TIERTRAIN_SLOW_AT={spec!r}: expected point:seconds or point:seconds:n, e.g. update:0.01"
        ) from None


_target = _parse(os.environ.get("TIERTRAIN_KILL_AT"))
if os.environ.get("TIERTRAIN_KILL_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    _target = None  # another rank is the one to kill
_slow = _parse_slow(os.environ.get("TIERTRAIN_SLOW_AT"))
if os.environ.get("TIERTRAIN_SLOW_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    _slow = ("", 0.0, 0)  # another rank is the slow one
_count = 0
_slow_count = 0


def point(name: str) -> None:
    global _count, _slow_count
    if _slow[0] == name:
        _slow_count += 1
        if not _slow[2] or _slow_count == _slow[2]:
            time.sleep(_slow[1])
    if _target is None or name != _target[0]:
        return
    _count += 1
    if _count == _target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
