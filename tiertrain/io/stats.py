"""Byte counters and busy time per storage path and direction."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

__all__ = ["PathStats", "StatsSnapshot"]


@dataclass(frozen=True)
class StatsSnapshot:
    """Counters at one moment; subtract two snapshots to get the figures of an interval."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_ops: int = 0
    write_ops: int = 0
    read_busy_s: float = 0.0
    write_busy_s: float = 0.0
    busy_s: float = 0.0  # wall time with a request of either direction in flight

    def __sub__(self, other: "StatsSnapshot") -> "StatsSnapshot":
        return StatsSnapshot(*(a - b for a, b in zip(self._values(), other._values())))

    def __add__(self, other: "StatsSnapshot") -> "StatsSnapshot":
        return StatsSnapshot(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self) -> tuple:
        return dataclasses.astuple(self)

    @property
    def read_gbps(self) -> float:
        """Read bandwidth over the time at least one read was in flight (GB/s, 1e9)."""
        return self.read_bytes / self.read_busy_s / 1e9 if self.read_busy_s > 0 else 0.0

    @property
    def write_gbps(self) -> float:
        return self.write_bytes / self.write_busy_s / 1e9 if self.write_busy_s > 0 else 0.0


class PathStats:
    """Thread-safe counters for one storage path.

    Bytes count what the caller asked for (not alignment padding or read-modify-write
    blocks), so that they can be checked against a formula. Busy time is the wall time
    during which at least one request of that direction was in flight: bytes / busy time
    is the bandwidth the path delivered while it was being used; and the time with a request
    of either direction in flight (where reads and writes overlap, each direction's rate is
    below what it reaches alone).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._bytes = {"r": 0, "w": 0}
        self._ops = {"r": 0, "w": 0}
        self._busy = {"r": 0.0, "w": 0.0}
        self._inflight = {"r": 0, "w": 0, "any": 0}
        self._since = {"r": 0.0, "w": 0.0, "any": 0.0}
        self._busy["any"] = 0.0

    def begin(self, kind: str) -> None:
        with self._lock:
            now = time.perf_counter()
            for k in (kind, "any"):
                if self._inflight[k] == 0:
                    self._since[k] = now
                self._inflight[k] += 1

    def end(self, kind: str, nbytes: int) -> None:
        with self._lock:
            now = time.perf_counter()
            self._bytes[kind] += nbytes
            self._ops[kind] += 1
            for k in (kind, "any"):
                self._inflight[k] -= 1
                if self._inflight[k] == 0:
                    self._busy[k] += now - self._since[k]

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            now = time.perf_counter()
            busy = {k: self._busy[k] + (now - self._since[k] if self._inflight[k] else 0.0) for k in self._busy}
            return StatsSnapshot(
                self._bytes["r"], self._bytes["w"], self._ops["r"], self._ops["w"], busy["r"], busy["w"], busy["any"]
            )
