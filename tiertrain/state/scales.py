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
from .layout import PARAM_ALIGN

__all__ = ["BLOCK", "MIN_8BIT", "ScaleLayout", "UnitScales", "param_align"]

MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: smaller parameters keep fp32 moments
BLOCK = 256  # elements per scale (bitsandbytes' blockwise optimizers, fixed)


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

    def __init__(self, index: int, pieces: list[tuple[int, int, int]], numel_align: int) -> None:
        """``pieces``: (parameter offset in the unit, parameter numel, unit numel) of every
        parameter that overlaps the unit (offsets may be negative: an engine's slice)."""
        self.index = index
        self.offset = 0  # set by ScaleLayout
        self.entries: dict[int, _Entry] = {}
        blocks = small = 0
        for offset, numel, unit_numel in pieces:
            lo, hi = max(0, offset), min(unit_numel, offset + numel)
            first = lo - offset
            if numel < MIN_8BIT:
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
            UnitScales(u.index, [(p.offset, p.numel, u.numel) for p in u.params], numel_align) for u in layout.units
        ]
        pos = 0
        for unit in self.units:  # elements from the start of the whole layout (a checkpoint's file)
            unit.offset, pos = pos, pos + unit.numel
        self.max_unit_numel = max((u.numel for u in self.units), default=0)
        self.total_numel = sum(u.numel for u in self.units)

    def __len__(self) -> int:
        return len(self.units)
