"""The update interface: what the trainer asks of an update path, and the two seams through
which the rest of the system reaches it.

An update path owns the parameters' backing copy, the gradients after the backward and the
optimizer state. The trainer holds one ``Update`` and never asks which kind it is:

- ``params`` (a ``ParamSource``): where the parameter store loads a unit's current
  parameters from, gated by the update (a unit is loaded once it has been updated);
- ``grads`` (a ``GradSink``): where the gradient store hands a unit's complete gradient;
- ``init_unit``, ``finish_init``, ``begin_step``, ``step``: initialise, run (or start) an
  optimizer step (an update still running is waited for by ``regions()`` and by the
  parameter source's loads);
- ``states`` (its ``StateDecl``s, declared before any file exists) and ``regions()`` (the
  checkpointed ones, readable and writable per unit while the update is paused);
- ``pools()`` and ``record()``: its fixed memory and its counters for the per-step record.

Implementations: ``update.baseline.BaselineUpdate`` (the streamed optimizer in the trainer,
after the backward) and ``update.engines.EngineUpdate`` (worker processes next to storage,
under the next forward). A new update path is a new implementation, registered in
``UPDATES`` (``update/__init__.py``).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from ..io import IOFuture
from ..state.decl import Region, StateDecl

__all__ = ["ParamSource", "GradSink", "Update", "UpdateStats"]


@dataclass
class UpdateStats:
    seconds: float = 0.0
    wait_s: float = 0.0  # blocked on reads or writes
    compute_s: float = 0.0
    chunks: int = 0
    ahead: int = 0  # chunks whose state was read ahead


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


class Update(abc.ABC):
    """An update path (see the module docstring)."""

    name: str
    params: ParamSource
    grads: GradSink
    states: list[StateDecl]

    @abc.abstractmethod
    def init_unit(self, u: int, flat32: torch.Tensor) -> None:
        """Unit ``u``'s initial fp32 weights (``flat32``, reusable when this returns): the
        parameters, the master copy, zeroed moments."""

    def finish_init(self) -> None:
        """Every unit was given; return once they are all written."""

    def share_slots(self, count: int, numel: int) -> list[torch.Tensor] | None:
        """Parameter slots the update can write new parameters into directly, or None."""
        return None

    def begin_step(self, step: int, lr: float) -> None:
        """Before the backward of optimizer step ``step``."""

    @abc.abstractmethod
    def step(self, step: int, lr: float, clip_coef: torch.Tensor | None) -> UpdateStats:
        """Apply (or start) optimizer step ``step``: every gradient has been handed to
        ``grads``. What the returned stats count is the time the trainer spent in it."""

    def wait_all(self) -> None:
        """Return once every update started has finished (raising an error it hit)."""

    def restored(self, step: int) -> None:
        """The state was restored from a checkpoint of ``step``."""

    @abc.abstractmethod
    @contextlib.contextmanager
    def regions(self) -> Iterator[dict[str, Region]]:
        """Every checkpointed state by name, readable and writable per unit (the update is
        paused meanwhile)."""

    @abc.abstractmethod
    def pools(self) -> dict[str, int]:
        """Fixed memory by pool, bytes."""

    def record(self) -> dict:
        """Counters for the per-step record since the last call (empty if none)."""
        return {}

    @abc.abstractmethod
    def close(self) -> None: ...
