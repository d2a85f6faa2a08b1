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
from ..io import IOFuture, Storage, aligned_empty
from ..state.decl import Region, StateDecl
from ..state.layout import FlatLayout
from ..state.regions import TieredRegions
from .base import GradSink, ParamSource, Update, UpdateStats
from .baseline import RegionParams

__all__ = ["FrozenUpdate", "base_dtype_of"]

MIB = 1 << 20
OWNER = "update (frozen)"


def base_dtype_of(cfg: Config, pdtype: torch.dtype) -> torch.dtype:
    """The dtype the frozen model is kept in (``model.base_dtype``; default the compute's)."""
    return getattr(torch, cfg.model.base_dtype) if cfg.model.base_dtype else pdtype


class _Upcast(ParamSource):
    """The frozen model kept in a narrower dtype than the compute's: each unit is read into a
    buffer of its own dtype and upcast into the slot once the read is done (in the thread that
    waits for it). Never zero-copy: a host-resident unit is converted like a read one."""

    file_backed = True

    def __init__(self, inner: RegionParams, dtype: torch.dtype) -> None:
        self.inner, self.dtype = inner, dtype

    def on_host(self, u: int) -> bool:
        return False  # its bytes are not the slot's dtype: always loaded, converted

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("a converted unit has no host view")

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        src = self.inner.dtype
        buf = aligned_empty(out.numel() * src.itemsize).view(src)  # aligned: O_DIRECT reads into it
        if self.inner.on_host(u):
            buf.copy_(self.inner.host_view(u))
            out.copy_(buf)
            return IOFuture.completed(buf.numel() * src.itemsize)
        return self.inner.load(u, buf).then(lambda: out.copy_(buf))


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
                base_dtype_of(cfg, pdtype),
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
        self.params = params if self._params.dtype == pdtype else _Upcast(params, pdtype)
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
