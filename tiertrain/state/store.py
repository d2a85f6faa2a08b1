"""The parameter store: the device slots units' parameters are fetched into, from a
``ParamSource`` (the update path's backing copy of the parameters).

Slots are a fixed number of device buffers, each the size of the largest unit. The life of
a slot (``SlotState``; any other move raises ``IllegalTransition`` naming both states):

    FREE --load--> LOADING --read (and, on CUDA, H2D copy) done--> RESIDENT
    RESIDENT --acquire--> BOUND --release--> RESIDENT
    LOADING | RESIDENT --evicted (least recently used) or invalidated--> FREE

Only BOUND slots are pinned: a unit in use is never evicted or invalidated. On CPU a unit
whose backing copy is in host memory needs no slot: its backing memory is what the modules
see. Where device memory is separate (CUDA), a file-backed unit is read into a pinned
staging buffer (one per slot), and its upload starts on the device's upload stream as soon
as the read completes (``poll``, at every prefetch and acquire), not when the unit is
needed; a staging buffer is given back once its upload has run (found by event query, not
by waiting). With GPUDirect Storage (``dev.direct``) there is no staging: the read goes
straight into the slot, once the slot's last use has run. A slot is only overwritten after the compute stream has passed the event
recorded when it was released, and the compute stream waits for a slot's upload without
blocking the host.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from ..io import BufferPool, IOFuture, PoolBuffer
from .layout import FlatLayout
from .machine import IllegalTransition, Machine

__all__ = ["ParamStore", "SlotState", "StoreStats"]


class SlotState(str, enum.Enum):
    FREE = "free"
    LOADING = "loading"
    RESIDENT = "resident"
    BOUND = "bound"


_SLOT = Machine(
    "parameter slot",
    {
        SlotState.FREE: {SlotState.LOADING},
        SlotState.LOADING: {SlotState.RESIDENT, SlotState.FREE},
        SlotState.RESIDENT: {SlotState.BOUND, SlotState.FREE},
        SlotState.BOUND: {SlotState.RESIDENT},
    },
)


@dataclass
class _Slot:
    index: int
    tensor: torch.Tensor
    unit: int | None = None
    state: SlotState = SlotState.FREE
    read: IOFuture | None = None
    staging: PoolBuffer | None = None
    loaded: "torch.cuda.Event | None" = None
    released: "torch.cuda.Event | None" = None
    last_use: int = 0

    def to(self, new: SlotState) -> None:
        self.state = _SLOT.move(self.state, new, f"{self.index} (unit {self.unit})")


@dataclass
class StoreStats:
    fetches: int = 0
    fetch_bytes: int = 0
    wait_s: float = 0.0
    hits: int = 0


class ParamStore:
    """``slots`` device buffers of the largest unit's size, loaded from ``source``.

    ``slot_tensors``: the slots' memory when the update path provides it (shared memory that
    update engines write new parameters into, CPU)."""

    def __init__(
        self,
        layout: FlatLayout,
        source,
        dev,
        *,
        slots: int,
        slot_tensors: list[torch.Tensor] | None = None,
    ) -> None:
        if slots < 2:
            raise ValueError(f"need at least 2 device slots (one computing, one loading), got {slots}")
        self.layout, self.source, self.dev = layout, source, dev
        source.attach(dev)
        self.dtype = source.dtype
        self.esize = self.dtype.itemsize
        self.stats = StoreStats()
        self._clock = 0
        if slot_tensors is not None and len(slot_tensors) != slots:
            raise ValueError(f"got {len(slot_tensors)} slot tensors for {slots} slots")
        self._shared = slot_tensors is not None
        self.slots = [
            _Slot(i, slot_tensors[i] if slot_tensors is not None else dev.empty(layout.max_unit_numel, self.dtype))
            for i in range(slots)
        ]
        # The slots are the compute stream's allocations (its caching allocator may hand out a
        # block its queued kernels still use): the first upload into each waits for this point.
        born = dev.event()
        for slot in self.slots:
            slot.released = born
        self.slot_bytes = slots * layout.max_unit_numel * self.esize
        self._staging = (
            BufferPool(slots, layout.max_unit_numel * self.esize, pin=dev.pin, name="param-staging")
            if dev.separate and source.file_backed and not dev.direct
            else None
        )

    @property
    def backing(self):
        """The source of the parameters (the update path's backing copy)."""
        return self.source

    def on_host(self, u: int) -> bool:
        return self.source.on_host(u)

    def write(self, u: int, flat: torch.Tensor) -> IOFuture:
        """Replace unit ``u``'s parameters in the source (where it can be written), dropping
        stale slot copies first."""
        self.invalidate(u)
        return self.source.write(u, flat)

    @property
    def pool_bytes(self) -> int:
        """Fixed memory of the store: device slots + host-resident units + staging."""
        return self.slot_bytes + self.source.host_bytes + (self._staging.size_bytes if self._staging else 0)

    # -- device slots --------------------------------------------------------------------------
    def _find(self, u: int) -> _Slot | None:
        return next((s for s in self.slots if s.unit == u and s.state != SlotState.FREE), None)

    def _claim(self, may_wait: bool) -> _Slot | None:
        """A slot to load into: a free one, else the least recently used unbound one."""
        free = [s for s in self.slots if s.state == SlotState.FREE]
        if free:
            return free[0]
        idle = sorted((s for s in self.slots if s.state == SlotState.RESIDENT), key=lambda s: s.last_use)
        if not idle and may_wait:
            idle = sorted((s for s in self.slots if s.state == SlotState.LOADING), key=lambda s: s.last_use)
        if not idle:
            return None
        slot = idle[0]
        self._drop(slot)
        return slot

    def _drop(self, slot: _Slot) -> None:
        if slot.state == SlotState.LOADING:
            self._finish_read(slot, upload=False)
        if slot.staging is not None:  # its upload may still read the staging buffer
            self.dev.sync(slot.loaded)
            self._give_back(slot)
        if self.dev.direct:  # a direct read next is not stream-ordered: no upload may still write the slot
            self.dev.sync(slot.loaded)
        self.dev.release(slot.tensor, after=slot.loaded)
        slot.to(SlotState.FREE)
        slot.unit, slot.loaded = None, None

    def _load(self, u: int, slot: _Slot) -> None:
        slot.unit, slot.last_use = u, self._tick()
        slot.to(SlotState.LOADING)
        self.stats.fetches += 1
        n = self.layout.units[u].numel
        self.stats.fetch_bytes += self.source.loaded_bytes(u, n, self.esize)  # a narrower base: its own bytes
        if self.source.on_host(u):  # separate device memory: a host-resident unit is one upload
            self.stats.wait_s += self.source.settle(u)  # sync point where the update still writes it
            slot.loaded = self.dev.upload(slot.tensor[:n], self.source.host_view(u), after=slot.released)
            return
        try:
            if self._staging is None:  # straight into the slot
                if self.dev.direct:  # not stream-ordered: the slot's last reader must be done
                    self.dev.sync(slot.released)  # sync point, rare: LRU slots were released long ago
                slot.read = self.source.load(u, slot.tensor[:n], slot.index if self._shared else None)
            else:
                slot.staging = self._staging_buffer()
                slot.read = self.source.load(u, slot.staging.tensor.view(self.dtype)[:n])
        except BaseException:
            self._abandon(slot)
            raise

    def _abandon(self, slot: _Slot) -> None:
        """A load that failed: the slot holds nothing (FREE), its staging goes back."""
        slot.read = None
        if slot.staging is not None:
            self.dev.sync(slot.loaded)
            self._give_back(slot)
        slot.to(SlotState.FREE)  # the load is void
        slot.unit, slot.loaded = None, None

    def _staging_buffer(self) -> PoolBuffer:
        """A free staging buffer; while none is, the oldest finished upload gives its back."""
        while True:
            buf = self._staging.try_acquire()
            if buf is not None:
                return buf
            uploading = sorted(
                (s for s in self.slots if s.staging is not None and s.read is None), key=lambda s: s.last_use
            )
            if not uploading:  # one staging buffer per slot: the slot being loaded holds none
                raise RuntimeError("parameter store: every staging buffer is held by a read in flight")
            self.dev.sync(uploading[0].loaded)  # sync point: rare, the slots outnumber the units in flight
            self._give_back(uploading[0])

    def _give_back(self, slot: _Slot) -> None:
        self.dev.release(slot.staging.tensor)
        slot.staging.release()
        slot.staging = None

    def _finish_read(self, slot: _Slot, upload: bool = True) -> None:
        """Wait for the slot's read (a sync point on the I/O); then start its upload."""
        if slot.read is None:
            return
        t0 = time.perf_counter()
        try:
            slot.read.get()
        except BaseException:
            self._abandon(slot)
            raise
        finally:
            self.stats.wait_s += time.perf_counter() - t0
            slot.read = None
        if slot.staging is not None and upload:
            n = self.layout.units[slot.unit].numel
            staged = slot.staging.tensor.view(self.dtype)
            # the ranges the source filled (routed experts: the unit without them), in order on
            # the upload stream: the last copy's event is the unit's
            for a, b in self.source.filled(slot.unit) or [(0, n)]:
                slot.loaded = self.dev.upload(slot.tensor[a:b], staged[a:b], after=slot.released)

    def poll(self) -> None:
        """Progress without blocking: uploads of reads that completed start, staging buffers
        of uploads that ran are given back."""
        for s in self.slots:
            if s.state == SlotState.LOADING and s.read is not None and s.read.done():
                self._finish_read(s)
            if s.staging is not None and s.read is None and self.dev.done(s.loaded):
                self._give_back(s)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def prefetch(self, units: list[int]) -> None:
        """Start loading ``units`` (in order) into free or idle slots; never blocks, never
        evicts a bound unit or one of ``units`` itself."""
        self.poll()
        for u in units:
            if self.source.on_host(u) and not self.dev.separate:
                continue
            if self._find(u) is not None:
                continue
            if not self.source.can_prefetch(u):
                return  # still being updated: prefetch later units only after this one
            free = [s for s in self.slots if s.state == SlotState.FREE]
            # evicting a slot still uploading would block, as would a direct read into one still
            # read; an ordered source's loads must not depend on the copies' progress (ranks: each
            # load is a collective, issued in the same order on every rank): it waits instead
            idle = [
                s
                for s in self.slots
                if s.state == SlotState.RESIDENT
                and s.unit not in units
                and (
                    self.source.ordered
                    or (self.dev.done(s.loaded) and (not self.dev.direct or self.dev.done(s.released)))
                )
            ]
            if free:
                slot = free[0]
            elif idle:
                slot = min(idle, key=lambda s: s.last_use)
                self._drop(slot)
            else:
                return
            self._load(u, slot)

    def acquire(self, u: int) -> torch.Tensor:
        """Unit ``u``'s parameters on the device, bound to its modules. May block on I/O
        (and on the update of ``u``)."""
        self.poll()
        if self.source.on_host(u) and not self.dev.separate:
            self.stats.hits += 1
            self.stats.wait_s += self.source.settle(u)  # sync point where the update still writes it
            flat = self.source.host_view(u)
            self.layout.bind(u, flat)
            return flat
        slot = self._find(u)
        if slot is None:
            slot = self._claim(may_wait=True)
            if slot is None:
                raise RuntimeError(f"no device slot free for unit {u}: all {len(self.slots)} are bound")
            self._load(u, slot)
        else:
            self.stats.hits += slot.state == SlotState.RESIDENT
        loaded_now = slot.state == SlotState.LOADING
        if loaded_now:
            self._finish_read(slot)
            slot.to(SlotState.RESIDENT)
        self.dev.wait(slot.loaded)
        flat = slot.tensor[: self.layout.units[u].numel]
        if loaded_now:  # what the load left to the device (a 4-bit base dequantized), once per load
            try:
                self.source.finish_on_device(u, flat)
            except BaseException:
                self._drop(slot)  # half made: never bound as it is
                raise
        slot.to(SlotState.BOUND)
        slot.last_use = self._tick()
        self.layout.bind(u, flat)
        return flat

    def release(self, u: int) -> None:
        """Compute is done with unit ``u`` for now; its slot may be reused later."""
        slot = self._find(u)
        if slot is not None and slot.state == SlotState.BOUND:
            slot.to(SlotState.RESIDENT)
            slot.released = self.dev.event()

    def invalidate(self, u: int | None = None) -> None:
        """Forget slot copies of ``u`` (all units if None): their backing copy changed."""
        for s in self.slots:
            if s.state != SlotState.FREE and (u is None or s.unit == u):
                if s.state == SlotState.BOUND:
                    raise IllegalTransition(
                        f"unit {s.unit} is still bound; release it before rewriting it "
                        f"(parameter slot {s.index}: BOUND -> FREE is not allowed)"
                    )
                self._drop(s)

    def close(self) -> None:
        """Every slot's read waited for and its staging given back, whatever fails (with ranks, a
        gather after the group broke): the first failure is raised once every slot is closed."""
        failed: Exception | None = None
        for s in self.slots:
            try:
                if s.state == SlotState.LOADING:
                    self._finish_read(s, upload=False)
            except Exception as exc:  # noqa: BLE001 - the other slots' reads must still be waited for
                failed = failed or exc
            if s.staging is not None:
                self.dev.sync(s.loaded)
                self._give_back(s)
        if failed is not None:
            raise failed
