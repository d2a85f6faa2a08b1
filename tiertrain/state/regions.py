"""Per-unit regions of one kind of state, placed in host memory or on the storage tier.

Units are placed in order: each goes to host memory while it fits in ``host_bytes``, the
rest into one file on the storage tier (a host-resident unit takes no file space). In the
file every unit starts on a multiple of ``align`` bytes (the storage's checksum block), so
reads and writes of a unit, or of chunks of whole blocks of it, never straddle a block
that another request is also writing. The same element offsets inside a unit are used by
every kind of state.

``declare`` says what a region will hold (a ``StateDecl`` with its one file), without
touching a disk; ``TieredRegions(layout, storage, decl)`` builds exactly that.
"""

from __future__ import annotations

import torch

from ..io import IOFuture, Storage, aligned_empty
from .decl import FileDecl, StateDecl

__all__ = ["TieredRegions", "place"]


def place(
    layout, dtype: torch.dtype, host_bytes: int, align: int, device_units: frozenset[int] = frozenset()
) -> dict[int, int | None]:
    """Per unit: None (in memory: host, or the device for ``device_units``) or its element
    offset in the file."""
    out: dict[int, int | None] = {}
    budget, pos = host_bytes, 0
    step = max(1, align // dtype.itemsize)
    for unit in layout.units:
        nbytes = unit.numel * dtype.itemsize
        if unit.index in device_units:
            out[unit.index] = None
        elif nbytes <= budget:
            budget -= nbytes
            out[unit.index] = None
        else:
            out[unit.index] = pos
            pos += -(-unit.numel // step) * step
    return out


class TieredRegions:
    """One state of every unit of ``layout``: in host memory (the first units that fit the
    declared budget) or in the declared file; the declaration's ``device_units`` in ``device``'s
    memory (zeroed: fresh state), whose tensors ``host_view`` hands out as it does the host's.
    ``layout``: a ``FlatLayout`` or an engine's ``SliceLayout``; ``pin`` pins the host part (CUDA)."""

    def __init__(self, layout, storage: Storage, decl: StateDecl, *, pin: bool = False, device=None) -> None:
        if len(decl.files) > 1:
            raise ValueError(f"state {decl.name} is declared over {len(decl.files)} files; a region holds one")
        self.layout, self.decl, self.name = layout, decl, decl.name
        self.dtype, self.esize = decl.dtype, decl.dtype.itemsize
        self.align = storage.record_align
        budget = decl.host_bytes
        placement = place(layout, self.dtype, budget, self.align, decl.device_units)
        on_device = decl.device_units if device is not None else frozenset()
        self._host = {
            u: device.empty(layout.units[u].numel, self.dtype).zero_()
            if u in on_device
            else aligned_empty(layout.units[u].numel * self.esize, pin=pin).view(self.dtype)
            for u, off in placement.items()
            if off is None
        }
        self._file_off = {u: off for u, off in placement.items() if off is not None}
        self.device_units = on_device
        self.host_bytes = sum(t.numel() * self.esize for u, t in self._host.items() if u not in on_device)
        self.device_bytes = sum(self._host[u].numel() * self.esize for u in on_device)
        self.file_name = decl.files[0].name if decl.files else None
        self.file_bytes = decl.files[0].size if decl.files else 0
        self.storage = storage
        self.file = storage.create(self.file_name, self.file_bytes) if self.file_bytes else None

    @staticmethod
    def declare(
        layout,
        file: str,
        dtype: torch.dtype,
        host_bytes: int,
        align: int,
        *,
        name: str,
        owner: str,
        checkpointed: bool,
        path: str | None = None,
        weights: bool = False,
        zero_if_absent: bool = False,
        device_units: frozenset[int] = frozenset(),
    ) -> StateDecl:
        """The state a ``TieredRegions`` of these arguments holds: the host memory its units
        take within ``host_bytes`` and its file (``file`` on every path, or on ``path``);
        ``device_units`` in device memory, outside both."""
        offs = place(layout, dtype, host_bytes, align, device_units)
        end = max((off + layout.units[u].numel for u, off in offs.items() if off is not None), default=0)
        held = sum(
            layout.units[u].numel * dtype.itemsize for u, off in offs.items() if off is None and u not in device_units
        )
        size = end * dtype.itemsize
        return StateDecl(
            name,
            dtype,
            owner,
            checkpointed,
            host_bytes=held if held else 0,
            files=(FileDecl(file, size, path),) if size else (),
            weights=weights,
            zero_if_absent=zero_if_absent,
            device_units=frozenset(device_units),
        )

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

    def half(self, u: int) -> TieredRegions:
        """The regions holding unit ``u``'s committed state: these, held once (``DoubleRegions``
        answers with one of its two halves)."""
        return self

    def current_half(self, u: int) -> int:
        """Which half holds unit ``u``'s committed state: 0, held once."""
        return 0

    def flush(self) -> None:
        """Put the file's checksums on disk, so readers in other processes can open it."""
        if self.file is not None:
            self.file.flush()

    def release(self) -> None:
        """Close the file (saving its checksums) so another process may use it."""
        if self.file is not None:
            self.file.close()

    def reopen(self) -> None:
        """Open the file again after ``release``, taking in what others wrote (and their checksums)."""
        if self.file_bytes:
            self.file = self.storage.open(self.file_name, "r+")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
