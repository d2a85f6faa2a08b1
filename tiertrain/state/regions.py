"""Per-unit regions of one kind of state, placed in host memory or on the storage tier.

Units are placed in order: each goes to host memory while it fits in ``host_bytes``, the
rest into one file on the storage tier (a host-resident unit takes no file space). In the
file every unit starts on a multiple of ``align`` bytes (the storage's checksum block), so
reads and writes of a unit, or of chunks of whole blocks of it, never straddle a block
that another request is also writing. The same element offsets inside a unit are used by
every kind of state.
"""

from __future__ import annotations

import torch

from ..io import IOFuture, Storage, aligned_empty
from .layout import FlatLayout

__all__ = ["TieredRegions"]


class TieredRegions:
    def __init__(
        self,
        layout: FlatLayout,
        storage: Storage,
        name: str,
        dtype: torch.dtype,
        *,
        host_bytes: int = 0,
        pin: bool = False,
    ) -> None:
        self.layout, self.name, self.dtype, self.esize = layout, name, dtype, dtype.itemsize
        self.align = storage.record_align
        placement = self.place(layout, dtype, host_bytes, self.align)
        self._host = {
            u: aligned_empty(layout.units[u].numel * self.esize, pin=pin).view(dtype)
            for u, off in placement.items()
            if off is None
        }
        self._file_off = {u: off for u, off in placement.items() if off is not None}
        self.host_bytes = sum(t.numel() * self.esize for t in self._host.values())
        self.file_bytes = self.plan_file_bytes(layout, dtype, host_bytes, self.align)
        self.storage = storage
        self.file = storage.create(name, self.file_bytes) if self.file_bytes else None

    @staticmethod
    def place(layout: FlatLayout, dtype: torch.dtype, host_bytes: int, align: int) -> dict[int, int | None]:
        """Per unit: None (host memory) or its element offset in the file."""
        out: dict[int, int | None] = {}
        budget, pos = host_bytes, 0
        step = max(1, align // dtype.itemsize)
        for unit in layout.units:
            nbytes = unit.numel * dtype.itemsize
            if nbytes <= budget:
                budget -= nbytes
                out[unit.index] = None
            else:
                out[unit.index] = pos
                pos += -(-unit.numel // step) * step
        return out

    @classmethod
    def plan_file_bytes(cls, layout: FlatLayout, dtype: torch.dtype, host_bytes: int, align: int) -> int:
        """Bytes of the file that ``TieredRegions(layout, ..., dtype, host_bytes=...)`` creates."""
        offs = cls.place(layout, dtype, host_bytes, align)
        last = [(off, layout.units[u].numel) for u, off in offs.items() if off is not None]
        return max((off + n for off, n in last), default=0) * dtype.itemsize

    def on_host(self, u: int) -> bool:
        return u in self._host

    def host_view(self, u: int) -> torch.Tensor:
        return self._host[u]

    def region(self, u: int, start: int = 0, end: int | None = None) -> tuple[int, int]:
        """(byte offset in the file, byte length) of elements ``[start, end)`` of unit ``u``."""
        end = self.layout.units[u].numel if end is None else end
        return (self._file_off[u] + start) * self.esize, (end - start) * self.esize

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        """Elements ``[start, end)`` of unit ``u`` into the CPU tensor ``out`` (non-blocking)."""
        end = self.layout.units[u].numel if end is None else end
        if u in self._host:
            out[: end - start].copy_(self._host[u][start:end])
            return IOFuture.completed((end - start) * self.esize)
        off, n = self.region(u, start, end)
        return self.file.pread(out, n, off)

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        """``src`` into elements ``[start, end)`` of unit ``u`` (non-blocking for the file)."""
        end = self.layout.units[u].numel if end is None else end
        if u in self._host:
            self._host[u][start:end].copy_(src[: end - start])
            return IOFuture.completed((end - start) * self.esize)
        off, n = self.region(u, start, end)
        return self.file.pwrite(src, n, off)

    def release(self) -> None:
        """Close the file (saving its checksums) so another process may use it."""
        if self.file is not None:
            self.file.close()

    def reopen(self) -> None:
        """Open the file again after ``release``, taking in what others wrote (and their checksums)."""
        if self.file_bytes:
            self.file = self.storage.open(self.name, "r+")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
