"""Gradient buffers on the device, and where gradients wait for the update.

During the backward, unit ``u``'s gradients accumulate, in micro-batch order, in a device
buffer bound as its parameters' ``.grad`` (autograd adds in place into the views). When
the unit is done (``end``), the norm of each parameter's gradient is taken on the device
and the buffer is handed off to the gradients' home, a ``GradSink`` of the update path
(host memory or a file for the baseline path; the engines' shared-memory slots). The
buffer is reused once the hand-off is complete; a fixed number of buffers exists.

With ``accum_dtype`` (float32 for bfloat16 parameters, ``train.grad_accum_dtype``), each
live unit also has a float32 accumulator: after every micro-batch (``fold``) the buffer's
gradient is added into it and the buffer zeroed, and at ``end`` the sum is rounded once into
the buffer, as FSDP2's ``reduce_dtype`` does, instead of once per micro-batch.

A unit whose parameters are borrowed by a later unit (an embedding tied to the head)
keeps its buffer from the borrower's backward to its own: the head's gradient for the
shared weight is accumulated first, the embedding's own at the end.
"""

from __future__ import annotations

import torch

from ..io import BufferPool, IOFuture
from .layout import FlatLayout

__all__ = ["GradStore", "accum_dtype_for"]


def accum_dtype_for(setting: str, micro_batches: int, dtype: torch.dtype) -> torch.dtype | None:
    """The accumulators' dtype for ``train.grad_accum_dtype`` = ``setting``: float32 for
    lower-precision gradients summed over several micro-batches, else None (no accumulators)."""
    wide = setting == "float32" and dtype != torch.float32
    return torch.float32 if wide and micro_batches > 1 else None


class _Handoff:
    """A buffer on its way home: (separate device memory) download to host, then (file)
    write, then the buffer is free again."""

    def __init__(
        self, base: torch.Tensor, copied=None, write: IOFuture | None = None, staging=None, in_place: int | None = None
    ) -> None:
        self.base, self.copied, self.write, self.staging = base, copied, write, staging
        self.keep: torch.Tensor | None = None  # a reduced shard sent instead of the buffer: alive until home
        self.in_place = in_place  # the unit whose host-resident home the download fills


class GradStore:
    def __init__(
        self, layout: FlatLayout, sink, dev, *, buffers: int = 2, accum_dtype: torch.dtype | None = None
    ) -> None:
        self.layout, self.dev, self.dtype = layout, dev, sink.dtype
        dtype = self.dtype
        self.home = sink  # where gradients go after the backward (the update path's GradSink)
        self._count = self.buffers_for(layout, buffers)
        self._free = [dev.empty(layout.max_unit_numel, dtype) for _ in range(self._count)]
        self.buffer_bytes = self._count * layout.max_unit_numel * dtype.itemsize
        # One staging buffer per device buffer: a hand-off never waits for staging that only
        # this thread could free (with a tied embedding three buffers are in flight).
        self.accum_dtype = accum_dtype if accum_dtype not in (None, dtype) else None
        self._staging = (
            BufferPool(
                self._count,
                self.staging_unit_bytes(layout, dtype, self.accum_dtype, sink.sharded),
                pin=dev.pin,
                name="grad-staging",
            )
            if dev.separate and sink.file_backed and not sink.takes_device_tensors
            else None
        )
        self._live: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # unit -> (view, pool buffer)
        self._acc_free = (
            [dev.empty(layout.max_unit_numel, self.accum_dtype) for _ in range(self._count)]
            if self.accum_dtype is not None
            else []
        )
        self.accum_bytes = len(self._acc_free) * layout.max_unit_numel * (self.accum_dtype or dtype).itemsize
        self._acc: dict[int, torch.Tensor] = {}  # live unit -> its accumulator
        self._pending: list[_Handoff] = []
        self.norms: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def buffers_for(layout: FlatLayout, buffers: int = 2) -> int:
        """Device gradient buffers: ``buffers`` in flight, plus one per unit whose parameters a
        later unit borrows (it stays live from the borrower's backward to its own); none where
        every unit is frozen (adapters: no unit forms a gradient)."""
        if all(unit.frozen for unit in layout.units):
            return 0
        return buffers + len({o for unit in layout.units for o in unit.borrows})

    @staticmethod
    def staging_unit_bytes(
        layout: FlatLayout, dtype: torch.dtype, accum_dtype: torch.dtype | None, sharded: bool
    ) -> int:
        """Bytes of one pinned staging buffer (separate device memory): a unit's gradient, or with
        ranks its sum in the accumulators' dtype where there are accumulators (it is reduced on
        the host, then rounded once)."""
        wide = accum_dtype if sharded and accum_dtype is not None else dtype
        return layout.max_unit_numel * max(dtype.itemsize, wide.itemsize)

    @staticmethod
    def accum_bytes_for(layout: FlatLayout, accum_dtype: torch.dtype | None, buffers: int = 2) -> int:
        """Bytes of the accumulators (``accum_dtype``; None: none), one per gradient buffer."""
        return (
            GradStore.buffers_for(layout, buffers) * layout.max_unit_numel * accum_dtype.itemsize if accum_dtype else 0
        )

    @property
    def pool_bytes(self) -> int:
        return (
            self.buffer_bytes
            + self.accum_bytes
            + self.home.host_bytes
            + (self._staging.size_bytes if self._staging else 0)
        )

    # -- backward side --------------------------------------------------------------------------
    def begin(self, u: int, bind: bool = True) -> None:
        """Take zeroed gradient buffers for unit ``u`` and the owners of what it borrows (not
        for a frozen one: its parameters form no gradient) and bind them as the parameters'
        ``.grad`` (``bind=False``: for a unit whose parameters are not in a slot; its gradient
        is written through ``views``)."""
        for x in (u, *self.layout.units[u].borrows):
            if x in self._live or self.layout.units[x].frozen:
                continue  # an owner already live since its borrower's backward, or frozen
            numel = self.layout.units[x].numel
            self.home.claim(x)  # sync point where the previous update still reads the old gradient
            if not self.dev.separate and self.home.on_host(x):
                base = None  # CPU: accumulate right in the gradients' home
                view = self.home.host_view(x)[:numel]
            else:
                base = self._take()
                view = base[:numel]
            view.zero_()
            self._live[x] = (view, base)
            if self.accum_dtype is not None:
                self._acc[x] = self._acc_free.pop()[:numel].zero_()
            if bind:
                self.layout.bind_grads(x, view)

    def views(self, u: int) -> list[torch.Tensor] | None:
        """The gradients of unit ``u``'s parameters while it is live (between ``begin`` and
        ``end``), in the layout's order; None for a frozen unit."""
        live = self._live.get(u)
        return None if live is None else [rec.view(live[0]) for rec in self.layout.units[u].params]

    def fold(self, units: tuple[int, ...]) -> None:
        """A micro-batch's backward through ``units`` is done: add their buffers into their
        accumulators and zero them (nothing without ``accum_dtype``). Only those units: a tied
        embedding's buffer, live through the whole backward, is folded when it was added to."""
        for x in units:
            acc = self._acc.get(x)
            if acc is None:
                continue
            view = self._live[x][0]
            acc.add_(view)
            view.zero_()

    def end(self, u: int) -> None:
        """Unit ``u``'s gradients are complete: take their norms and send them home (a frozen
        unit has none)."""
        if self.layout.units[u].frozen:
            return
        buf, base = self._live.pop(u)
        acc = self._acc.pop(u, None)
        self.layout.bind_grads(u, None)
        norm_dtype = None if self.dtype == torch.float32 else torch.float32
        if self.home.sharded:  # ranks: this rank's shard of the sum over the ranks goes home
            self._end_shard(u, buf, base, acc, norm_dtype)
            return
        if acc is not None:
            acc.add_(buf)  # whatever came after the last fold (none when every micro-batch folds)
            buf.copy_(acc)  # the one rounding
            self._acc_free.append(acc._base if acc._base is not None else acc)
        views = [rec.view(buf) for rec in self.layout.units[u].params]
        self.norms[u] = list(torch._foreach_norm(views, 2, dtype=norm_dtype)) if views else []
        if base is None:
            self.home.done_in_place(u)  # accumulated right in its home: complete now
            return
        self._pending.append(self._send(u, buf, base))
        self.poll()

    def _end_shard(self, u: int, buf: torch.Tensor, base: torch.Tensor, acc: torch.Tensor | None, norm_dtype) -> None:
        """Sum over the ranks (in the accumulator's dtype where there is one, rounded once
        after), norm of this rank's shard (alignment padding is zero), shard sent home. The
        collectives run on host memory: with separate device memory the local sum is copied
        down into pinned staging on the download stream first, and what ``reduce`` returns is
        a host tensor, written home as it is (never ``download``ed: CUDA refuses a host
        tensor there)."""
        full = buf
        if acc is not None:
            acc.add_(buf)
            full = acc
        staging = None
        if self.dev.separate:
            staging = self._staging_buffer()
            host = staging.tensor.view(full.dtype)[: full.numel()]
            self.dev.sync(self.dev.download(host, full))  # sync point: the unit's backward is done
            full = host
        shard = self.home.reduce(u, full)  # sync point with every rank; a new host tensor
        if acc is not None:
            shard = shard.to(self.dtype)  # the one rounding
            self._acc_free.append(acc._base if acc._base is not None else acc)
        if staging is not None:
            self.dev.release(staging.tensor)
            staging.release()
        self.norms[u] = [torch.linalg.vector_norm(shard, 2, dtype=norm_dtype)]
        h = _Handoff(base, write=self.home.write(u, shard))  # host memory: the home copies or writes it
        h.keep = shard
        self._pending.append(h)
        self.poll()

    def _send(self, u: int, buf: torch.Tensor, base: torch.Tensor) -> _Handoff:
        if not self.dev.separate or self.home.takes_device_tensors:  # the home copies it itself
            return _Handoff(base, write=self.home.write(u, buf))
        if self.home.on_host(u):
            return _Handoff(base, copied=self.dev.download(self.home.host_view(u), buf), in_place=u)
        staging = self._staging_buffer()
        host = staging.tensor.view(self.dtype)[: buf.numel()]
        return _Handoff(base, copied=self.dev.download(host, buf), staging=(staging, u, host))

    def _staging_buffer(self):
        """A free staging buffer; while none is, the oldest hand-off completes and gives its back."""
        while True:
            buf = self._staging.try_acquire()
            if buf is not None:
                return buf
            if not self._pending:
                raise RuntimeError("gradient store: every staging buffer is held and no hand-off is in flight")
            self._reclaim_oldest()

    def _reclaim_oldest(self) -> None:
        h = self._pending.pop(0)
        self._advance(h, block=True)
        self._give_back(h)

    def _give_back(self, h: _Handoff) -> None:
        self.dev.release(h.base)
        self._free.append(h.base)

    def _take(self) -> torch.Tensor:
        while not self._free:
            self._reclaim_oldest()
        return self._free.pop()

    def _advance(self, h: _Handoff, block: bool) -> bool:
        """Move a hand-off forward; True once its buffer is free again."""
        if h.copied is not None:
            if not block and not self.dev.done(h.copied):
                return False
            self.dev.sync(h.copied)
            h.copied = None
            if h.in_place is not None:
                self.home.done_in_place(h.in_place)
            if h.staging is not None:  # now the host copy can go to the file
                staging, u, host = h.staging
                h.write = self.home.write(u, host)
        if h.write is not None:
            if not block and not h.write.done():
                return False
            h.write.get()
            h.write = None
        if h.staging is not None:
            self.dev.release(h.staging[0].tensor)
            h.staging[0].release()
            h.staging = None
        return True

    def poll(self) -> None:
        """Reclaim buffers whose hand-off finished (never blocks)."""
        still = []
        for h in self._pending:
            if self._advance(h, block=False):
                self._give_back(h)
            else:
                still.append(h)
        self._pending = still

    def flush(self) -> None:
        """Wait until every gradient is home. A sync point before the update."""
        while self._pending:
            self._reclaim_oldest()

    # -- update side ----------------------------------------------------------------------------
    def total_norm(self) -> torch.Tensor:
        """The global 2-norm, over per-parameter norms in model parameter order (as
        ``torch.nn.utils.clip_grad_norm_`` computes it)."""
        order = self.layout.norm_order
        if order is not None and not self.home.sharded:  # layers cut: the whole model's order
            norms = [self.norms[u][i] for u, i in order if u in self.norms]
        else:
            norms = [n for u in range(len(self.layout)) for n in self.norms.get(u, [])]
        if not norms:  # every unit frozen (adapters train beside them): no gradient here
            return torch.zeros(())
        if self.home.sharded:  # over the ranks' shards: sqrt of the rank-ordered sum of squares
            return torch.sqrt(self.home.sum_over_ranks(torch.stack(norms).float().square().sum()))
        return torch.linalg.vector_norm(torch.stack(norms), 2)

    def close(self) -> None:
        self.flush()
