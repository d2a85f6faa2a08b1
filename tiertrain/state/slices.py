"""Slices of every unit: how update engines share the parameters (an equal, aligned slice of
every unit each), and, with one slice per unit, a rank's share of a sharded layout
(``dist/shard.py``).

Engine ``i`` owns elements ``[start_i, end_i)`` of every unit's flat buffer. Slice starts
are multiples of ``align`` elements: whole checksum blocks in every state file and a
multiple of 64 elements from every parameter's start, so an engine's fused AdamW on its
slice is bit-identical to updating whole parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import FlatLayout, segments

__all__ = ["Slice", "Piece", "partition", "unit_records", "SliceLayout"]


@dataclass(frozen=True)
class Slice:
    unit: int
    start: int  # unit-local elements
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def partition(layout: FlatLayout, engines: int, align: int) -> list[list[Slice]]:
    """Per engine, its slice of every unit (possibly empty for small units)."""
    out: list[list[Slice]] = [[] for _ in range(engines)]
    for unit in layout.units:
        share = -(-unit.numel // engines)
        per = -(-share // align) * align
        for i in range(engines):
            a, b = min(i * per, unit.numel), min((i + 1) * per, unit.numel)
            out[i].append(Slice(unit.index, a, b))
    return out


def unit_records(layout: FlatLayout) -> list[list[tuple[int, int, int]]]:
    """``(offset, numel, whole)`` of every parameter of every unit (``whole``: its whole
    matrix's elements, a row piece's; else its own): all an engine needs of the model."""
    return [[(r.offset, r.numel, r.whole or r.numel) for r in unit.params] for unit in layout.units]


@dataclass(frozen=True)
class Piece:
    """A parameter as an engine sees it: offset relative to the slice start, full length;
    ``whole``: its whole matrix's elements where it is a row piece (0: its own)."""

    offset: int
    numel: int
    whole: int = 0


@dataclass(frozen=True)
class _UnitView:
    index: int
    numel: int
    params: tuple[Piece, ...]
    frozen: bool = False  # train.freeze keeps the unit: never updated


class SliceLayout:
    """One engine's slices, seen as a layout (what the streamed optimizer walks over).

    Parameters keep their real length; their offsets are relative to the slice start
    (negative when the parameter began in an earlier slice), so segments cut at the same
    places, relative to each parameter's start, as on the whole unit.
    """

    def __init__(
        self, records: list[list[tuple[int, int, int]]], slices: list[Slice], frozen: set[int] = frozenset()
    ) -> None:
        """``frozen``: the units ``train.freeze`` keeps (never updated)."""
        self.slices = slices
        self.units = [
            _UnitView(
                s.unit,
                s.numel,
                tuple(Piece(o - s.start, n, w) for o, n, w in records[s.unit] if o < s.end and o + n > s.start),
                s.unit in frozen,
            )
            for s in slices
        ]
        self.max_unit_numel = max((u.numel for u in self.units), default=0)

    def __len__(self) -> int:
        return len(self.units)

    def segments(self, u: int, start: int, end: int) -> list[tuple[Piece, int, int]]:
        return segments(self.units[u].params, start, end)
