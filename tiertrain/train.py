"""The trainer: builds every part from the config and runs the steps."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch

from .activations.stash import HiddenStash
from .checkpoint import CheckpointIO, Manifest, SaveResult, clean_incomplete
from .config import Config, ConfigError
from .data import Corpus
from .io import Storage, aligned_empty
from .metrics import MetricsLog, StepRecord, peak_flops
from .models import WeightSource, build_model
from .schedule.executor import LayerMajorExecutor
from .scratch import ScratchLock, clean_stale
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
        self.lock = ScratchLock(cfg.io.paths)  # one run per scratch directory
        self.storage = Storage.from_config(cfg.io)
        try:
            for info in self.lock.unclean:
                log.warning("scratch %s was left by a run that did not finish (pid %s, started %s); its files are replaced",
                            info["path"], info.get("pid"), info.get("started"))
            self.plan = self._plan()
            for path, size in clean_stale(self.storage.paths, keep=[n for n, s in self.plan.files if s]):
                log.info("removed a stale file of an earlier run: %s (%.1f MiB)", path, size / MIB)
            for path in clean_incomplete(self.checkpoint_root):
                log.warning("removed an incomplete checkpoint left by an interrupted save: %s", path)
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
        regions = {"params.bin": self.params.backing, "exp_avg.bin": self.optim.m, "exp_avg_sq.bin": self.optim.v}
        if self.optim.master is not None:
            regions["master.bin"] = self.optim.master
        self.ckpt = self._part(CheckpointIO(self.layout, regions, chunk_bytes=self.cfg.io.chunk_kib << 10))
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
            "checkpoint buffers": self.ckpt.pool_bytes,
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
        # dropout draws from the global generators, which PyTorch seeds at random per process
        torch.manual_seed(self.cfg.train.seed)

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

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str:
        return self.cfg.checkpoint.dir or os.path.join(self.cfg.train.run_dir, "checkpoints")

    def save_checkpoint(self) -> SaveResult:
        """A complete checkpoint of the current step (after the last finished step)."""
        res = self.ckpt.save(self.checkpoint_root, self.step, self.cfg.to_dict(), keep=self.cfg.checkpoint.keep)
        log.info("saved checkpoint %s: %.2f GB in %.1f s (%.2f GB/s)", res.path, res.nbytes / 1e9, res.seconds, res.gbps)
        return res

    def restore(self, path: str) -> Manifest:
        """Load checkpoint ``path``: weights, optimizer state, step, RNG."""
        t0 = time.perf_counter()
        man = self.ckpt.restore(path)
        self.params.invalidate()
        self.step = self.optim.step_count = man.step
        log.info("resumed from %s (step %d) in %.1f s", path, man.step, time.perf_counter() - t0)
        return man

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

    def run(self, *, resume: str | None = None, progress: bool | None = None) -> list[StepRecord]:
        """Initialise (or restore checkpoint ``resume``), then train up to ``train.steps``,
        printing the per-step line and saving checkpoints as configured. Ctrl-C stops after
        the current step (saving first when ``checkpoint.on_interrupt``); a second Ctrl-C
        stops at once. Raises ``KeyboardInterrupt`` after an interrupted run has stopped."""
        from tqdm import tqdm

        cfg, ck = self.cfg, self.cfg.checkpoint
        progress = cfg.train.progress if progress is None else progress
        metrics = MetricsLog(cfg.train.run_dir, resume=resume is not None)
        with open(os.path.join(cfg.train.run_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
        stop = _StopFlag()
        try:
            if resume is not None:
                self.restore(resume)
            else:
                self.initialize(progress=progress)
            log.info("fixed pools: %s", ", ".join(f"{k} {v / MIB:,.1f} MiB" for k, v in self.pool_bytes.items()))
            bar = tqdm(total=cfg.train.steps, initial=self.step, desc="train", disable=not progress, unit="step")
            with stop:
                while self.step < cfg.train.steps and not stop.set:
                    rec = self.train_step()
                    metrics.add(rec)
                    bar.update()
                    bar.set_postfix(loss=f"{rec.loss:.3f}")
                    if rec.step % cfg.train.log_every == 0 or rec.step == cfg.train.steps:
                        log.info(rec.line(cfg.train.steps))
                    if ck.every and self.step % ck.every == 0 and self.step < cfg.train.steps:
                        self.save_checkpoint()
            bar.close()
            if stop.set:
                log.warning("interrupted after step %d", self.step)
                if ck.on_interrupt:
                    self.save_checkpoint()
                raise KeyboardInterrupt(f"interrupted after step {self.step}")
            if ck.at_end and (resume is None or self.step > Manifest.read(resume).step):
                self.save_checkpoint()
            log.info("done: %s; metrics in %s", metrics.summary(), metrics.path)
            return metrics.records
        finally:
            metrics.close()

    def close(self) -> None:
        try:
            for part in reversed(self._parts):
                part.close()
            self._parts = []
            self.storage.close()
        finally:
            self.lock.release()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StopFlag:
    """Ctrl-C sets ``set`` (the loop stops at the next step boundary); a second Ctrl-C
    interrupts at once. Only installed in the main thread."""

    def __init__(self) -> None:
        self.set = False
        self._old = None

    def _handler(self, signum, frame) -> None:
        if self.set:
            raise KeyboardInterrupt
        self.set = True
        log.warning("Ctrl-C: stopping after this step (press again to stop at once)")

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _vocab(cfg: Config) -> int:
    if cfg.model.hf_dir is not None:
        from .models import hf_config_from

        return hf_config_from(cfg.model).vocab_size
    return cfg.model.vocab_size


def _hidden(cfg: Config, model) -> int:
    return model.hf_config.hidden_size if model.hf_config is not None else cfg.model.d_model
