"""The layout of 8-bit optimizer states' scales (``optim.name = "adamw8bit"``, the update in
``update/adamw8bit.py``): per unit, one fp32 record.

bitsandbytes quantizes each moment of a parameter of at least ``MIN_8BIT`` elements in blocks of
``BLOCK`` elements counted from the parameter's start, one fp32 scale a block; smaller parameters
keep fp32 moments. The codes sit at the parameters' element offsets like every other state; what
is left per unit (of the layout the optimizer walks: whole units, an engine's slices, a rank's
shards) is one record ``[scales of exp_avg's blocks | scales of exp_avg_sq's | the small
parameters' exp_avg | their exp_avg_sq]``, read whole with the unit's first chunk and written
whole after its last. Parameters start on ``BLOCK`` elements (``param_align``) so that chunks cut
them at block boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import OptimConfig
from ..io import IOFuture, aligned_empty
from .layout import PARAM_ALIGN

__all__ = ["BLOCK", "MIN_8BIT", "JoinedRecords", "ScaleLayout", "UnitScales", "param_align", "whole_numel"]

MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: smaller parameters keep fp32 moments
BLOCK = 256  # elements per scale (bitsandbytes' blockwise optimizers, fixed)


def whole_numel(p) -> int:
    """The elements of the matrix a parameter record (``ParamRecord``, an engine's ``Piece``) is
    part of: a row piece's whole (vocabulary pieces, ranges of experts), else its own. bitsandbytes
    keeps 8-bit moments of the whole matrix by its size."""
    return getattr(p, "whole", 0) or p.numel


def param_align(optim: OptimConfig) -> int:
    """Elements every parameter starts on in the flat layout: a block's with 8-bit states (so
    chunks cut parameters at block boundaries), else the fused AdamW's 64."""
    return BLOCK if optim.name == "adamw8bit" else PARAM_ALIGN


@dataclass(frozen=True)
class _Entry:
    """One parameter's piece of a unit: where its scales (or small moments) sit in the record."""

    start: int  # unit-local element where the piece starts
    first: int  # the piece's first element, from the parameter's start
    off: int  # its first block's scale (8-bit), or its first element's moment (small), in its part
    small: bool


class UnitScales:
    """The fp32 record of one unit's 8-bit state beyond the codes: ``[scales of exp_avg's
    blocks | scales of exp_avg_sq's | small parameters' exp_avg | their exp_avg_sq]``."""

    def __init__(self, index: int, pieces: list[tuple[int, int, int, int]], numel_align: int) -> None:
        """``pieces``: (parameter offset in the unit, parameter numel, unit numel, its whole
        matrix's numel: a row piece's decides as the whole) of every parameter that overlaps
        the unit (offsets may be negative: an engine's slice)."""
        self.index = index
        self.offset = 0  # set by ScaleLayout
        self.entries: dict[int, _Entry] = {}
        blocks = small = 0
        for offset, numel, unit_numel, whole in pieces:
            lo, hi = max(0, offset), min(unit_numel, offset + numel)
            first = lo - offset
            if whole < MIN_8BIT:
                self.entries[offset] = _Entry(lo, first, small, True)
                small += hi - lo
            else:
                assert first % BLOCK == 0, "cuts at block boundaries (param_align, align_dtype)"
                self.entries[offset] = _Entry(lo, first, blocks, False)
                blocks += -(-(hi - offset) // BLOCK) - first // BLOCK
        self.blocks, self.small = blocks, small
        used = 2 * blocks + 2 * small
        self.numel = max(numel_align, -(-used // numel_align) * numel_align) if used else 0

    def scales(self, record: torch.Tensor, offset: int, x: int, y: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The two moments' scales of elements ``[x, y)`` (unit-local) of the 8-bit parameter
        at ``offset``, as views of the unit's ``record``."""
        e = self.entries[offset]
        a = e.off + (x - offset) // BLOCK - e.first // BLOCK
        b = a + -(-(y - x) // BLOCK)
        return record[a:b], record[self.blocks + a : self.blocks + b]

    def moments(self, record: torch.Tensor, offset: int, x: int, y: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 moments of elements ``[x, y)`` of the small parameter at ``offset``."""
        e = self.entries[offset]
        a = 2 * self.blocks + e.off + (x - e.start)
        n = y - x
        return record[a : a + n], record[a + self.small : a + self.small + n]


class ScaleLayout:
    """The ``exp_avg_scales`` state's layout: one ``UnitScales`` record per unit of ``layout``
    (a ``FlatLayout``, an engine's ``SliceLayout`` or a rank's ``ShardLayout``), padded to
    ``numel_align`` fp32 elements (4 KiB: O_DIRECT's unit; a record is read and written whole,
    once a step, so where it ends inside a checksum block the storage tier's bounce buffer
    patches that block rather than the record being padded to it)."""

    def __init__(self, layout, numel_align: int = 1024) -> None:
        self.units = [
            UnitScales(u.index, [(p.offset, p.numel, u.numel, whole_numel(p)) for p in u.params], numel_align)
            for u in layout.units
        ]
        pos = 0
        for unit in self.units:  # elements from the start of the whole layout (a checkpoint's file)
            unit.offset, pos = pos, pos + unit.numel
        self.max_unit_numel = max((u.numel for u in self.units), default=0)
        self.total_numel = sum(u.numel for u in self.units)

    def __len__(self) -> int:
        return len(self.units)


class JoinedRecords:
    """The records of the whole units (``whole``, a ``ScaleLayout`` of the one-rank layout: what
    a checkpoint holds) made of the records of parts of them (``parts``: the ``ScaleLayout`` s of
    the update engines' slices, or of the ranks' shards, in element order). Parts cut parameters
    at block boundaries, so each section of a whole record (first moment's scales, second's,
    small parameters' first moments, second's) is its parts' sections one after the other.

    A region of the whole records for the checkpoint writer and reader (``read``/``write`` per
    unit, as ``TieredRegions``): ``read_parts(u, records)`` fills each part's record of unit
    ``u`` (views of a buffer, each its part's size), ``write_parts(u, records)`` stores them. A
    unit's whole record is joined once and read in any pieces; a written one is split once
    every element of it has been written."""

    def __init__(self, whole: ScaleLayout, parts: list[ScaleLayout], read_parts, write_parts) -> None:
        self.layout, self.parts = whole, parts
        self.dtype, self.esize = torch.float32, 4
        self._read_parts, self._write_parts = read_parts, write_parts
        self._buf = aligned_empty(whole.max_unit_numel * 4).view(torch.float32)
        self._part_bufs = [aligned_empty(max(p.max_unit_numel, 1) * 4).view(torch.float32) for p in parts]
        self._unit: int | None = None  # the unit whose whole record is in the buffer (read)
        self._filling: tuple[int, int] | None = None  # (unit, elements written so far)
        for u in whole.units:
            got = [sum(p.units[u.index].blocks for p in parts), sum(p.units[u.index].small for p in parts)]
            assert got == [u.blocks, u.small], f"unit {u.index}: parts' records are not the whole's ({got})"

    def _sections(self, rec: UnitScales) -> list[tuple[int, int]]:
        b, s = rec.blocks, rec.small
        return [(0, b), (b, b), (2 * b, s), (2 * b + s, s)]

    def _part_records(self, u: int) -> list[torch.Tensor]:
        return [buf[: p.units[u].numel] for p, buf in zip(self.parts, self._part_bufs)]

    def join(self, u: int) -> None:
        """Unit ``u``'s whole record, joined from its parts' into the buffer."""
        records = self._part_records(u)
        self._read_parts(u, records)
        whole = self._buf[: self.layout.units[u].numel]
        whole.zero_()  # the record's padding
        for k, (at, _) in enumerate(self._sections(self.layout.units[u])):
            for p, rec in zip(self.parts, records):
                a, n = self._sections(p.units[u])[k]
                whole[at : at + n].copy_(rec[a : a + n])
                at += n
        self._unit = u

    def _split(self, u: int) -> None:
        records = self._part_records(u)
        for rec in records:
            rec.zero_()
        whole = self._buf
        for k, (at, _) in enumerate(self._sections(self.layout.units[u])):
            for p, rec in zip(self.parts, records):
                a, n = self._sections(p.units[u])[k]
                rec[a : a + n].copy_(whole[at : at + n])
                at += n
        self._write_parts(u, records)

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None):
        end = self.layout.units[u].numel if end is None else end
        if self._unit != u:
            self.join(u)
        out[: end - start].copy_(self._buf[start:end])
        return IOFuture.completed((end - start) * 4)

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None):
        """Elements ``[start, end)`` of unit ``u``'s whole record; a unit is written in order,
        whole, before the next (as the checkpoint reader writes)."""
        numel = self.layout.units[u].numel
        end = numel if end is None else end
        done = self._filling[1] if self._filling and self._filling[0] == u else 0
        if start != done:
            raise RuntimeError(f"unit {u}'s scales written from element {start}, after {done}: in order, whole")
        self._unit = None
        self._buf[start:end].copy_(src[: end - start])
        self._filling = (u, end)
        if end == numel:
            self._split(u)
            self._filling = None
        return IOFuture.completed((end - start) * 4)
