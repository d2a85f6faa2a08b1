"""A state held twice, for the speculative update (``update.speculate``): two halves of the
same placement, and per unit which half is current.

The speculative update writes a unit's new state into the half that is not current
(``write_next``) while the current one stays intact; once the step is validated the unit's
halves flip (``flip``: no bytes move). Until then, and for every other reader (the
parameter store, checkpoints, export), the region is its current half: ``read``/``write``
and ``host_view`` go there. A step that must be redone reads the current half again and
overwrites the other one.

Where each unit's state stands::

    half c is current --its update writes half 1-c-- written, not current
    --the step is validated: flip(u)--> half 1-c is current

Host memory: each half holds the units that fit in half the declared budget (the same
units in both halves); the rest live in two files on the storage tier, ``<name>.bin`` and
``<name>.spec.bin``, the second claimed at start like the first.
"""

from __future__ import annotations

import dataclasses

import torch

from ..io import IOFuture, Storage
from .decl import FileDecl, StateDecl
from .regions import TieredRegions

__all__ = ["DoubleRegions", "second_file", "declare_state", "build_region"]


def second_file(file: str) -> str:
    """The file of a state's second half: ``exp_avg.bin`` -> ``exp_avg.spec.bin``."""
    stem, dot, ext = file.rpartition(".")
    return f"{stem}.spec.{ext}" if dot else f"{file}.spec"


class DoubleRegions:
    """One state of every unit, twice (see the module docstring). Reads and writes without
    ``_next`` address the current half: the ``Region`` every other part sees."""

    def __init__(self, layout, storage: Storage, decl: StateDecl, *, pin: bool = False) -> None:
        self.layout, self.decl, self.name = layout, decl, decl.name
        self.dtype, self.esize = decl.dtype, decl.dtype.itemsize
        half = decl.host_bytes // 2
        self.halves = [
            TieredRegions(
                layout,
                storage,
                dataclasses.replace(decl, host_bytes=half, files=decl.files[i : i + 1], double=False),
                pin=pin,
            )
            for i in range(2)
        ]
        self.current = [0] * len(layout.units)  # per unit: which half holds its committed state
        self.host_bytes = sum(h.host_bytes for h in self.halves)

    @staticmethod
    def declare(layout, file: str, dtype: torch.dtype, host_bytes: int, align: int, **kw) -> StateDecl:
        """What a ``DoubleRegions`` holds: within ``host_bytes`` for both halves, each half's
        host-resident units as ``TieredRegions.declare`` (same keywords) places them in half of
        it, and two files."""
        one = TieredRegions.declare(layout, file, dtype, host_bytes // 2, align, **kw)
        files = one.files + tuple(FileDecl(second_file(f.name), f.size, f.path) for f in one.files)
        return dataclasses.replace(one, host_bytes=2 * one.host_bytes, files=files, double=True)

    # -- the current half: the Region every other part sees ----------------------------------------
    @property
    def file(self):
        return self.halves[0].file  # placement is the same in both halves: None when all in memory

    def on_host(self, u: int) -> bool:
        return self.halves[0].on_host(u)

    def host_view(self, u: int) -> torch.Tensor:
        return self.halves[self.current[u]].host_view(u)

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.halves[self.current[u]].read(u, out, start, end)

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.halves[self.current[u]].write(u, src, start, end)

    # -- the speculative update's -----------------------------------------------------------------
    def write_next(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        """``src`` into elements ``[start, end)`` of unit ``u``'s other half (not current)."""
        return self.halves[1 - self.current[u]].write(u, src, start, end)

    def flip(self, u: int) -> None:
        """Unit ``u``'s other half, completely written, becomes current (no bytes move)."""
        self.current[u] ^= 1

    def half(self, u: int) -> TieredRegions:
        """The half holding unit ``u``'s committed state (its file: where readers in other
        processes find it)."""
        return self.halves[self.current[u]]

    def current_half(self, u: int) -> int:
        """Which half (0, 1) holds unit ``u``'s committed state."""
        return self.current[u]

    # -- the file's life, both halves: as ``TieredRegions`` ---------------------------------------
    def flush(self) -> None:
        for h in self.halves:
            h.flush()

    def release(self) -> None:
        for h in self.halves:
            h.release()

    def reopen(self) -> None:
        for h in self.halves:
            h.reopen()

    def close(self) -> None:
        for h in self.halves:
            h.close()


def declare_state(double: bool, *args, **kwargs) -> StateDecl:
    """``DoubleRegions.declare`` where ``double`` (speculation), else ``TieredRegions.declare``."""
    return (DoubleRegions if double else TieredRegions).declare(*args, **kwargs)


def build_region(layout, storage: Storage, decl: StateDecl, *, pin: bool = False, device=None):
    """The region a declaration was made for (``StateDecl.double``: a ``DoubleRegions``, never
    on the device); ``device``: where its ``device_units`` live."""
    if decl.double:
        return DoubleRegions(layout, storage, decl, pin=pin)
    return TieredRegions(layout, storage, decl, pin=pin, device=device)
