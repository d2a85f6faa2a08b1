"""The trainer: builds every part from the config and runs the steps."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from .activations.stash import HiddenStash
from .config import Config, ConfigError
from .data import Corpus
from .io import Storage, aligned_empty
from .metrics import MetricsLog, StepRecord, peak_flops
from .models import WeightSource, build_model
from .schedule.executor import LayerMajorExecutor
from .state.device import Device, host_peak_rss, resolve_device, resolve_dtype
from .state.grads import GradStore
from .state.layout import FlatLayout
from .state.regions import TieredRegions
from .state.store import ParamStore
from .update.schedule import lr_at
from .update.streamed import StreamedAdamW

__all__ = ["Trainer", "SpacePlan"]

log = logging.getLogger("tiertrain")
MIB = 1 << 20


@dataclass
class SpacePlan:
    files: list[tuple[str, int]]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.files)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {n / 2**20:,.1f} MiB" for name, n in self.files if n)
        return f"{self.total / 2**30:.2f} GiB ({parts})"


class Trainer:
    """Everything a run needs, sized from the config once.

    ``weights`` overrides where the initial weights come from (tests load a plain
    PyTorch model's state this way).
    """

    def __init__(self, cfg: Config, *, weights: WeightSource | None = None) -> None:
        self.cfg = cfg
        self.dev = Device(resolve_device(cfg.train.device))
        self.dtype = resolve_dtype(cfg.train.param_dtype, self.dev.device)
        self.corpus = Corpus(cfg.data)
        if self.corpus.vocab_size > _vocab(cfg):
            raise ConfigError(
                f"model.vocab_size = {_vocab(cfg)} is smaller than the corpus vocabulary ({self.corpus.vocab_size}); "
                f"raise it to at least {self.corpus.vocab_size}"
            )
        self.model, source = build_model(cfg.model, param_dtype=self.dtype, seed=cfg.train.seed)
        self.source = weights or source
        self.layout = FlatLayout(self.model)
        self._parts: list = []
        self.storage = Storage.from_config(cfg.io)
        try:
            self.plan = self._plan()
            log.info("model: %s %s, %s; %s", cfg.model.kind, self.dtype, self.layout.describe(), self.source.describe)
            log.info("scratch space needed on %s: %s", ", ".join(cfg.io.paths), self.plan.describe())
            self.storage.check_space(self.plan.files)  # a full disk is reported here, before any work
            self._build()
        except BaseException:
            self.close()
            raise

    # -- construction -------------------------------------------------------------------------------
    def _stash_shape(self) -> tuple[int, ...]:
        d = self.cfg.data
        return (d.micro_batch_size, d.seq_len, _hidden(self.cfg, self.model))

    def _plan(self) -> SpacePlan:
        """Bytes of every file the run will create on the storage tier (made before any exists)."""
        m, lay = self.cfg.memory, self.layout
        pdt, f32 = self.dtype, torch.float32
        has_master = pdt != f32
        share = (m.optim_host_mib * MIB) // (3 if has_master else 2)

        align = self.storage.record_align
        file_bytes = lambda dtype, host: TieredRegions.plan_file_bytes(lay, dtype, host, align)  # noqa: E731
        entries = len(self.model.blocks) * self.cfg.data.micro_batches
        entry, _, spilled = HiddenStash.plan(self._stash_shape(), pdt, entries, m.stash_host_mib * MIB)
        files = [
            ("params.bin", file_bytes(pdt, m.host_param_mib * MIB)),
            ("grads.bin", file_bytes(pdt, m.grad_host_mib * MIB)),
            ("exp_avg.bin", file_bytes(f32, share)),
            ("exp_avg_sq.bin", file_bytes(f32, share)),
        ]
        if has_master:
            files.append(("master.bin", file_bytes(f32, share)))
        files.append(("stash.bin", spilled * entry))
        return SpacePlan(files)

    def _build(self) -> None:
        m = self.cfg.memory
        self.params = self._part(
            ParamStore(self.layout, self.storage, self.dev, self.dtype, slots=m.device_slots, host_bytes=m.host_param_mib * MIB)
        )
        self.grads = self._part(GradStore(self.layout, self.storage, self.dev, self.dtype, host_bytes=m.grad_host_mib * MIB))
        self.optim = self._part(
            StreamedAdamW(
                self.layout,
                self.storage,
                self.params,
                self.grads,
                self.cfg.optim,
                buffer_bytes=m.update_buffer_kib << 10,
                state_host_bytes=m.optim_host_mib * MIB,
            )
        )
        self.stash = self._part(
            HiddenStash(
                self.storage,
                self.dev,
                shape=self._stash_shape(),
                dtype=self.dtype,
                entries=len(self.model.blocks) * self.cfg.data.micro_batches,
                host_bytes=m.stash_host_mib * MIB,
            )
        )
        self.executor = LayerMajorExecutor(self.model, self.params, self.grads, self.stash, self.dev)
        self.step = 0

    def _part(self, obj):
        self._parts.append(obj)
        return obj

    @property
    def pool_bytes(self) -> dict[str, int]:
        """Fixed memory of every pool, by part (host memory on CPU; device + pinned on CUDA)."""
        return {
            "param slots + host params": self.params.pool_bytes,
            "grad buffers + host grads": self.grads.pool_bytes,
            "update buffers + host states": self.optim.pool_bytes,
            "stash": self.stash.pool_bytes,
            "io bounce": self.storage.pool_bytes,
        }

    # -- weights ------------------------------------------------------------------------------------
    def initialize(self, progress: bool = True) -> None:
        """Write initial weights (and optimizer state) unit by unit: memory of one unit."""
        from tqdm import tqdm

        flat = aligned_empty(self.layout.max_unit_numel * 4).view(torch.float32)
        low = aligned_empty(self.layout.max_unit_numel * self.dtype.itemsize).view(self.dtype) if self.dtype != torch.float32 else flat
        for unit in tqdm(self.layout.units, desc="init weights", disable=not progress, unit="unit"):
            names = [r.name for r in unit.params]
            values = self.source.load(unit.index, names)
            view = flat[: unit.numel]
            view.zero_()
            for rec in unit.params:
                t = values[rec.name]
                if tuple(t.shape) != tuple(rec.shape):
                    raise ConfigError(f"weights for {rec.name} have shape {tuple(t.shape)}, the model expects {tuple(rec.shape)}")
                view[rec.offset : rec.offset + rec.numel].copy_(t.reshape(-1))
            futs = self.optim.init_unit(unit.index, view)
            if low is not flat:
                low[: unit.numel].copy_(view)
            futs.append(self.params.write(unit.index, low[: unit.numel]))
            for f in futs:
                f.get()

    def weights(self) -> dict[str, torch.Tensor]:
        """Current weights by name, fp32 (master weights where kept). Loads the whole model:
        for tests and small exports."""
        out = {}
        buf = aligned_empty(self.layout.max_unit_numel * 4).view(torch.float32)
        for unit in self.layout.units:
            if self.optim.master is not None:
                self.optim.master.read(unit.index, buf).get()
                src = buf
            else:
                self.params.read(unit.index, buf).get()
                src = buf
            for rec in unit.params:
                out[rec.name] = src[rec.offset : rec.offset + rec.numel].view(rec.shape).clone()
        return out

    # -- steps --------------------------------------------------------------------------------------
    def train_step(self) -> StepRecord:
        cfg = self.cfg
        s0, io0 = time.perf_counter(), self.storage.stats()
        waits0 = self.params.stats.wait_s + self.stash.wait_s
        out = self.executor.step(self.corpus.batches(self.step))
        t0 = time.perf_counter()
        self.grads.flush()  # sync point: every gradient home before the update reads it
        norm = self.grads.total_norm()
        coef = None
        if cfg.optim.grad_clip > 0:
            coef = torch.clamp(cfg.optim.grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
        lr = lr_at(self.step + 1, cfg.optim, cfg.train.steps)
        upd = self.optim.step(lr, coef)
        update_s = time.perf_counter() - t0
        self.step += 1
        step_s = time.perf_counter() - s0
        io1 = self.storage.stats()
        rb = sum(io1[k].read_bytes - io0[k].read_bytes for k in io1)
        wb = sum(io1[k].write_bytes - io0[k].write_bytes for k in io1)
        rbusy = max((io1[k].read_busy_s - io0[k].read_busy_s for k in io1), default=0.0)
        wbusy = max((io1[k].write_busy_s - io0[k].write_busy_s for k in io1), default=0.0)
        peak = peak_flops(torch.cuda.get_device_name(self.dev.device) if self.dev.cuda else None)
        mfu = 6 * self.layout.n_params * out.tokens / step_s / peak if peak else None
        return StepRecord(
            step=self.step,
            loss=out.loss,
            lr=lr,
            grad_norm=float(norm),
            tokens=out.tokens,
            step_s=step_s,
            forward_s=out.forward_s,
            backward_s=out.backward_s,
            update_s=update_s,
            io_wait_s=self.params.stats.wait_s + self.stash.wait_s - waits0 + upd.wait_s,
            ssd_read_bytes=rb,
            ssd_write_bytes=wb,
            ssd_read_gbps=rb / rbusy / 1e9 if rbusy > 0 else 0.0,
            ssd_write_gbps=wb / wbusy / 1e9 if wbusy > 0 else 0.0,
            peak_host_bytes=host_peak_rss(),
            peak_device_bytes=self.dev.peak_bytes(),
            mfu=mfu,
            extra={"losses": out.losses},
        )

    def run(self, *, progress: bool | None = None) -> list[StepRecord]:
        """Initialise, then train ``train.steps`` steps, printing the per-step line."""
        from tqdm import tqdm

        cfg = self.cfg
        progress = cfg.train.progress if progress is None else progress
        metrics = MetricsLog(cfg.train.run_dir)
        try:
            self.initialize(progress=progress)
            log.info("fixed pools: %s", ", ".join(f"{k} {v / MIB:,.1f} MiB" for k, v in self.pool_bytes.items()))
            bar = tqdm(total=cfg.train.steps, initial=self.step, desc="train", disable=not progress, unit="step")
            while self.step < cfg.train.steps:
                rec = self.train_step()
                metrics.add(rec)
                bar.update()
                bar.set_postfix(loss=f"{rec.loss:.3f}")
                if rec.step % cfg.train.log_every == 0 or rec.step == cfg.train.steps:
                    log.info(rec.line(cfg.train.steps))
            bar.close()
            log.info("done: %s; metrics in %s", metrics.summary(), metrics.path)
            return metrics.records
        finally:
            metrics.close()

    def close(self) -> None:
        for part in reversed(self._parts):
            part.close()
        self._parts = []
        self.storage.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _vocab(cfg: Config) -> int:
    if cfg.model.hf_dir is not None:
        from .models import hf_config_from

        return hf_config_from(cfg.model).vocab_size
    return cfg.model.vocab_size


def _hidden(cfg: Config, model) -> int:
    return model.hf_config.hidden_size if model.hf_config is not None else cfg.model.d_model
