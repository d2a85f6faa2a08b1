"""The trainer: builds every part from the config and runs the steps."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from . import faults
from .activations.stash import HiddenStash
from .checkpoint import CheckpointIO, Manifest, SaveResult, clean_incomplete, list_checkpoints
from .config import Config, ConfigError
from .data import Corpus
from .errors import one_line
from .io import Storage, aligned_empty, check_space
from .metrics import MetricsLog, StepRecord, peak_flops
from .models import WeightSource, build_model
from .schedule.executor import LayerMajorExecutor
from .rundir import RunDir
from .scratch import ScratchLock, clean_stale
from .state.device import Device, host_peak_rss, resolve_device, resolve_dtype
from .state.grads import GradStore
from .state.layout import FlatLayout
from .state.regions import TieredRegions
from .state.store import ParamStore
from .update.engines import EngineGroup, GradHome, ParamBacking
from .update.schedule import lr_at
from .update.streamed import StreamedOptimizer, UpdateStats

__all__ = ["Trainer", "SpacePlan"]

log = logging.getLogger("tiertrain")
MIB = 1 << 20
# Every state file name a run of any configuration makes on the scratch tier (engines' files
# are recognised by their prefix): what another configuration left is stale for this one.
ALL_STATE_FILES = ("params.bin", "grads.bin", "exp_avg.bin", "exp_avg_sq.bin", "momentum.bin", "master.bin",
                   "stash.bin", "residual.bin")


@dataclass
class SpacePlan:
    files: list[tuple[str, int]]  # striped over every path
    placed: list[tuple[str, int]] | None = None  # (full path, bytes) of files on one path (engines)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.files) + sum(n for _, n in self.placed or [])

    def describe(self) -> str:
        files = self.files + [(os.path.basename(p), n) for p, n in self.placed or []]
        parts = ", ".join(f"{name} {n / 2**20:,.1f} MiB" for name, n in files if n)
        return f"{self.total / 2**30:.2f} GiB ({parts})"


class Trainer:
    """Everything a run needs, sized from the config once.

    ``weights`` overrides where the initial weights come from (tests load a plain
    PyTorch model's state this way).
    """

    def __init__(self, cfg: Config, *, weights: WeightSource | None = None) -> None:
        cfg = cfg.absolute()  # stored in checkpoints: resume and export work from any directory
        cfg.check_writable()
        self.cfg = cfg
        self._parts: list = []
        self.lock = self.rundir = None
        self.plan = None
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
        self.lock = ScratchLock(cfg.io.paths)  # one run per scratch directory
        try:
            self.rundir = RunDir(cfg.train.run_dir, self.checkpoint_root)  # and per run directory
            self.storage = Storage.from_config(cfg.io)
            for info in self.lock.unclean:
                log.warning("scratch %s was left by a run that did not finish (pid %s, started %s); its files are replaced",
                            info["path"], info.get("pid"), info.get("started"))
            self.plan = self._plan()
            for path, size in clean_stale(self.storage.paths, ALL_STATE_FILES, keep=self._state_file_names()):
                log.info("removed a stale file of an earlier run: %s (%.1f MiB)", path, size / MIB)
            for path in clean_incomplete(self.checkpoint_root):
                log.warning("removed an incomplete checkpoint left by an interrupted save: %s", path)
            log.info("model: %s %s, %s; %s", cfg.model.kind, self.dtype, self.layout.describe(), self.source.describe)
            log.info("scratch space needed on %s: %s", ", ".join(cfg.io.paths), self.plan.describe())
            self.storage.check_space(self.plan.files)  # a full disk is reported here, before any work
            check_space(self.plan.placed or [])
            self._build()
            faults.point("start")
        except BaseException:
            self.close()
            raise

    # -- construction -------------------------------------------------------------------------------
    def _state_file_names(self) -> list[str]:
        plan = self.plan
        return [n for n, s in plan.files if s] + [os.path.basename(p) for p, s in plan.placed or [] if s]

    def _stash_shape(self) -> tuple[int, ...]:
        d = self.cfg.data
        return (d.micro_batch_size, d.seq_len, _hidden(self.cfg, self.model))

    def _plan(self) -> SpacePlan:
        """Bytes of every file the run will create on the storage tier (made before any exists)."""
        m, lay = self.cfg.memory, self.layout
        pdt, f32 = self.dtype, torch.float32
        has_master = pdt != f32

        align = self.storage.record_align
        file_bytes = lambda dtype, host: TieredRegions.plan_file_bytes(lay, dtype, host, align)  # noqa: E731
        entries = len(self.model.blocks) * self.cfg.data.micro_batches
        entry, _, spilled = HiddenStash.plan(self._stash_shape(), pdt, entries, m.stash_host_mib * MIB)
        stash = [("stash.bin", spilled * entry)]
        if self.cfg.update.mode == "engines":
            if self.cfg.update.error_feedback:
                stash.append(("residual.bin", file_bytes(f32, m.residual_host_mib * MIB)))
            return SpacePlan(stash, self._engine_plan())
        kinds = StreamedOptimizer.state_kinds(self.cfg.optim, has_master)
        share = (m.optim_host_mib * MIB) // len(kinds)
        files = [("params.bin", file_bytes(pdt, m.host_param_mib * MIB)), ("grads.bin", file_bytes(pdt, m.grad_host_mib * MIB))]
        files += [(f"{k}.bin", file_bytes(f32, share)) for k in kinds]
        return SpacePlan(files + stash)

    def _engine_plan(self) -> list[tuple[str, int]]:
        """The files each update engine makes on its path (as ``EngineGroup`` will place them)."""
        from .update.engine import engine_file
        from .update.slices import SliceLayout, partition, unit_records

        st, cfg, pdt = self.storage, self.cfg, self.dtype
        n = cfg.update.engines or len(st.paths)
        align = max(2048, st.record_align // min(pdt.itemsize, 4))
        views = [SliceLayout(unit_records(self.layout), s) for s in partition(self.layout, n, align)]
        out = []
        for i, v in enumerate(views):
            path = st.paths[i % len(st.paths)]
            kinds = [("params", pdt, 0), ("grads", pdt, cfg.memory.grad_host_mib * MIB // n)]
            kinds += [(k, torch.float32, 0) for k in StreamedOptimizer.state_kinds(cfg.optim, pdt != torch.float32)]
            for kind, dtype, host in kinds:
                out.append((os.path.join(path, engine_file(i, kind)), TieredRegions.plan_file_bytes(v, dtype, host, st.record_align)))
        return out

    def _build(self) -> None:
        m = self.cfg.memory
        self.engines = None
        if self.cfg.update.mode == "engines":
            self.engines = self._part(EngineGroup(self.layout, self.storage, self.cfg, self.dtype))
            # CPU: slots in shared memory, so the engines hand new parameters straight over
            shared = None if self.dev.cuda else self.engines.share_slots(m.device_slots, self.layout.max_unit_numel)
            self.params = self._part(
                ParamStore(self.layout, self.storage, self.dev, self.dtype, slots=m.device_slots,
                           backing=ParamBacking(self.engines), gate=self.engines, slot_tensors=shared)
            )
            self.grads = self._part(GradStore(self.layout, self.storage, self.dev, self.dtype, home=GradHome(self.engines)))
            self.optim = None
        else:
            self.params = self._part(
                ParamStore(self.layout, self.storage, self.dev, self.dtype, slots=m.device_slots,
                           host_bytes=m.host_param_mib * MIB)
            )
            self.grads = self._part(GradStore(self.layout, self.storage, self.dev, self.dtype, host_bytes=m.grad_host_mib * MIB))
            self.optim = self._part(
                StreamedOptimizer(
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
        self.executor = LayerMajorExecutor(self.model, self.params, self.grads, self.stash, self.dev,
                                           keep_bytes=m.keep_act_mib * MIB)
        self.ckpt = self._part(CheckpointIO(self.layout, chunk_bytes=self.cfg.io.chunk_kib << 10))
        self.step = 0
        self._superseded: list[str] = []  # checkpoints of a later course of a resumed run, replaced at its first save
        self._engine_seen: dict[str, float] = {}  # the engines' running counters when the last record was made

    @contextlib.contextmanager
    def state_regions(self):
        """Every kind of checkpointed state, by checkpoint file name, readable and writable
        per unit (the engines are paused meanwhile)."""
        if self.engines is not None:
            with self.engines.handover() as r:
                yield {f"{k}.bin": v for k, v in r.items()}
            return
        yield {"params.bin": self.params.backing, **self.optim.regions()}

    @property
    def checkpoint_bytes(self) -> int:
        moments = 8 if self.cfg.optim.name == "adamw" else 4
        per_elem = self.dtype.itemsize + moments + (4 if self.dtype != torch.float32 else 0)
        return self.layout.total_numel * per_elem

    def _part(self, obj):
        self._parts.append(obj)
        return obj

    @property
    def pool_bytes(self) -> dict[str, int]:
        """Fixed memory of every pool, by part (host memory on CPU; device + pinned on CUDA)."""
        return {
            "param slots + host params": self.params.pool_bytes,
            "grad buffers + host grads": self.grads.pool_bytes,
            "update buffers + host states" if self.optim else "engine slots (shared memory)":
                (self.optim or self.engines).pool_bytes,
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
            if self.engines is not None:  # the engines write their slices of weights and master
                self.engines.init_unit(unit.index, view)
                continue
            futs = self.optim.init_unit(unit.index, view)
            if low is not flat:
                low[: unit.numel].copy_(view)
            futs.append(self.params.write(unit.index, low[: unit.numel]))
            for f in futs:
                f.get()
        if self.engines is not None:
            self.engines.wait_all("initialising weights")
        # dropout draws from the global generators, which PyTorch seeds at random per process
        torch.manual_seed(self.cfg.train.seed)

    def weights(self) -> dict[str, torch.Tensor]:
        """Current weights by name, fp32 (master weights where kept). Loads the whole model:
        for tests and small exports."""
        out = {}
        with self.state_regions() as regions:
            src = regions.get("master.bin", regions["params.bin"])
            buf = aligned_empty(self.layout.max_unit_numel * src.dtype.itemsize).view(src.dtype)
            for unit in self.layout.units:
                src.read(unit.index, buf).get()
                for rec in unit.params:
                    out[rec.name] = buf[rec.offset : rec.offset + rec.numel].view(rec.shape).float().clone()
        return out

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str:
        return self.cfg.checkpoint.dir or os.path.join(self.cfg.train.run_dir, "checkpoints")

    def save_checkpoint(self) -> SaveResult:
        """A complete checkpoint of the current step (after the last finished step)."""
        with self.state_regions() as regions:
            res = self.ckpt.save(regions, self.checkpoint_root, self.step, self.cfg.to_dict(), keep=self.cfg.checkpoint.keep,
                                 drop=self._superseded)
        self._superseded = []
        log.info("saved checkpoint %s: %.2f GB in %.1f s (%.2f GB/s)", res.path, res.nbytes / 1e9, res.seconds, res.gbps)
        return res

    def restore(self, path: str) -> Manifest:
        """Load checkpoint ``path``: weights, optimizer state, step, RNG."""
        t0 = time.perf_counter()
        with self.state_regions() as regions:
            man = self.ckpt.restore(regions, path)
        self.params.invalidate()
        self.step = man.step
        if self.optim is not None:
            self.optim.step_count = man.step
        log.info("resumed from %s (step %d) in %.1f s", path, man.step, time.perf_counter() - t0)
        return man

    @property
    def resume_command(self) -> str:
        return f"tiertrain train --resume {self.cfg.train.run_dir}"

    # -- steps --------------------------------------------------------------------------------------
    def train_step(self) -> StepRecord:
        cfg = self.cfg
        s0, io0 = time.perf_counter(), self.storage.stats()
        waits0 = self.params.stats.wait_s + self.stash.wait_s
        lr = lr_at(self.step + 1, cfg.optim, cfg.train.steps)
        if self.engines is not None:
            self.engines.begin_step(self.step + 1, lr)
        out = self.executor.step(self.corpus.batches(self.step))
        t0 = time.perf_counter()
        self.grads.flush()  # sync point: every gradient home before the update reads it
        norm = self.grads.total_norm()
        coef = None
        if cfg.optim.grad_clip > 0:
            coef = torch.clamp(cfg.optim.grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
        if self.engines is not None:
            self.engines.step(lr, coef)  # returns at once: the engines update under the next forward
            self.params.invalidate()  # slot copies are stale; reloads wait per unit for the engines
            upd = UpdateStats()
        else:
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
            extra={"losses": out.losses, **self._engine_figures()},
        )

    def _engine_figures(self) -> dict:
        """Bytes handed to the engines, and what they moved on their storage, since the last
        record (an engine's update of step s is reported while step s + 1 runs)."""
        if self.engines is None:
            return {}
        g = self.engines
        counters = {
            "engine_sent_bytes": g.sent_bytes,
            "engine_dense_bytes": g.dense_bytes,
            "engine_handoff_bytes": g.handoff_bytes,
            "engine_slot_wait_s": g.slot_wait_s,  # the backward blocked on engines taking gradients
            "reports": len(g.stepped),
        }
        seen, self._engine_seen = self._engine_seen, counters
        since = {k: v - seen.get(k, 0) for k, v in counters.items()}
        reports = g.stepped[len(g.stepped) - since.pop("reports"):]
        return {
            **since,
            "engine_read_bytes": sum(r["read"] for r in reports),
            "engine_write_bytes": sum(r["written"] for r in reports),
            "engine_update_s": max((r["seconds"] for r in reports), default=0.0),
            "engine_wait_s": max((r["wait_s"] for r in reports), default=0.0),
            "engine_compute_s": max((r["compute_s"] for r in reports), default=0.0),
            "engine_cpu_s": sum(r["cpu_s"] for r in reports),  # all engines, since their last report
            "engine_peak_host_bytes": sum(g.peak_host),  # the engines run side by side: their peaks add up
        }

    def run(self, *, resume: str | None = None, progress: bool | None = None) -> list[StepRecord]:
        """Initialise (or restore checkpoint ``resume``), then train up to ``train.steps``,
        printing the per-step line and saving checkpoints as configured. Ctrl-C or SIGTERM
        stops after the current step (saving first when ``checkpoint.on_interrupt``); a second
        one stops at once. Raises ``KeyboardInterrupt`` after an interrupted run has stopped."""
        from tqdm import tqdm

        cfg, ck = self.cfg, self.cfg.checkpoint
        if progress is None:  # no bar in a log file: its redraws would interleave with the step lines
            progress = cfg.train.progress and sys.stderr.isatty()
        if resume is None:
            self.rundir.start_fresh(cfg.train.overwrite)
        stop = _StopFlag()
        with stop:
            if resume is not None:
                self.restore(resume)
                self.rundir.continue_metrics(self.step)
                self._superseded = [p for p in list_checkpoints(self.checkpoint_root) if _step_of(p) > self.step]
                if self._superseded:
                    log.warning("%s hold(s) a later course of this run than step %d; replaced by this run's first "
                                "checkpoint", ", ".join(map(os.path.basename, self._superseded)), self.step)
            else:
                self.initialize(progress=progress)
            first = self.step
            if first >= cfg.train.steps:
                log.warning("the run is already at step %d of train.steps = %d: nothing to train; to train further, "
                            "raise it: %s --train.steps=%d", first, cfg.train.steps, self.resume_command,
                            cfg.train.steps + first)
                return []
            self.rundir.write_config(cfg.to_dict())
            metrics = MetricsLog(cfg.train.run_dir, resume=resume is not None)
            try:
                log.info("fixed pools: %s", ", ".join(f"{k} {v / MIB:,.1f} MiB" for k, v in self.pool_bytes.items()))
                with tqdm(total=cfg.train.steps, initial=self.step, desc="train", disable=not progress, unit="step") as bar:
                    while self.step < cfg.train.steps and not stop.set:
                        rec = self.train_step()
                        metrics.add(rec)
                        bar.update()
                        bar.set_postfix(loss=f"{rec.loss:.3f}")
                        if rec.step % cfg.train.log_every == 0 or rec.step == cfg.train.steps:
                            log.info(rec.line(cfg.train.steps))
                        if ck.every and self.step % ck.every == 0 and self.step < cfg.train.steps:
                            self.save_checkpoint()
                if stop.set:
                    log.warning("interrupted after step %d (%s)", self.step, stop.set)
                    if ck.on_interrupt and self.step > first:
                        self.save_checkpoint()
                    if self.step > first or first > 0:
                        log.warning("resume with: %s", self.resume_command)
                    raise KeyboardInterrupt(f"interrupted after step {self.step}")
                if ck.at_end:
                    self.save_checkpoint()
                log.info("done: %s; metrics in %s", metrics.summary(), metrics.path)
                return metrics.records
            finally:
                metrics.close()

    def close(self) -> None:
        """Stop every part, remove this run's scratch files (checkpoints hold what is worth
        keeping) and release the directories. Never raises: a part that fails to close (a dead
        engine, a damaged file) is logged and the others are still closed."""
        for part in [*reversed(self._parts), getattr(self, "storage", None)]:
            if part is None:
                continue
            try:
                part.close()
            except Exception as exc:  # noqa: BLE001 - the rest must still be closed
                log.warning("while closing %s: %s", type(part).__name__, one_line(exc))
        self._parts = []
        self.storage = None
        if self.lock is not None:
            if self.plan is not None:
                with contextlib.suppress(OSError):
                    clean_stale(self.cfg.io.paths, self._state_file_names())
            self.lock.release(remove=True)
            self.lock = None
        if self.rundir is not None:
            self.rundir.release(remove_if_empty=True)
            self.rundir = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM (schedulers, ``docker stop``) sets ``set`` to the signal's
    name: the loop stops at the next step boundary. A second one interrupts at once. Only
    installed in the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.set: str = ""
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.set:
            raise KeyboardInterrupt
        self.set = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        log.warning("%s: stopping after this step (again to stop at once)", self.set)

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}


def _step_of(checkpoint: str) -> int:
    return int(os.path.basename(checkpoint).removeprefix("step-"))


def _vocab(cfg: Config) -> int:
    if cfg.model.hf_dir is not None:
        from .models import hf_config_from

        return hf_config_from(cfg.model).vocab_size
    return cfg.model.vocab_size


def _hidden(cfg: Config, model) -> int:
    return model.hf_config.hidden_size if model.hf_config is not None else cfg.model.d_model
