"""The baseline update path: the streamed optimizer in the trainer, after the backward.

Owns ``params`` (the parameters' backing copy: host memory within ``memory.host_param_mib``,
else ``params.bin``), ``grads`` (within ``memory.grad_host_mib``, else ``grads.bin``) and the
optimizer's states (``optimizer_states``: within ``memory.optim_host_mib``, else files).
``step`` streams every unit's state through three fixed buffer sets, layer 0 first.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..config import Config
from ..io import IOFuture, Storage
from ..state.decl import Region, StateDecl
from ..state.double import build_region, declare_state
from ..state.layout import FlatLayout
from ..state.regions import TieredRegions
from .base import GradSink, ParamSource, Update, UpdateStats
from .streamed import StreamedOptimizer, optimizer_states

__all__ = ["BaselineUpdate", "RegionParams", "RegionGrads"]

MIB = 1 << 20
OWNER = "update (baseline, overlap)"  # the states both streamed paths keep


class _OnRegion:
    """What the parameters' and gradients' adapters share: a ``TieredRegions`` behind them."""

    def __init__(self, region: TieredRegions) -> None:
        self.region, self.dtype = region, region.dtype
        self.file_backed = region.file is not None  # placement is fixed at start

    @property
    def file(self):
        return self.region.file  # reopened files are new objects: never a stale copy

    def on_host(self, u: int) -> bool:
        return self.region.on_host(u)

    def host_view(self, u: int) -> torch.Tensor:
        return self.region.host_view(u)

    def write(self, u: int, src: torch.Tensor) -> IOFuture:
        return self.region.write(u, src)

    @property
    def host_bytes(self) -> int:
        return self.region.host_bytes


class RegionParams(_OnRegion, ParamSource):
    """Parameters in a ``TieredRegions`` (host memory, then a file), as a ``ParamSource``."""

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        return self.region.read(u, out)


class RegionGrads(_OnRegion, GradSink):
    """Gradients into a ``TieredRegions`` (host memory, then a file), as a ``GradSink``."""


class BaselineUpdate(Update):
    name = "baseline"
    auto_candidate = True

    @classmethod
    def fixed_pools(cls, cfg: Config, rt) -> dict[str, int]:
        return {"update buffers": 3 * (cfg.memory.update_buffer_kib << 10)}  # the streamed optimizer's sets

    @classmethod
    def declare(
        cls, cfg: Config, layout: FlatLayout, pdtype: torch.dtype, align: int, paths: list[str]
    ) -> list[StateDecl]:
        m = cfg.memory
        weights_first = pdtype == torch.float32  # without a master copy the parameters are the weights
        double = cfg.update.speculate == "on"  # every state the step writes, twice (``state/double.py``)
        return [
            *optimizer_states(cfg.optim, layout, pdtype, align, m.optim_host_mib * MIB, owner=OWNER, double=double),
            declare_state(
                double,
                layout,
                "params.bin",
                pdtype,
                m.host_param_mib * MIB,
                align,
                name="params",
                owner=OWNER,
                checkpointed=True,
                weights=weights_first,
            ),
            TieredRegions.declare(
                layout, "grads.bin", pdtype, m.grad_host_mib * MIB, align, name="grads", owner=OWNER, checkpointed=False
            ),
        ]

    def __init__(self, cfg: Config, layout: FlatLayout, storage: Storage, pdtype: torch.dtype, *, pin: bool) -> None:
        self.cfg, self.layout = cfg, layout
        self.states = self.declare(cfg, layout, pdtype, storage.record_align, storage.paths)
        by = {d.name: d for d in self.states}
        self._params = build_region(layout, storage, by["params"], pin=pin)
        self._grads = TieredRegions(layout, storage, by["grads"], pin=pin)
        self.params, self.grads = RegionParams(self._params), RegionGrads(self._grads)
        self.optim = StreamedOptimizer(
            layout,
            storage,
            self._params,
            self._grads,
            cfg.optim,
            [d for d in self.states if d.name not in ("params", "grads")],
            buffer_bytes=cfg.memory.update_buffer_kib << 10,
        )

    def init_unit(self, u: int, flat32: torch.Tensor) -> None:
        self.optim.init_unit(u, flat32)

    def step(self, step: int, lr: float, clip_coef: torch.Tensor | None) -> UpdateStats:
        return self.optim.step(lr, clip_coef, step=step)

    def restored(self, step: int) -> None:
        self.optim.step_count = step

    @contextlib.contextmanager
    def regions(self) -> Iterator[dict[str, Region]]:
        yield {"params": self._params, **self.optim.regions()}

    def pools(self) -> dict[str, int]:
        """Its buffer sets and host-resident optimizer states (host-resident parameters and
        gradients are counted with the stores that use them)."""
        return {"update buffers + host states": self.optim.pool_bytes}

    def close(self) -> None:
        for r in (*self.optim.state_files, self._params, self._grads):
            r.close()
