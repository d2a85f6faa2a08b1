"""How a step's loss is made from its micro-batches' losses: the one place its divisor lives,
used by the executor (each micro-batch's share in the backward, the head's divisor), the
vocabulary pieces' head, the validation loss and the trainer (the step's loss over the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossScale"]


@dataclass(frozen=True)
class LossScale:
    """A step of ``micro_batches`` micro-batches on each of ``world`` ranks.

    Text (every target scored, ``scored`` None): a micro-batch's loss is the mean over its
    targets; the step's loss is the mean over every rank's micro-batches, so each micro-batch
    enters the backward scaled by ``1 / (micro_batches x world)``. Examples (targets masked):
    a micro-batch's loss is its summed cross-entropy over ``scored``, the step's scored
    targets on every rank: already its share of the step's mean (the split of the step into
    micro-batches and ranks does not change the loss)."""

    micro_batches: int
    world: int = 1
    scored: int | None = None

    @property
    def divisor(self) -> int | None:
        """The head's divisor (its loss the sum over the targets over this), or None: the mean."""
        return self.scored

    def token_divisor(self, targets: int) -> int:
        """What one target's cross-entropy is divided by in the step's loss (``targets``: a
        micro-batch's)."""
        return self.scored if self.scored else targets * self.micro_batches * self.world

    def share(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss as its share of the step's, for the backward."""
        return loss if self.scored else loss / (self.micro_batches * self.world)

    def mean(self, total: float) -> float:
        """The step's loss from the sum of its micro-batches' losses (every rank's)."""
        return total if self.scored else total / (self.micro_batches * self.world)
