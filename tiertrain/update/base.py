"""The update interface: what the trainer asks of an update path. The two seams through which
the rest of the system reaches it, ``ParamSource`` and ``GradSink``, are where they are
consumed: ``state/sources.py``.

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

from ..state.decl import Region, StateDecl
from ..state.sources import GradSink, ParamSource

__all__ = ["ParamSource", "GradSink", "Update", "UpdateStats"]


@dataclass
class Phase:
    """One phase of a predicted step (what ``Update.predict_step`` returns, and the cost
    model's table rows)."""

    name: str
    compute_s: float
    io_s: float
    crc_s: float  # CPU seconds of CRC32C (one core)
    time_s: float
    bound: str


@dataclass
class UpdateStats:
    seconds: float = 0.0
    wait_s: float = 0.0  # blocked on reads or writes
    compute_s: float = 0.0
    chunks: int = 0
    ahead: int = 0  # chunks whose state was read ahead

    def add(self, o: "UpdateStats") -> None:
        """Count ``o``'s time and chunks in these (a tally over several partial updates)."""
        self.seconds += o.seconds
        self.wait_s += o.wait_s
        self.compute_s += o.compute_s
        self.chunks += o.chunks


class Update(abc.ABC):
    """An update path (see the module docstring)."""

    name: str
    params: ParamSource
    grads: GradSink
    states: list[StateDecl]

    # What the planner and the cost model ask of a path, before anything is built (they never
    # name one): may ``update.mode = "auto"`` choose it; does it run beside the compute (a thread
    # or other processes); may it update each unit as its gradient arrives (``update.eager``);
    # does it keep the parameters and optimizer state the trainer's memory budget places.
    auto_candidate: bool = False
    beside_compute: bool = False
    supports_eager: bool = False
    # may it update under the backward with clipping on, keeping the old state to redo a step
    # the clip acts in (``update.speculate``)
    speculates: bool = False
    compresses: bool = False  # may it take top-k compressed gradients (``update.topk``)
    states_in_trainer: bool = True
    # Units (of the compute dtype) that initialisation and autograd hold at once beyond the
    # pools: the budget's working set. Training: the initial unit, its fp32 source and the
    # update's copies, or a unit's weights and the gradients autograd forms for them.
    working_units: int = 4
    # Of those, the units a training step's unit step holds (None: all of them): what the heap
    # trim keeps room for once initialisation is done (``HeapTrim``).
    step_working_units: int | None = None
    # The dtype ``init_unit`` takes its weights in (the trainer's initialisation buffer).
    init_dtype: torch.dtype = torch.float32

    @abc.abstractmethod
    def __init__(self, cfg, layout, storage, pdtype: torch.dtype, *, pin: bool, dev=None) -> None:
        """The path for a run of ``cfg`` on the state layout ``layout``, its files on
        ``storage``, parameters in ``pdtype``; ``pin``: page-lock its host buffers; ``dev``: the
        compute device, where states the config places in its memory live (paths that keep
        every state on the host ignore it)."""

    @classmethod
    def fixed_pools(cls, cfg, rt) -> dict[str, int]:
        """Host memory the path needs whatever the placement, by pool, for a run of ``cfg`` on
        the runtime ``rt`` (the budget's fixed part)."""
        return {}

    @classmethod
    def predict_step(cls, c) -> tuple[list, float, str, list[str]]:
        """How the update's phase meets the forward's and the backward's (``cost.model.StepCosts``
        ``c``): the phases, the step's seconds, what bounds it, and notes. The default: after
        the backward, on the trainer's thread."""
        step = c.fwd.time_s + c.bwd.time_s + c.upd.time_s
        return [c.fwd, c.bwd, c.upd], step, max((c.fwd, c.bwd, c.upd), key=lambda p: p.time_s).bound, []

    @classmethod
    @abc.abstractmethod
    def declare(cls, cfg, layout, dtype: torch.dtype, align: int, paths: list[str]) -> list[StateDecl]:
        """The states a run of ``cfg`` on ``layout`` keeps through this path, before any of them
        exists (names, sizes, where each lives: the space plan and the checkpoints are made
        from them); the instance's ``states`` must be these."""

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
