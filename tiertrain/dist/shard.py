"""One rank's share of the model's states: an equal, aligned 1/N of every unit.

With ``N`` ranks every unit of the flat layout is padded to a multiple of ``N x
chunk_align`` elements (``Runtime``), so it splits into ``N`` equal shards, each starting on
a whole checksum block in every state file and at a multiple of 64 elements from every
parameter's start: a rank's fused AdamW on its shard is bit-identical to updating whole
parameters (as the update engines' slices are, ``update/slices.py``).

Rank ``r`` owns elements ``[r x per, (r + 1) x per)`` of unit ``u`` (``per = numel / N``)
of the parameters, gradients and optimizer state. ``ShardLayout`` is that share seen as a
layout, the object every state and the streamed optimizer are built on, so the update path
runs unchanged on it. Around it, on the full units the compute uses:

- ``ShardedParams`` (a ``ParamSource``): loads a unit by reading this rank's shard from its
  files and gathering the others' (``all_gather``);
- ``ShardedGrads`` (a ``GradSink``): takes a unit's local gradient (the sum over this rank's
  micro-batches), sums it over the ranks in rank order (``reduce_scatter``) and sends this
  rank's shard of the sum home.

Collective order: every rank must issue its gathers and reduce-scatters in the same order.
Gathers are issued first-in first-out in the order of ``load`` calls, each once its shard's
read is done; reduce-scatters in the order of the backward's units. The parameter store's
loads follow the schedule alone on every rank: ``can_prefetch`` is always true here, so the
update's progress (how far the overlapped update or the engines have got, which differs
between ranks) never decides whether a unit is loaded now or later, and so which slot it
takes and what is evicted; nor, on a device with memory of its own, does an upload's progress
(``ordered``: the store evicts a slot still uploading by waiting for it). A load of a unit
still being updated waits for its update (the update path's future), and the gathers after
it wait in turn.

Devices: the collectives run on host memory (Gloo), on CPU and CUDA alike. On CUDA a unit is
gathered into its pinned staging buffer and uploaded whole, as one rank's loads are; a
gradient is copied down whole into pinned staging (on the download stream) and reduced on the
host, and the reduced shard, a host tensor, goes home as it is. NCCL, gathering straight into device
memory, is not built.
"""

from __future__ import annotations


from collections import deque
import torch

from ..io import IOFuture
from ..state.layout import FlatLayout
from ..state.sources import GradSink, ParamSource
from ..state.slices import Slice, SliceLayout, unit_records


__all__ = ["ShardLayout", "ShardedParams", "ShardedGrads", "ShardedRecords"]


class ShardLayout(SliceLayout):
    """Rank ``rank``'s share of every unit of ``full`` (padded to ``world x align``), as a
    layout: what the states, the streamed optimizer and the budget are built on. The update
    engines' slices (``SliceLayout``) with one slice per unit: this rank's."""

    def __init__(
        self, full: FlatLayout, rank: int, world: int, align: int, canonical: FlatLayout | None = None
    ) -> None:
        """``canonical``: the layout of one rank (what checkpoints are written in)."""
        slices = []
        for unit in full.units:
            if unit.numel % (world * align):
                raise ValueError(f"unit {unit.index} has {unit.numel} elements: not {world} shards of a multiple of "
                                 f"{align}; build the layout with unit_align = {world} x {align}")
            per = unit.numel // world
            slices.append(Slice(unit.index, rank * per, (rank + 1) * per))
        super().__init__(unit_records(full), slices, {u.index for u in full.units if u.frozen})
        self.full, self.rank, self.world, self.align, self.canonical = full, rank, world, align, canonical
        self.total_numel = sum(u.numel for u in self.units)

    def of_rank(self, rank: int) -> "ShardLayout":
        """Rank ``rank``'s share of the same units."""
        return ShardLayout(self.full, rank, self.world, self.align, self.canonical)

    def shard(self, u: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's share of unit ``u``'s whole flat buffer ``full`` (a view)."""
        s = self.slices[u]
        return full[s.start : s.end]

    def describe(self) -> str:
        return (f"rank {self.rank} of {self.world}: {self.total_numel / 1e6:.2f} M of "
                f"{self.full.total_numel / 1e6:.2f} M elements")


class _Then:
    """A gather's future that runs ``fn`` once it is done (in the getter's thread)."""

    def __init__(self, inner, fn) -> None:
        self.inner, self.fn, self._result = inner, fn, None

    def done(self) -> bool:
        return self._result is not None or self.inner.done()

    def get(self, timeout: float | None = None):
        if self._result is None:
            self.inner.get()
            self.fn()
            self._result = 0
        return self._result


class ShardedRecords:
    """A sharded region of records (a quantized base's bytes, ``ByteShards``) seen as whole
    records by ``DequantSource``: ``read(u, buf)`` reads this rank's shard and gathers the
    others' into ``buf`` (``ShardedParams`` over bytes: in load order on every rank)."""

    ordered = True

    def __init__(self, params: "ShardedParams") -> None:
        self.params = params

    def on_host(self, u: int) -> bool:
        return False

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("sharded records are never used in place")

    def read(self, u: int, buf: torch.Tensor):
        return self.params.load(u, buf)


class _Gather:
    def __init__(self, u: int, out: torch.Tensor, read: IOFuture) -> None:
        self.u, self.out, self.read = u, out, read
        self.work = None  # the collective, once issued
        self.error: BaseException | None = None
        self.finished = False  # waited for once: a second ``get`` answers the same, never waits again


class _GatherFuture:
    """Done once the unit's shard is read and gathered from every rank (an ``IOFuture`` to the
    parameter store)."""

    def __init__(self, owner: "ShardedParams", g: _Gather) -> None:
        self.owner, self.g = owner, g

    def done(self) -> bool:
        self.owner.pump()
        return self.g.work is not None and self.g.work.is_completed()

    def get(self, timeout: float | None = None):
        self.owner.finish(self.g)
        return None

    def then(self, fn) -> "_Then":
        """A future that also runs ``fn`` once the unit is whole (a narrower base widened)."""
        return _Then(self, fn)


class _HostCopy:
    """A host-resident shard copied into the gathered unit once its update is done (the read
    future of a unit the update path keeps in memory)."""

    def __init__(self, inner: ParamSource, u: int, own: torch.Tensor) -> None:
        self.inner, self.u, self.own = inner, u, own

    def done(self) -> bool:
        return self.inner.settled(self.u)

    def get(self, timeout: float | None = None) -> int:
        self.inner.settle(self.u)  # sync point where the update still writes it
        self.own.copy_(self.inner.host_view(self.u)[: self.own.numel()])
        return self.own.numel() * self.own.element_size()


class ShardedParams(ParamSource):
    """A unit's whole parameters: this rank's shard from ``inner`` (the update path's source on
    the shard layout), the others' gathered. Never host-resident for the store (the whole unit
    exists only in a slot)."""

    file_backed = True
    ordered = True  # the parameter store's loads in the schedule's order alone (module docstring)

    def __init__(self, inner: ParamSource, layout: ShardLayout, group) -> None:
        self.inner, self.layout, self.group = inner, layout, group
        self.dtype = inner.dtype
        self._fifo: deque[_Gather] = deque()  # issued in load order: the same on every rank

    def on_host(self, u: int) -> bool:
        return False

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("sharded parameters are never used in place")

    def can_prefetch(self, u: int) -> bool:
        """Always: the loads, and so the gathers, in the schedule's order on every rank (see the
        module docstring); the update path's own answer depends on its progress."""
        return True

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:  # type: ignore[override]
        own = self.layout.shard(u, out)
        read = _HostCopy(self.inner, u, own) if self.inner.on_host(u) else self.inner.load(u, own)
        g = _Gather(u, out, read)
        self._fifo.append(g)
        self.pump()
        return _GatherFuture(self, g)

    def pump(self) -> None:
        """Issue the gathers whose reads are done, in load order (never blocks)."""
        for g in self._fifo:
            if g.work is not None:
                continue
            if not g.read.done():
                return
            self._issue(g)

    def _issue(self, g: _Gather) -> None:
        try:
            g.read.get()  # sync point (done already, or waited for by ``finish``)
        except BaseException as exc:  # noqa: BLE001 - the collective must still be issued: the other ranks wait on it
            g.error = exc
        # gloo: the rank's own shard is a view of ``out``; the gather copies it into place first
        g.work = self.group.start_all_gather(g.out, self.layout.shard(g.u, g.out).clone())

    def finish(self, g: _Gather) -> None:
        """Wait until ``g``'s unit is whole: every gather before it is issued first. Asked again,
        it raises the same read error (or returns): the gather is waited for once."""
        if not g.finished:
            self._wait(g)
        if g.error is not None:
            raise g.error

    def _wait(self, g: _Gather) -> None:
        for x in self._fifo:
            if x.work is None:
                self._issue(x)
            if x is g:
                break
        try:
            self.group.wait(g.work, "all_gather")  # sync point: the unit is whole
        except BaseException as exc:  # noqa: BLE001 - kept for a second ``get``; the read's error comes first
            g.error = g.error or exc
        finally:
            self._fifo.remove(g)
            g.finished = True

    def settle(self, u: int) -> float:
        return self.inner.settle(u)


class ShardedGrads(GradSink):
    """A unit's local gradient summed over the ranks in rank order, this rank's shard sent to
    ``inner`` (the update path's sink on the shard layout)."""

    file_backed = True
    sharded = True

    def __init__(self, inner: GradSink, layout: ShardLayout, group) -> None:
        self.inner, self.layout, self.group = inner, layout, group
        self.dtype = inner.dtype

    def on_host(self, u: int) -> bool:
        return False  # the local sum is never the home: it is reduced first

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("sharded gradients are never accumulated in place")

    def claim(self, u: int) -> None:
        self.inner.claim(u)

    def reduce(self, u: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of unit ``u``'s gradient summed over the ranks (sync point): a new
        host tensor. The collectives run on host memory (Gloo): ``full`` is in host memory
        (``GradStore`` copies a device gradient down into pinned staging first)."""
        if full.device.type != "cpu":
            raise ValueError(f"unit {u}: the gradient to reduce is on {full.device}; the collectives run on host "
                             "memory (copy it down first)")
        return self.group.reduce_scatter(full)

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.sum_in_rank_order(t)

    def write(self, u: int, src: torch.Tensor) -> IOFuture:
        """``src``: this rank's reduced shard (from ``reduce``)."""
        if self.inner.on_host(u):
            self.inner.host_view(u)[: src.numel()].copy_(src)
            self.inner.done_in_place(u)
            return IOFuture.completed(src.numel() * src.element_size())
        return self.inner.write(u, src)
