"""The parameter store: where each unit's flat parameters live, and the device slots
they are fetched into.

Backing copy of a unit: a region of ``params.bin`` on the storage tier, or host memory
for the first units that fit in ``host_bytes``. Device copies: a fixed number of slots,
each the size of the largest unit. The life of a unit in the slots:

    STORED --prefetch/acquire--> LOADING --I/O (and, on CUDA, H2D copy) done--> RESIDENT
    RESIDENT --acquire--> BOUND --release--> RESIDENT --evicted, least recently used--> STORED
    any slot copy --invalidate (an update rewrote the unit)--> STORED

Only BOUND units are pinned in their slot. On CPU a host-resident unit needs no slot:
its backing memory is what the modules see. On CUDA, loads go through pinned staging
buffers and a copy stream; a slot is only overwritten after the compute stream has
passed the event recorded when the slot was released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..io import BufferPool, IOFuture, PoolBuffer, Storage
from .device import Device
from .layout import FlatLayout
from .regions import TieredRegions

__all__ = ["ParamStore"]

FILE = "params.bin"


@dataclass
class _Slot:
    index: int
    tensor: torch.Tensor
    unit: int | None = None
    state: str = "free"  # free | loading | resident | bound
    read: IOFuture | None = None
    staging: PoolBuffer | None = None
    loaded: "torch.cuda.Event | None" = None
    released: "torch.cuda.Event | None" = None
    last_use: int = 0


@dataclass
class StoreStats:
    fetches: int = 0
    fetch_bytes: int = 0
    wait_s: float = 0.0
    hits: int = 0


class ParamStore:
    def __init__(
        self,
        layout: FlatLayout,
        storage: Storage,
        dev: Device,
        dtype: torch.dtype,
        *,
        slots: int,
        host_bytes: int = 0,
        backing=None,
        gate=None,
        slot_tensors: list[torch.Tensor] | None = None,
    ) -> None:
        if slots < 2:
            raise ValueError(f"need at least 2 device slots (one computing, one loading), got {slots}")
        self.layout, self.storage, self.dev, self.dtype = layout, storage, dev, dtype
        self.esize = dtype.itemsize
        self.stats = StoreStats()
        self._clock = 0
        # The backing copy: our own regions, or (update engines) the engines' files. ``gate``
        # (``ready(u)``, ``wait_ready(u)``) holds loads of units the engines are still updating.
        # With ``slot_tensors`` (slots the engines can write, CPU), a unit still being updated
        # is loaded by the engines themselves (``gate.handoff``) instead of waited for.
        self.backing = backing or TieredRegions(layout, storage, FILE, dtype, host_bytes=host_bytes, pin=dev.cuda)
        self.gate = gate
        if slot_tensors is not None and len(slot_tensors) != slots:
            raise ValueError(f"got {len(slot_tensors)} slot tensors for {slots} slots")
        self._handoff = gate is not None and slot_tensors is not None
        self.slots = [
            _Slot(i, slot_tensors[i] if slot_tensors is not None else dev.empty(layout.max_unit_numel, dtype))
            for i in range(slots)
        ]
        self.slot_bytes = slots * layout.max_unit_numel * self.esize
        self._staging = (
            BufferPool(slots, layout.max_unit_numel * self.esize, pin=True, name="param-staging")
            if dev.cuda and self.backing.file is not None
            else None
        )

    # -- backing copy ------------------------------------------------------------------------
    def on_host(self, u: int) -> bool:
        return self.backing.on_host(u)

    @property
    def pool_bytes(self) -> int:
        """Fixed memory of the store: device slots + host-resident units + staging."""
        return self.slot_bytes + self.backing.host_bytes + (self._staging.size_bytes if self._staging else 0)

    def write(self, u: int, flat: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        """Replace elements ``[start, end)`` of unit ``u``'s backing copy from the CPU tensor ``flat``."""
        self.invalidate(u)
        return self.backing.write(u, flat, start, end)

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        """Copy elements ``[start, end)`` of unit ``u``'s backing copy into the CPU tensor ``out``."""
        return self.backing.read(u, out, start, end)

    # -- device slots --------------------------------------------------------------------------
    def _find(self, u: int) -> _Slot | None:
        return next((s for s in self.slots if s.unit == u and s.state != "free"), None)

    def _claim(self, may_wait: bool) -> _Slot | None:
        """A slot to load into: a free one, else the least recently used unbound one."""
        free = [s for s in self.slots if s.state == "free"]
        if free:
            return free[0]
        idle = sorted((s for s in self.slots if s.state == "resident"), key=lambda s: s.last_use)
        if not idle and may_wait:
            idle = sorted((s for s in self.slots if s.state == "loading"), key=lambda s: s.last_use)
        if not idle:
            return None
        slot = idle[0]
        self._drop(slot)
        return slot

    def _drop(self, slot: _Slot) -> None:
        if slot.state == "loading":
            self._finish_read(slot)
        slot.unit, slot.state = None, "free"

    def _load(self, u: int, slot: _Slot) -> None:
        slot.unit, slot.state, slot.last_use = u, "loading", self._tick()
        self.stats.fetches += 1
        n = self.layout.units[u].numel
        self.stats.fetch_bytes += n * self.esize
        if self.backing.on_host(u):  # CUDA only: host-resident unit, one H2D copy
            with self.dev.on_copy_stream(after=slot.released):
                slot.tensor[:n].copy_(self.backing.host_view(u), non_blocking=True)
            slot.loaded = self.dev.copy_event()
            return
        if self._handoff:  # the engines write it as they update it (None: already updated)
            slot.read = self.gate.handoff(u, slot.index, slot.tensor)
            if slot.read is not None:
                return
        if self._staging is None:  # CPU: read straight into the slot
            slot.read = self.backing.read(u, slot.tensor)
        else:
            slot.staging = self._staging.acquire()
            slot.read = self.backing.read(u, slot.staging.tensor.view(self.dtype))

    def _finish_read(self, slot: _Slot) -> None:
        """Wait for the slot's read; on CUDA start its H2D copy. A sync point on the I/O."""
        if slot.read is None:
            return
        t0 = time.perf_counter()
        try:
            slot.read.get()
        finally:
            self.stats.wait_s += time.perf_counter() - t0
            slot.read = None
        if slot.staging is not None:
            n = self.layout.units[slot.unit].numel
            with self.dev.on_copy_stream(after=slot.released):
                slot.tensor[:n].copy_(slot.staging.tensor.view(self.dtype)[:n], non_blocking=True)
            slot.loaded = self.dev.copy_event()
            Device.sync(slot.loaded)  # the staging buffer may be reused once the copy is done
            slot.staging.release()
            slot.staging = None

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def prefetch(self, units: list[int]) -> None:
        """Start loading ``units`` (in order) into free or idle slots; never blocks, never
        evicts a bound unit or one of ``units`` itself."""
        for u in units:
            if self.backing.on_host(u) and not self.dev.cuda:
                continue
            if self._find(u) is not None:
                continue
            if self.gate is not None and not self._handoff and not self.gate.ready(u):
                return  # still being updated: prefetch later units only after this one
            free = [s for s in self.slots if s.state == "free"]
            idle = [s for s in self.slots if s.state == "resident" and s.unit not in units]
            if free:
                slot = free[0]
            elif idle:
                slot = min(idle, key=lambda s: s.last_use)
                self._drop(slot)
            else:
                return
            self._load(u, slot)

    def acquire(self, u: int) -> torch.Tensor:
        """Unit ``u``'s parameters on the device, bound to its modules. May block on I/O."""
        if self.backing.on_host(u) and not self.dev.cuda:
            self.stats.hits += 1
            flat = self.backing.host_view(u)
            self.layout.bind(u, flat)
            return flat
        slot = self._find(u)
        if slot is None:
            if self.gate is not None and not self._handoff:
                t0 = time.perf_counter()
                self.gate.wait_ready(u)  # sync point: the engines have written unit u
                self.stats.wait_s += time.perf_counter() - t0
            slot = self._claim(may_wait=True)
            if slot is None:
                raise RuntimeError(f"no device slot free for unit {u}: all {len(self.slots)} are bound")
            self._load(u, slot)
        else:
            self.stats.hits += slot.state == "resident"
        if slot.state == "loading":
            self._finish_read(slot)
        self.dev.wait(slot.loaded)
        slot.state, slot.last_use = "bound", self._tick()
        flat = slot.tensor[: self.layout.units[u].numel]
        self.layout.bind(u, flat)
        return flat

    def release(self, u: int) -> None:
        """Compute is done with unit ``u`` for now; its slot may be reused later."""
        slot = self._find(u)
        if slot is not None and slot.state == "bound":
            slot.state = "resident"
            slot.released = self.dev.event()

    def invalidate(self, u: int | None = None) -> None:
        """Forget slot copies of ``u`` (all units if None): their backing copy changed."""
        for s in self.slots:
            if s.state != "free" and (u is None or s.unit == u):
                if s.state == "bound":
                    raise RuntimeError(f"unit {s.unit} is still bound; release it before rewriting it")
                self._drop(s)

    def close(self) -> None:
        for s in self.slots:
            if s.state == "loading":
                self._finish_read(s)
        self.backing.close()
