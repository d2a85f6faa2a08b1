"""The speculative update's bookkeeping (``update.speculate``), for the streamed paths: the
overlapped one (its update thread, ``update/overlap.py``) and the baseline (the trainer's own
thread, between the backward's units, ``update/baseline.py``).

With clipping, the step's coefficient is known only after the whole backward. Speculation
updates each unit as its gradient is home, as if the coefficient will be 1, into the other
half of its states (``state/double.py``); after the backward (``judge``):

- the clip did not act and the norm is finite (the coefficient is exactly 1.0): the step is
  kept, and each unit's halves flip as its update completes. Exact: ``clip_grad_norm_``
  multiplies every gradient by 1.0, which leaves it as it is;
- otherwise the speculative writes are drained and the step is redone from the current half
  with the coefficient (one more update's reads and writes), then flipped.

A run where the clip keeps acting (more than a quarter of at least ``MIN_STEPS`` speculative
steps redone) stops speculating and says so: each redo costs a whole update's I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = ["Speculation", "MIN_STEPS"]

log = logging.getLogger("tiertrain")

MIN_STEPS = 8  # speculative steps seen before the clip's rate may turn speculation off


@dataclass
class Speculation:
    """Where the run's speculation stands (one per streamed update path)."""

    on: bool  # the run's states are held twice and steps speculate (until ``stopped``)
    this_step: bool = False  # the step under way updates units as their gradients arrive
    judged_through: int = 0  # every step up to this one is judged (kept or redone) or did not speculate
    steps: int = 0  # speculative steps judged
    held: int = 0  # of which kept
    stopped: str = ""  # why speculation stopped, once it has
    last: bool | None = None  # the last judged step: kept (True), redone (False); None: did not speculate

    def begin(self, step: int) -> None:
        """Step ``step`` starts: it speculates while the run does (else it needs no judgement)."""
        self.this_step = self.on and not self.stopped
        self.last = None
        if not self.this_step:
            self.judged_through = step

    def judged_at(self, step: int) -> bool:
        """Whether step ``step``'s new state is the step's (judged, or not speculative)."""
        return step <= self.judged_through

    @staticmethod
    def keeps(coef: torch.Tensor | None) -> bool:
        """Whether a speculative step (made with coefficient 1) is the step: the clip
        coefficient is exactly 1 (no clip acted, the norm is finite). A sync point on CUDA."""
        return coef is None or bool(coef.to("cpu") == 1.0)

    def judged(self, step: int, kept: bool) -> None:
        """Step ``step`` is judged: count it; stop speculating where the clip keeps acting."""
        self.judged_through, self.last = step, kept
        self.steps += 1
        self.held += kept
        redone = self.steps - self.held
        if self.steps >= MIN_STEPS and 4 * redone > self.steps and not self.stopped:
            self.stopped = (
                f"the clip acted in {redone} of {self.steps} speculative steps (more than a quarter), each redone "
                "at the cost of one more update's I/O: speculation off for the rest of the run "
                "(update.speculate = 'off' skips it from the start)"
            )
            log.warning("update.speculate: %s", self.stopped)

    def summary(self) -> str:
        """``speculation held in N of M steps`` (and why it stopped)."""
        out = f"speculation held in {self.held} of {self.steps} steps"
        return out + (f"; stopped: {self.stopped}" if self.stopped else "")
