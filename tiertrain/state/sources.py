"""The two seams between the stores and the update path, where they are consumed: the
parameter store loads a unit's parameters from a ``ParamSource``, the gradient store hands a
unit's complete gradient to a ``GradSink``. An update path provides one of each (the backing
copy of the parameters it updates, the home of the gradients it reads); ranks wrap them
(``dist/shard.py``); forward-only drivers have sources of their own (``inference/weights.py``).
"""

from __future__ import annotations

import abc

import torch

from ..io import IOFuture

__all__ = ["ParamSource", "GradSink"]


class ParamSource(abc.ABC):
    """Where the forward's parameters come from (the parameter store's backing copy).

    Units kept in host memory are used in place on CPU (``host_view``); the others are
    loaded into a slot (CPU) or a staging buffer (CUDA) by ``load``."""

    dtype: torch.dtype
    file_backed: bool = True  # some units come from the storage tier: CUDA loads need pinned staging
    # loads must follow the schedule alone, never the copies' progress (ranks: each is a collective)
    ordered: bool = False

    @abc.abstractmethod
    def on_host(self, u: int) -> bool: ...

    @abc.abstractmethod
    def host_view(self, u: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        """Start bringing unit ``u``'s current parameters into the CPU tensor ``out`` (slot
        ``slot`` of the store, when the store's slots are shared with the update). Never
        blocks; the future's ``get`` waits for the update of ``u`` where it is still running."""

    def loaded_bytes(self, u: int, numel: int, itemsize: int) -> int:
        """Bytes a load of unit ``u`` (``numel`` elements of ``itemsize`` bytes in its slot) reads
        from where the unit is kept: the slot's bytes, unless it is kept narrower (a widened or
        quantized frozen base)."""
        return numel * itemsize

    def attach(self, dev) -> None:
        """The parameter store that loads from this source runs on ``dev`` (called once, before
        any load): a source may then leave work to the device (``finish_on_device``)."""

    def finish_on_device(self, u: int, flat: torch.Tensor) -> None:
        """Make unit ``u``'s parameters in its slot ``flat`` on the device from what was loaded
        into it (``filled``), queued on the compute stream: called once per load, when the unit
        is first bound. The default: the load made them already."""

    def filled(self, u: int) -> list[tuple[int, int]] | None:
        """The element ranges of unit ``u`` that ``load`` fills (None: all of it); where device
        memory is separate, only these are uploaded."""
        return None

    def settle(self, u: int) -> float:
        """Return once unit ``u``'s host-resident parameters (used in place) are current: an
        update still writing them is waited for. Returns the seconds waited."""
        return 0.0

    def settled(self, u: int) -> bool:
        """Whether ``settle(u)`` would return at once (never blocks)."""
        return True

    def can_prefetch(self, u: int) -> bool:
        """Whether a load started now is worth starting (the update does not hold it back)."""
        return True

    def write(self, u: int, src: torch.Tensor) -> IOFuture:
        """Replace unit ``u``'s parameters (sources the update alone writes refuse)."""
        raise RuntimeError(f"{type(self).__name__}: parameters are written by the update path only")

    @property
    def host_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Give back what the source holds (files, threads); the default holds nothing."""


class GradSink(abc.ABC):
    """Where a unit's complete gradient goes after its backward."""

    dtype: torch.dtype
    file_backed: bool = True  # some units go to the storage tier: CUDA copies need pinned staging
    takes_device_tensors: bool = False  # copies from the device itself (no staging, no host buffer)
    sharded: bool = False  # takes this rank's shard of the gradient summed over the ranks (``reduce``)

    @abc.abstractmethod
    def on_host(self, u: int) -> bool: ...

    @abc.abstractmethod
    def host_view(self, u: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def write(self, u: int, src: torch.Tensor) -> IOFuture:
        """Take unit ``u``'s gradient ``src`` (a CPU tensor, or a device tensor where
        ``takes_device_tensors``); ``src`` may be reused once the future is done."""

    def reduce(self, u: int, full: torch.Tensor) -> torch.Tensor:
        """(``sharded`` sinks) This rank's shard of unit ``u``'s gradient ``full`` summed over
        the ranks: what ``write`` then takes. A sync point with every rank."""
        return full

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """(``sharded`` sinks) A scalar summed over the ranks, the same bits on every rank."""
        return t

    def claim(self, u: int) -> None:
        """The backward is about to produce unit ``u``'s gradient (host-resident ones in
        place, in ``host_view``): return once no update still reads the previous one."""

    def done_in_place(self, u: int) -> None:
        """Unit ``u``'s host-resident gradient, produced in place, is complete (``write`` is
        not called for it)."""

    @property
    def host_bytes(self) -> int:
        return 0
