"""The RNG state before a unit's forward, replayed in its recompute (dropout draws the same)."""

from __future__ import annotations

import torch

from ..device.core import Device

__all__ = ["UnitRng"]


class UnitRng:
    """The RNG state(s) before a unit's forward, to replay dropout in the recompute (the
    compute device's own generator on CUDA, whichever index it has)."""

    def __init__(self, dev: Device) -> None:
        self.device = dev.device if dev.cuda else None
        self.cpu = torch.get_rng_state()
        self.gpu = torch.cuda.get_rng_state(self.device) if self.device is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.gpu is not None:
            torch.cuda.set_rng_state(self.gpu, self.device)
