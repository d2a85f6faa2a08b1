"""Error feedback for top-k compression: what a step's top-k dropped is added to the next
step's gradient instead of being lost.

The residual is fp32, one value per parameter (4 B/param), in host memory within
``memory.residual_host_mib`` and otherwise in ``residual.bin`` on the storage tier, read
and written once per step. It is part of the training state: it is declared checkpointed,
so a resumed run with error feedback continues bit-identically. A checkpoint without it (a
run that turns error feedback on at resume) starts it at zero.
"""

from __future__ import annotations

import torch

from ..io import Storage
from ..state.decl import StateDecl
from ..state.regions import TieredRegions

__all__ = ["ErrorFeedback"]

OWNER = "top-k error feedback"


class ErrorFeedback:
    """The residual of every unit (``residual`` state), and the add / keep around top-k."""

    @staticmethod
    def declare(layout, align: int, host_bytes: int) -> StateDecl:
        return TieredRegions.declare(
            layout,
            "residual.bin",
            torch.float32,
            host_bytes,
            align,
            name="residual",
            owner=OWNER,
            checkpointed=True,
            zero_if_absent=True,
        )

    def __init__(self, layout, storage: Storage, decl: StateDecl) -> None:
        self.region = TieredRegions(layout, storage, decl)
        self.buf = torch.empty(layout.max_unit_numel, dtype=torch.float32)

    @property
    def pool_bytes(self) -> int:
        return self.buf.numel() * 4 + self.region.host_bytes

    def add(self, u: int, g: torch.Tensor) -> torch.Tensor:
        """``g`` plus unit ``u``'s residual, in fp32 on ``g``'s device (a new tensor)."""
        r = self.buf[: g.numel()]
        self.region.read(u, r).get()
        return g.float() + r.to(g.device)

    def keep(self, u: int, rest: torch.Tensor) -> None:
        """What was not sent of unit ``u`` (``rest``: the fp32 sum with the sent entries zeroed)."""
        n = rest.numel()
        self.buf[:n].copy_(rest)
        self.region.write(u, self.buf[:n]).get()

    def close(self) -> None:
        self.region.close()
