"""How the rest of the trainer reaches the update engines: the parameter store's source
(``EngineParams``: loads wait for, or are written by, the engines), the gradient store's sink
(``EngineGrads``), the checkpoints' regions over every engine's files (``EngineRegion``), and
the futures of loads still being updated (``Handoff``, ``Deferred``). ``client.py`` holds the
engines themselves.
"""

from __future__ import annotations

import torch

from ...io import IOFuture
from ...state.regions import place
from ...state.scales import JoinedRecords, ScaleLayout
from ...state.sources import GradSink, ParamSource

__all__ = ["EngineParams", "EngineGrads", "EngineRegion", "EngineScales", "Handoff", "Deferred"]


class Handoff:
    """A unit's load into a shared slot: ``get`` waits until every engine has updated it,
    then reads from the files the slices of the engines that did not write the slot (they
    had started the unit before the request). Used as the slot's read future."""

    def __init__(self, group, u: int, slot: int, out: torch.Tensor) -> None:
        self.g, self.u, self.slot, self.out = group, u, slot, out
        self._result: int | None = None

    def done(self) -> bool:
        return self._result is not None or self.g.ready(self.u)

    def get(self) -> int:
        if self._result is not None:
            return self._result
        self._result = self.g.take_handoff(self.u, self.slot, self.out)
        return self._result


class Deferred:
    """A unit's load from the engines' files once they have written it (slots not shared):
    the read starts when the unit is ready (``get`` waits for that)."""

    def __init__(self, group, u: int, out: torch.Tensor) -> None:
        self.g, self.u, self.out = group, u, out
        self._read: IOFuture | None = None

    def _start(self) -> None:
        if self._read is None and self.g.ready(self.u):
            self._read = self.g.read_params(self.u, self.out)

    def done(self) -> bool:
        self._start()
        return self._read is not None and self._read.done()

    def get(self) -> int:
        if self._read is None:
            self.g.wait_ready(self.u)  # sync point: every engine has written unit u
            self._start()
        return self._read.get()


class EngineParams(ParamSource):
    """The engines' parameter files as the parameter store's source."""

    def __init__(self, group) -> None:
        self.g, self.dtype = group, group.pdtype
        self.file = True  # on the storage tier

    def on_host(self, u: int) -> bool:
        return False

    def host_view(self, u: int) -> torch.Tensor:
        raise KeyError(u)

    def can_prefetch(self, u: int) -> bool:
        return self.g.shares_slots or self.g.ready(u)

    def load(self, u: int, out: torch.Tensor, slot: int | None = None):
        g = self.g
        if slot is not None:  # shared slots: the engines write it themselves if still updating it
            h = g.handoff(u, slot, out)
            if h is not None:
                return h
        if g.ready(u):
            return g.read_params(u, out)
        return Deferred(g, u, out)


class EngineGrads(GradSink):
    """The engines, as where gradients go after the backward."""

    file_backed = False
    takes_device_tensors = True  # copies into shared memory itself

    def __init__(self, group) -> None:
        self.g, self.dtype = group, group.pdtype
        self.file = None

    def on_host(self, u: int) -> bool:
        return False

    def host_view(self, u: int) -> torch.Tensor:
        raise KeyError(u)

    def write(self, u: int, src: torch.Tensor) -> IOFuture:
        return self.g.send_grads(u, src)


def open_engine_files(group, kind: str, dtype: torch.dtype) -> list[list]:
    """Per engine, its file of ``kind`` (None: it has none), each half where states are held
    twice (speculation); a unit's committed state is in the half the engine's last ``Done``
    of it named (``group.files_of``)."""
    return [[group.open_file(i, kind, "r+", dtype, h) for h in range(group.halves)] for i in range(group.n)]


def close_engine_files(files: list[list]) -> None:
    for f in (h for hs in files for h in hs):
        if f is not None:
            f.close()


class EngineRegion:
    """One kind of state across all engines' files, read and written by the trainer while
    the engines are paused (checkpoints). Same calls as ``TieredRegions``."""

    def __init__(self, group, kind: str, dtype: torch.dtype) -> None:
        self.g, self.dtype, self.esize = group, dtype, dtype.itemsize
        self.place = [place(v, dtype, 0, group.align) for v in group.views]
        # per engine, its file's halves (states held twice: speculation); a unit's committed
        # state is in the half the engine's last ``Done`` of it named
        self.files = open_engine_files(group, kind, dtype)

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.g.slice_io(self.g.files_of(self.files, u), self.place, self.esize, False, u, out, start, end)

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.g.slice_io(self.g.files_of(self.files, u), self.place, self.esize, True, u, src, start, end)

    def close(self) -> None:
        close_engine_files(self.files)


class EngineScales(JoinedRecords):
    """8-bit states' scales (``exp_avg_scales``) across all engines' files, as the whole units'
    records a checkpoint holds: each engine keeps one record per slice of a unit
    (``state/scales.py``), joined on reading and split on writing (engines paused)."""

    def __init__(self, group, kind: str = "exp_avg_scales") -> None:
        parts = [ScaleLayout(v) for v in group.views]
        self.g = group
        self.place = [place(p, torch.float32, 0, group.align) for p in parts]
        self.files = open_engine_files(group, kind, torch.float32)
        super().__init__(ScaleLayout(group.layout), parts, self._read_parts, self._write_parts)

    def _io(self, u: int, records: list[torch.Tensor], write: bool) -> None:
        futs = []
        for i, (f, rec) in enumerate(zip(self.g.files_of(self.files, u), records)):
            if rec.numel():
                op = f.pwrite if write else f.pread
                futs.append(op(rec, rec.numel() * 4, self.place[i][u] * 4))
        IOFuture.gather(futs).get()

    def _read_parts(self, u: int, records: list[torch.Tensor]) -> None:
        self._io(u, records, False)

    def _write_parts(self, u: int, records: list[torch.Tensor]) -> None:
        self._io(u, records, True)

    def close(self) -> None:
        close_engine_files(self.files)
