"""A step cut short by an exception (a notebook's interrupt in ``Trainer.train_step()``, an error
inside it): what of the Trainer may still be used.

The slots and the walk are mid-step once a step is cut short: a second ``train_step()`` ran into
the slots' state machine (``BOUND -> BOUND``), so every later step is refused by name. The
states are another matter: until the update begins they are the last finished step's (a
checkpoint of them is that step's, restored bit for bit); once it has begun (under the backward
with the speculative update) some units may hold the next step's, and a checkpoint of them was
labelled the last step's (measured: a baseline step cut in its update, saved and resumed, ended
1.4e-4 away from the run not cut). Such states are never saved or read as weights."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from ..errors import TiertrainError

__all__ = ["StepGuard"]


@dataclass(frozen=True)
class _Cut:
    step: int  # the step cut short
    whole: int  # the step whose states the Trainer holds whole
    torn: bool  # the update had begun: the states are partly the next step's
    why: str  # the exception, in words


class StepGuard:
    """The phase of the step under way, and the step cut short, if one was (see the module
    docstring). ``phase``: None between steps; ``computing`` (the forward and the backward:
    the walk mid-step), ``computed`` (the gradients formed, the walk done), ``updating`` (some
    states may be written), ``done`` (the step finished: its validation)."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.cut: _Cut | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Step ``step`` (1-based) under way (a speculative update's writes under the backward go
        to the states' other halves: the committed ones are whole until the update judges them)."""
        self.phase = "computing"
        try:
            yield
        except BaseException as exc:
            if self.phase == "computed":  # the walk done, nothing written: the step may be taken again
                raise  # (a speculative step's speculation is dropped then: tests/test_speculate.py)
            text = str(exc).split("\n")[0]
            why = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
            done = self.phase == "done"
            self.cut = _Cut(step, step if done else step - 1, self.phase == "updating", why)
            raise
        finally:
            self.phase = None

    def refuse(self, what: str, *, reads_states: bool = False) -> None:
        """Refuse ``what`` after a step was cut short: a step, an initialisation or a restore
        always (the slots are mid-step), what reads the states (``reads_states``: a checkpoint,
        the weights) where they are torn."""
        cut = self.cut
        if cut is None or (reads_states and not cut.torn):
            return
        if cut.torn:
            raise TiertrainError(
                f"Trainer.{what}: step {cut.step} was cut short in its update ({cut.why}): some units hold its "
                f"update and others not, the states of no step; close() this Trainer, make a new one and "
                f"restore() the last checkpoint"
            )
        raise TiertrainError(
            f"Trainer.{what}: step {cut.step} was cut short ({cut.why}) and this Trainer cannot step on; "
            f"save_checkpoint() keeps the states of step {cut.whole} whole, then close() it, make a new Trainer "
            f"and restore() that checkpoint"
        )
