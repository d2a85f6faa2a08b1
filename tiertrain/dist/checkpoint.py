"""Checkpoints of a sharded run, in the layout of a run on one rank.

A checkpoint holds every state in the *canonical* layout: units padded as one rank pads them
(``FlatLayout(model, unit_align=chunk_align)``), not to ``N`` shards. Parameters sit at the
same offsets inside a unit whatever the padding, so a checkpoint written by any number of
ranks is the same files, and loads on any number (its manifest's units are the canonical
ones: a 1-rank run resumes a 2-rank checkpoint and the other way round).

- Save: rank 0 runs the checkpoint writer over ``GatheredRegion`` s: the first read of a unit
  gathers it whole from every rank's shard (one unit's buffer); the other ranks ``follow``,
  taking part in the same gathers in the same order (states in the regions' order, units in
  layout order). The writer's temporary directory and rename make the checkpoint complete or
  absent; a rank that dies during the save stops rank 0's next gather (the group's timeout),
  and the temporary directory is removed.
- Restore: every rank reads the checkpoint's files itself (they are on a filesystem every rank
  sees) through ``ScatteredRegion`` s, which keep the part of each chunk that falls in the
  rank's shard; every rank checks every file's CRC32C.
- 8-bit optimizer states' scales (``exp_avg_scales``) are one record per unit and rank, not
  elements at the units' offsets: the whole unit's record is its ranks' records section by
  section (``state/scales.py: JoinedRecords``), gathered for the writer (``gathered_scales``)
  and cut back to this rank's on restore (``scattered_scales``).
"""

from __future__ import annotations


import torch

from ..io import IOFuture, aligned_empty
from ..state.layout import FlatLayout
from ..state.scales import JoinedRecords, ScaleLayout
from ..state.quant import ByteShards
from .shard import ShardLayout


__all__ = ["GatheredRegion", "ScatteredRegion", "follow", "gathered_scales", "scattered_scales", "is_scales", "shards_of"]


def _file_layout(layout):
    """The layout a checkpoint's file is written in where it is not the canonical units of
    elements: a quantized base's one-rank records (``ByteShards``), else None."""
    return layout.canonical if isinstance(layout, ByteShards) else None


def shards_of(region, layout):
    """The shards ``region`` is cut in: its own where they are a quantized base's bytes, else ``layout``."""
    own = getattr(region, "layout", None)
    return own if isinstance(own, ByteShards) else layout


def is_scales(region) -> bool:
    """A region of per-unit records (8-bit states' scales), not of elements at units' offsets."""
    return isinstance(getattr(region, "layout", None), ScaleLayout)


def _joined(layout: ShardLayout, read_parts, write_parts) -> JoinedRecords:
    parts = [ScaleLayout(layout.of_rank(r)) for r in range(layout.world)]
    return JoinedRecords(ScaleLayout(layout.full), parts, read_parts, write_parts)


def gathered_scales(region, layout: ShardLayout, group) -> JoinedRecords:
    """``region`` (this rank's records) as the whole units' records, for the checkpoint writer:
    a unit's is gathered from every rank once (a sync point with every rank; ``gather(u)``, as a
    ``GatheredRegion``'s, for the ranks that ``follow``)."""
    mine = region.layout.units
    own: torch.Tensor | None = None  # this rank's record, padded to the largest rank's

    def read_parts(u: int, records: list[torch.Tensor]) -> None:
        nonlocal own
        m = max(r.numel() for r in records)  # every rank's records padded to the largest of unit u
        n = mine[u].numel
        if own is None:
            own = aligned_empty(max(max(p.max_unit_numel for p in joined.parts), 1) * 4).view(torch.float32)
        if n:
            region.read(u, own[:n]).get()
        own[n:m].zero_()
        every = torch.empty(m * group.world, dtype=torch.float32)
        group.all_gather(every, own[:m])
        for r, rec in enumerate(records):
            rec.copy_(every[r * m : r * m + rec.numel()])

    def write_parts(u: int, records: list[torch.Tensor]) -> None:
        raise RuntimeError("gathered scales are read by the checkpoint writer only")

    joined = _joined(layout, read_parts, write_parts)
    joined.gather = joined.join  # type: ignore[attr-defined]
    return joined


def scattered_scales(region, layout: ShardLayout) -> JoinedRecords:
    """This rank's records of ``region`` written from the whole units' records (a checkpoint
    being restored): each whole record is cut into the ranks' and this rank's is kept."""

    def read_parts(u: int, records: list[torch.Tensor]) -> None:
        raise RuntimeError("scattered scales are written by the checkpoint reader only")

    def write_parts(u: int, records: list[torch.Tensor]) -> None:
        own = records[layout.rank]
        if own.numel():
            region.write(u, own).get()

    return _joined(layout, read_parts, write_parts)


class GatheredRegion:
    """A rank's shard region (``read``/``write`` per unit, as ``TieredRegions``) seen as the
    whole state, for the checkpoint writer: reads gather."""

    def __init__(self, region, layout: ShardLayout, group) -> None:
        self.region, self.layout, self.group = region, layout, group
        self.file_layout = _file_layout(layout)
        self.dtype, self.esize = region.dtype, region.dtype.itemsize
        self._buf = aligned_empty(layout.full.max_unit_numel * self.esize).view(self.dtype)
        self._own = aligned_empty(layout.max_unit_numel * self.esize).view(self.dtype)
        self._unit: int | None = None

    def gather(self, u: int) -> None:
        """Unit ``u`` whole in this rank's buffer: its shard read, every rank's gathered (a
        sync point with every rank)."""
        n = self.layout.units[u].numel
        self.region.read(u, self._own[:n]).get()
        self.group.all_gather(self._buf[: n * self.group.world], self._own[:n])
        self._unit = u

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        if self._unit != u:
            self.gather(u)
        end = self.layout.full.units[u].numel if end is None else end
        out[: end - start].copy_(self._buf[start:end])
        return IOFuture.completed((end - start) * self.esize)

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        raise RuntimeError("a gathered region is read by the checkpoint writer only")


def follow(regions: dict[str, GatheredRegion], canonical: FlatLayout) -> None:
    """What ranks other than 0 do while rank 0 writes a checkpoint: the same gathers, in the
    writer's order (every state, every unit that has elements)."""
    for region in regions.values():
        for unit in region.layout.units if is_scales(region) else canonical.units:
            if unit.numel:
                region.gather(unit.index)


class ScatteredRegion:
    """A rank's shard region written from whole-unit chunks (a checkpoint being restored):
    only the elements in the rank's shard are kept."""

    def __init__(self, region, layout: ShardLayout) -> None:
        self.region, self.layout = region, layout
        self.file_layout = _file_layout(layout)
        self.dtype, self.esize = region.dtype, region.dtype.itemsize

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        s = self.layout.slices[u]  # this rank's elements of the whole unit
        end = self.layout.full.units[u].numel if end is None else end
        lo, hi = max(start, s.start), min(end, s.start + s.numel)
        if lo >= hi:
            return IOFuture.completed(0)
        return self.region.write(u, src[lo - start : hi - start], lo - s.start, hi - s.start)

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        raise RuntimeError("a scattered region is written by the checkpoint reader only")
