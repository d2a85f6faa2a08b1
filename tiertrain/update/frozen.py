"""The update path of a frozen model: nothing to update, the parameters alone.

With adapters (``[adapter]``) every unit of the model is frozen: no unit forms a gradient and
none has optimizer state, so the only state is the parameters' backing copy (host memory within
``memory.host_param_mib``, else ``params.bin``), written once at initialisation and then only
read. No gradient files, no master copy, no moments, no update buffers: the scratch space and
memory of a LoRA run on a model of any size are the base's parameters in their dtype.
Chosen by the planner for adapter runs (``update.mode = 'auto'``); the adapters' own update
runs in the trainer (``adapters/train.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..config import Config
from ..io import Storage
from ..state.decl import Region, StateDecl
from ..state.layout import FlatLayout
from ..state.regions import TieredRegions
from .base import GradSink, Update, UpdateStats
from .baseline import RegionParams

__all__ = ["FrozenUpdate"]

MIB = 1 << 20
OWNER = "update (frozen)"


class _NoGrads(GradSink):
    """No unit of a frozen model has a gradient: anything handed here is a bug."""

    dtype = torch.float32
    file_backed = False

    def on_host(self, u: int) -> bool:
        raise RuntimeError(f"unit {u} handed a gradient, but every unit is frozen")

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError(f"unit {u} handed a gradient, but every unit is frozen")

    def write(self, u: int, src: torch.Tensor):
        raise RuntimeError(f"unit {u} handed a gradient, but every unit is frozen")


class FrozenUpdate(Update):
    name = "frozen"

    @classmethod
    def declare(
        cls, cfg: Config, layout: FlatLayout, pdtype: torch.dtype, align: int, paths: list[str]
    ) -> list[StateDecl]:
        return [
            TieredRegions.declare(
                layout,
                "params.bin",
                pdtype,
                cfg.memory.host_param_mib * MIB,
                align,
                name="params",
                owner=OWNER,
                checkpointed=True,
                weights=True,
            )
        ]

    def __init__(self, cfg: Config, layout: FlatLayout, storage: Storage, pdtype: torch.dtype, *, pin: bool) -> None:
        self.cfg, self.layout = cfg, layout
        self.states = self.declare(cfg, layout, pdtype, storage.record_align, storage.paths)
        self._params = TieredRegions(layout, storage, self.states[0], pin=pin)
        self.params, self.grads = RegionParams(self._params), _NoGrads()

    def init_unit(self, u: int, flat32: torch.Tensor) -> None:
        d = self._params.dtype
        self._params.write(u, flat32 if d == torch.float32 else flat32.to(d)).get()

    def step(self, step: int, lr: float, clip_coef: torch.Tensor | None) -> UpdateStats:
        return UpdateStats()

    @contextlib.contextmanager
    def regions(self) -> Iterator[dict[str, Region]]:
        yield {"params": self._params}

    def pools(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._params.close()
