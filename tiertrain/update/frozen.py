"""The update path of a frozen model: nothing to update, the parameters alone.

With adapters (``[adapter]``) every unit of the model is frozen: no unit forms a gradient and
none has optimizer state, so the only state is the parameters' backing copy (host memory within
``memory.host_param_mib``, else ``params.bin``), written once at initialisation and then only
read. No gradient files, no master copy, no moments, no update buffers: the scratch space and
memory of a LoRA run on a model of any size are the base's parameters in their dtype
(``model.base_dtype``: narrower than the compute's, each unit upcast as it is loaded).
Chosen by the planner for adapter runs (``update.mode = 'auto'``); the adapters' own update
runs in the trainer (``adapters/train.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..config import Config
from ..device.core import base_dtype_of
from ..io import IOFuture, Storage, aligned_empty
from ..state.decl import Region, StateDecl
from ..state.layout import FlatLayout
from ..state.regions import TieredRegions
from .base import GradSink, ParamSource, Update, UpdateStats
from .baseline import RegionParams

__all__ = ["FrozenUpdate"]

MIB = 1 << 20
OWNER = "update (frozen)"


class _Upcast(ParamSource):
    """The frozen model kept in a narrower dtype than the compute's: each unit is read into a
    staging buffer of its own dtype and upcast into the slot once the read is done (in the thread
    that waits for it). Never zero-copy: a host-resident unit is converted like a read one. The
    staging buffers (one per load in flight, at most one per slot) are made once and reused:
    ``FrozenUpdate.fixed_pools`` counts them."""

    file_backed = True

    def __init__(self, inner: RegionParams, dtype: torch.dtype, max_numel: int) -> None:
        self.inner, self.dtype, self.max_numel = inner, dtype, max_numel
        self._free: list[torch.Tensor] = []

    def on_host(self, u: int) -> bool:
        return False  # its bytes are not the slot's dtype: always loaded, converted

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("a converted unit has no host view")

    def _take(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        src = self.inner.dtype  # aligned: O_DIRECT reads into it
        return aligned_empty(self.max_numel * src.itemsize).view(src)

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        if self.inner.on_host(u):  # upcast straight from host memory
            out.copy_(self.inner.host_view(u))
            return IOFuture.completed(out.numel() * self.inner.dtype.itemsize)
        staging = self._take()
        buf = staging[: out.numel()]

        def upcast() -> None:
            out.copy_(buf)
            self._free.append(staging)

        return self.inner.load(u, buf).then(upcast)


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
    def fixed_pools(cls, cfg: Config, rt) -> dict[str, int]:
        """With the model kept narrower than the compute: a staging buffer per slot to upcast from."""
        base = base_dtype_of(cfg.model.base_dtype, rt.dtype)
        if base == rt.dtype:
            return {}
        return {"upcast staging": cfg.memory.device_slots * rt.layout.max_unit_numel * base.itemsize}

    @classmethod
    def declare(
        cls, cfg: Config, layout: FlatLayout, pdtype: torch.dtype, align: int, paths: list[str]
    ) -> list[StateDecl]:
        return [
            TieredRegions.declare(
                layout,
                "params.bin",
                base_dtype_of(cfg.model.base_dtype, pdtype),
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
        params = RegionParams(self._params)
        self.params = params if self._params.dtype == pdtype else _Upcast(params, pdtype, layout.max_unit_numel)
        self.grads = _NoGrads()

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
