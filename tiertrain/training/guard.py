"""The loss guard: a run whose loss or gradient norm is no longer finite stops at that step.

A NaN or an infinity in the loss (or in the global gradient norm the update scales by) has
already reached the weights when it is seen, and every later step would only carry it on. So
the step that shows it ends the run (``DivergedError``): nothing of it is saved (neither a
periodic, an interrupt nor the final checkpoint), and the last good checkpoint stays the
newest. A loss that rises far above its lowest value so far (``RISE`` times) is often the
start of such a divergence: it is said once, as a warning, and the run goes on.

Every rank sees the same loss (summed in rank order) and the same norm, so ranks stop at the
same step without a collective of their own.
"""

from __future__ import annotations

import logging
import math

from ..errors import TiertrainError

__all__ = ["DivergedError", "LossGuard", "RISE"]

log = logging.getLogger("tiertrain")
RISE = 10.0  # a loss this many times its running minimum is warned of (once)


class DivergedError(TiertrainError):
    """The loss or the gradient norm of a step is NaN or infinite."""


class LossGuard:
    """Checks each step's record (``check``): a non-finite value is an error to stop with, a rise
    is warned of once."""

    def __init__(self) -> None:
        self.lowest: tuple[float, int] | None = None  # (loss, step)
        self.warned = False

    def check(self, step: int, loss: float, grad_norm: float) -> DivergedError | None:
        """The ``DivergedError`` to stop with where ``loss`` or ``grad_norm`` is not finite (the
        caller logs the step's line, then raises it); else None, with a warning (once) where
        ``loss`` is over ``RISE`` times the lowest loss so far."""
        bad = [
            f"{name} {value}"
            for name, value in (("loss", loss), ("gradient norm", grad_norm))
            if not math.isfinite(value)
        ]
        if bad:
            return DivergedError(
                f"step {step}: the {' and the '.join(bad)} {'are' if len(bad) > 1 else 'is'} not finite; the run stopped without saving this "
                "step (its weights are no longer finite); lower optim.lr, set optim.grad_clip, or check the data"
            )
        if self.lowest is not None and loss > RISE * self.lowest[0] > 0 and not self.warned:
            self.warned = True
            log.warning(
                "step %d: the loss %.4f is over %.0fx its lowest so far (%.4f at step %d): the run may be diverging; "
                "lower optim.lr or set optim.grad_clip if it goes on rising",
                step,
                loss,
                RISE,
                *self.lowest,
            )
        if self.lowest is None or loss < self.lowest[0]:
            self.lowest = (loss, step)
        return None
