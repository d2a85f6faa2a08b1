"""The baseline update path: the streamed optimizer in the trainer, after the backward.

Owns ``params`` (the parameters' backing copy: host memory within ``memory.host_param_mib``,
else ``params.bin``), ``grads`` (within ``memory.grad_host_mib``, else ``grads.bin``) and the
optimizer's states (``optimizer_states``: within ``memory.optim_host_mib``, else files).
``step`` streams every unit's state through three fixed buffer sets, layer 0 first.

Speculating (``update.speculate = "on"``, ``update/speculate.py``), each unit is updated in the
trainer's thread during the backward, as soon as its gradient is home, into the other half of
its states; ``step`` judges: kept (the halves flip) or redone from the current half with the
clip. On this path the speculative update runs on the same thread as the backward, so it hides
nothing (the cost model predicts no gain and ``auto`` never picks it): it exists so that a run
on the baseline path gets the speculative path's exact math and bookkeeping, not a refusal.
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
from ..state.scales import ScaleLayout
from .adamw8bit import eight_bit
from .base import GradSink, ParamSource, Update, UpdateStats
from .speculate import Speculation
from .streamed import StreamedOptimizer, optimizer_states, update_set_bytes

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


class _SpeculatingGrads(RegionGrads):
    """The gradient region of a speculating baseline: each unit's gradient, once home, is
    handed to the update (``BaselineUpdate.arrived``)."""

    def __init__(self, owner: "BaselineUpdate", region) -> None:
        super().__init__(region)
        self.o = owner

    def write(self, u: int, src: torch.Tensor) -> IOFuture:
        fut = self.region.write(u, src)
        self.o.arrived(u, fut)
        return fut

    def done_in_place(self, u: int) -> None:
        self.o.arrived(u, IOFuture.completed())


class BaselineUpdate(Update):
    name = "baseline"
    auto_candidate = speculates = True

    @classmethod
    def fixed_pools(cls, cfg: Config, rt) -> dict[str, int]:
        # the streamed optimizer's three sets
        one = update_set_bytes(cfg, rt.dtype, rt.align, rt.layout.max_unit_numel)
        pools = {"update buffers": 3 * one}
        if eight_bit(cfg.optim):  # a record of scales a unit in flight (``StreamedOptimizer``)
            pools["8-bit states' scales"] = 3 * 4 * ScaleLayout(rt.state_layout).max_unit_numel
        return pools

    @classmethod
    def predict_step(cls, c):
        """After the backward, on the trainer's thread; speculating, the same time (the update
        runs on the backward's thread, between its units), a step the clip acts in more."""
        phases, step, bound, notes = super().predict_step(c)
        if c.cfg.update.speculate == "on":
            notes = [
                *notes,
                "baseline (speculative): each unit's update runs in the trainer's thread as its gradient is home, "
                f"hiding nothing; a step where the clip acts redoes them (up to {c.upd.time_s:.2f} s more)",
            ]
        return phases, step, bound, notes

    @classmethod
    def declare(
        cls, cfg: Config, layout: FlatLayout, pdtype: torch.dtype, align: int, paths: list[str]
    ) -> list[StateDecl]:
        m = cfg.memory
        weights_first = pdtype == torch.float32  # without a master copy the parameters are the weights
        double = cfg.update.speculate == "on"  # every state the step writes, twice (``state/double.py``)
        return [
            *optimizer_states(
                cfg.optim,
                layout,
                pdtype,
                align,
                m.optim_host_mib * MIB,
                owner=OWNER,
                double=double,
                device_bytes=(m.optim_device_mib or 0) * MIB,
            ),  # fmt: skip
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

    def __init__(
        self, cfg: Config, layout: FlatLayout, storage: Storage, pdtype: torch.dtype, *, pin: bool, dev=None
    ) -> None:
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
            dev=dev if dev is not None and dev.separate else None,  # device memory of its own (CUDA)
        )
        self.spec = Speculation(on=cfg.update.speculate == "on")  # states held twice: ``declare``
        self.redone = 0  # speculative steps redone with the clip (each one more update's I/O)
        # elements updated speculatively in steps then redone (this path: every unit but the
        # backward's last, whose update had not started at the judgement)
        self.wasted_numel = 0
        if self.spec.on:
            self.grads = _SpeculatingGrads(self, self._grads)
        self._step, self._lr = 0, 0.0
        self._arrived: list[tuple[int, IOFuture]] = []  # this step's units whose gradients are on their way home
        self._speculated: set[int] = set()  # this step's units updated (into the other half)
        self._spec_stats = UpdateStats()  # the speculative updates run under the backward since the last record()

    def init_unit(self, u: int, flat32: torch.Tensor) -> None:
        self.optim.init_unit(u, flat32)

    def begin_step(self, step: int, lr: float) -> None:
        # a step abandoned before its judgement (an error) wrote only other halves: dropped
        self._step, self._lr, self._arrived, self._speculated = step, lr, [], set()
        self.spec.begin(step)

    def arrived(self, u: int, home: IOFuture) -> None:
        """Unit ``u``'s gradient is on its way home (``home``). Speculating, the units before it
        (and it, where already home) are updated now, in the trainer's thread, with coefficient
        1: every unit but the backward's last is updated before the judgement."""
        if not self.spec.this_step:
            return
        self._arrived.append((u, home))
        while self._arrived and (len(self._arrived) > 1 or self._arrived[0][1].done()):
            v, fut = self._arrived.pop(0)
            fut.get()  # sync point, rarely waits: it was written while the next unit's backward ran
            self._speculate(v)

    def _speculate(self, u: int) -> None:
        self._speculated.add(u)
        self._spec_stats.add(self.optim.step(self._lr, None, step=self._step, units=[u]))  # into the other half

    def step(self, step: int, lr: float, clip_coef: torch.Tensor | None) -> UpdateStats:
        if not self.spec.this_step:  # not speculating (or stopped: its states are still held twice)
            st = self.optim.step(lr, clip_coef, step=step)
        else:
            st = self._judge_inline(step, lr, clip_coef)
        if self.spec.on:  # every write went to the other halves: they become the current ones
            for unit in self.optim.trainable:
                self.optim.flip(unit.index)
        return st

    def _judge_inline(self, step: int, lr: float, clip_coef: torch.Tensor | None) -> UpdateStats:
        """A speculative step, once the norm is known: kept (the units not updated yet are
        updated now) or redone from the current halves with the clip."""
        kept = self.spec.keeps(clip_coef)  # sync point on CUDA: one scalar
        self.spec.judged(step, kept)
        arrived, self._arrived = self._arrived, []
        if kept:  # the units not updated yet (gradients home last, or none this step): now
            for _, home in arrived:
                home.get()  # sync point: the gradient is home
            done = self._speculated
            st = self.optim.step(
                lr, None, step=step, units=[x.index for x in self.optim.trainable if x.index not in done]
            )
        else:  # the speculative writes went to the other halves: redone over them from the current ones
            self.redone += 1
            self.wasted_numel += sum(self.layout.units[u].numel for u in self._speculated)
            st = self.optim.step(lr, clip_coef, step=step)
        return st

    def record(self) -> dict:
        if not self.spec.on:
            return {}
        b, self._spec_stats = self._spec_stats, UpdateStats()
        # the last step's judgement (None: it did not speculate), the run's tally, and the
        # speculative updates' seconds inside the backward
        return {"speculation_kept": self.spec.last, "speculation": self.spec.summary(), "update_spec_s": b.seconds}

    def restored(self, step: int) -> None:
        self.optim.step_count = step
        self.spec.judged_through = step  # the checkpoint's step was kept (a checkpoint never holds another)

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
