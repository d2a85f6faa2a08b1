"""What the trainer and its update engines say to each other: typed messages over an
authenticated Unix socket (pickled frozen dataclasses; no tensor is ever pickled: tensors
cross through shared-memory slots), the engine's lifecycle, and its step report.

Trainer -> engine:
    Init(unit, slot)                      fp32 weights of the engine's slice of ``unit`` in gradient slot ``slot``
    Grad(unit, slot, step, lr, nnz, spec) a gradient slice in ``slot`` (``nnz >= 0``: top-k, packed indices+values);
                                          ``spec``: kept for a redo, and the unit updated now with coefficient 1
                                          into the other half of its states (the speculative update)
    Step(step, lr, coef, keep)            update every unit in order (``coef`` None: no clipping); after
                                          speculative gradients, the trainer's judgement ``keep``: True, the
                                          halves flip; False, redone from the current halves with ``coef``
    Slots(name, stride, count, want_at)   the trainer's parameter slots in shared memory (CPU)
    Release() / Reopen()                  hand the state files to the trainer (checkpoints) and back
    Stop()
Engine -> trainer:
    Ready(), Free(slot), Done(unit, first_block, crcs, served_slot, half), Stepped(report),
    Attached(), Released(), Reopened(), Alive(progress), Failed(line, traceback)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from ...errors import TiertrainError
from ...state.machine import Machine

__all__ = [
    "Init",
    "Grad",
    "Step",
    "Slots",
    "Release",
    "Reopen",
    "Stop",
    "Ready",
    "Free",
    "Done",
    "Stepped",
    "Attached",
    "Released",
    "Reopened",
    "Alive",
    "Failed",
    "StepReport",
    "EngineState",
    "EngineError",
    "ENGINE",
]


# -- trainer -> engine -------------------------------------------------------------------------
@dataclass(frozen=True)
class Init:
    unit: int
    slot: int


@dataclass(frozen=True)
class Grad:
    unit: int
    slot: int
    step: int
    lr: float
    nnz: int = -1  # >= 0: top-k payload of nnz entries
    spec: bool = False  # the speculative update: update now (coefficient 1), keep the gradient for a redo


@dataclass(frozen=True)
class Step:
    step: int
    lr: float
    coef: float | None
    keep: bool | None = None  # a speculative step's judgement (None: the step did not speculate)


@dataclass(frozen=True)
class Slots:
    name: str
    stride: int
    count: int
    want_at: int


@dataclass(frozen=True)
class Release:
    pass


@dataclass(frozen=True)
class Reopen:
    pass


@dataclass(frozen=True)
class Stop:
    pass


# -- engine -> trainer -------------------------------------------------------------------------
@dataclass(frozen=True)
class StepReport:
    """What an engine did for one optimizer step (from the end of its previous report)."""

    seconds: float  # the update's wall time
    read: int  # bytes read on its storage (update, read-ahead, spilled gradients)
    written: int
    wait_s: float  # blocked on its I/O
    compute_s: float
    ahead: int  # chunks whose state was read ahead
    chunks: int
    cpu_s: float  # CPU seconds of all its threads
    peak_host: int  # its peak RSS so far
    base_host: int  # its RSS before any pool was made
    pool: int  # its fixed pools
    engine: int = -1  # set by the trainer

    def __getitem__(self, key: str):  # reports read like records: r["ahead"]
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class Free:
    slot: int


@dataclass(frozen=True)
class Done:
    unit: int
    first_block: int
    crcs: tuple[int, ...]
    served_slot: int  # the trainer's parameter slot it wrote the unit into, or -1
    half: int = 0  # states held twice (speculation): the half now current (``crcs`` are its file's)


@dataclass(frozen=True)
class Stepped:
    report: StepReport


@dataclass(frozen=True)
class Attached:
    pass


@dataclass(frozen=True)
class Released:
    pass


@dataclass(frozen=True)
class Reopened:
    pass


@dataclass(frozen=True)
class Alive:
    progress: int


@dataclass(frozen=True)
class Failed:
    line: str
    traceback: str


# -- lifecycle -----------------------------------------------------------------------------------
class EngineError(TiertrainError, RuntimeError):
    """An update engine died, hung or failed. What to run next is not said here: the command line
    adds it, knowing whether a checkpoint exists."""


class EngineState(str, enum.Enum):
    """An engine as the trainer sees it."""

    STARTING = "starting"  # process started, not yet connected and ready
    READY = "ready"  # owns its files: takes gradients and steps
    RELEASED = "released"  # its files are handed to the trainer (checkpoint)
    STOPPED = "stopped"


ENGINE = Machine(
    "update engine",
    {
        EngineState.STARTING: {EngineState.READY, EngineState.STOPPED},
        EngineState.READY: {EngineState.RELEASED, EngineState.STOPPED},
        EngineState.RELEASED: {EngineState.READY, EngineState.STOPPED},
        EngineState.STOPPED: set(),
    },
)
