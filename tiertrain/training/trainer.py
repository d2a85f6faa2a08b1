"""The trainer: the training driver. Builds the runtime, one update path, the gradient
store, the hidden-state stash and the layer-major executor from the config, and runs steps.

What it owns and may call: the ``Runtime`` (device, model, layout, storage, parameter
store), an ``Update`` (never asking which kind), ``GradStore``, ``HiddenStash``, the
executor, ``CheckpointIO`` and the run directory. Every part's states are declared before
any file exists (``SpacePlan``): the scratch space is claimed, stale files removed and
checkpoints made from those declarations.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import logging
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

import torch

from .. import faults
from ..activations.offload import OffloadedGraphs
from ..activations.policy import policy_for
from ..activations.stash import HiddenStash
from ..checkpoint import CheckpointIO, Manifest, SaveResult, clean_incomplete, list_checkpoints, step_of
from ..config import Config, ConfigError
from ..data import EvalSet, open_corpus
from ..errors import one_line
from .interrupt import StopFlag
from ..io import aligned_empty, check_space
from ..io.errors import OutOfSpaceError, human_bytes
from ..io.space import existing_dir
from .metrics import MetricsLog, StepRecord, flops_per_token, peak_flops
from ..models import WeightSource, vocab_size_of
from ..models.pieces import WholeTensors
from .rundir import RunDir
from ..runtime import Runtime
from ..execute.executor import LayerMajorExecutor
from ..io.scratch import ScratchLock, clean_other_legs, clean_stale
from ..state.decl import SpacePlan, StateDecl, checkpointed
from ..device.host import host_peak_rss
from ..state.grads import GradStore, accum_dtype_for
from ..device.host import fix_mmap_threshold, trim_heap
from ..update import UPDATES, Update
from ..dist.checkpoint import GatheredRegion, ScatteredRegion, follow
from ..dist.shard import ShardedGrads, ShardedParams
from ..dist.ranks import per_rank_figures, rank_config
from ..update.lr import lr_at
from ..inference.validation import validation_loss

if TYPE_CHECKING:  # annotations only: the cost model is imported where it is used
    from ..cost.model import Prediction
    from ..dist.group import RankGroup

__all__ = ["Trainer", "SpacePlan", "declare_states"]

log = logging.getLogger("tiertrain")
MIB = 1 << 20


def declare_states(cfg: Config, rt: Runtime, record_bytes: int = 0) -> list[StateDecl]:
    """Every state a run of ``cfg`` keeps, by its owners, before any of it exists: the update
    path's (parameters, gradients, optimizer state, residual), the stash's and, with pairs
    offloaded (``memory.offload_pairs`` of ``record_bytes`` each), the activation records'."""
    update = UPDATES[cfg.update.mode].declare(cfg, rt.state_layout, rt.dtype, rt.align, cfg.io.paths)
    d, m = cfg.data, cfg.memory
    stash = HiddenStash.declare((d.micro_batch_size, d.seq_len, rt.hidden_size), rt.dtype,
                                len(rt.model.blocks) * d.micro_batches, m.stash_host_mib * MIB)
    acts = []
    if m.offload_pairs and record_bytes:
        acts = [OffloadedGraphs.declare(rt.dtype, record_bytes, m.offload_pairs, m.act_buffers)]
    return [*update, stash, *acts]


@dataclass(frozen=True)
class ActivationPlan:
    """Where the step's (block, micro-batch) pairs keep their activations, as planned at start."""

    act_bytes: int  # one pair's saved tensors (kept), measured by a dry run (0: not measured)
    record_bytes: int  # one pair's record on the storage tier (0: not measured)
    kept: int  # pairs the keep budget holds (as planned; the kept-graph budget still rules)
    offloaded: int

    @classmethod
    def of(cls, cfg: Config, rt: Runtime, act_bytes: int, record_bytes: int) -> "ActivationPlan":
        from ..cost import kept_pairs, offloaded_pairs

        L = len(rt.model.blocks)
        kept = kept_pairs(cfg, L, act_bytes) if act_bytes else 0
        off = offloaded_pairs(cfg, L, kept) if record_bytes else 0
        return cls(act_bytes, record_bytes, kept, off)


def resume_command(run_dir: str, world: int = 1, checkpoint: str | None = None) -> str:
    """``tiertrain train --resume ...`` for a run (its latest checkpoint, or ``checkpoint``) on
    ``world`` ranks."""
    return f"tiertrain train --resume {checkpoint or run_dir}" + (f" --nproc {world}" if world > 1 else "")


class Trainer:
    """Everything a run needs, sized from the config once.

    ``weights`` overrides where the initial weights come from (tests load a plain
    PyTorch model's state this way); ``device`` the compute device (tests run on
    ``AsyncCpuDevice``); ``group`` the ranks of a sharded run (``dist.RankGroup``; each rank
    builds its own Trainer with the same config, see ``dist/ranks.py``).
    """

    def __init__(self, cfg: Config | dict, *, weights: WeightSource | None = None, device=None,
                 group: "RankGroup | None" = None) -> None:
        if isinstance(cfg, dict):  # sections as a TOML file holds them (the Python API)
            cfg = Config.from_dict(cfg)
        cfg = cfg.absolute()  # stored in checkpoints: resume and export work from any directory
        self.group = group
        rank, world = (group.rank, group.world) if group is not None else (0, 1)
        self.user_cfg = cfg  # as given (checkpoints keep it: a resumed run plans its memory again)
        self._shared_root = cfg.checkpoint_root  # ranks: rank 0's, where every rank's checkpoints go
        if world > 1:
            cfg = rank_config(cfg, group)
        fix_mmap_threshold(cfg.memory.mmap_threshold_kib << 10)  # before any large tensor of the run
        cfg.check_writable()
        self.cfg = cfg
        self._rates = None
        self.acts = ActivationPlan(0, 0, 0, 0)
        self._parts: list = []
        self.lock = self.rundir = self.plan = None
        self.rt = Runtime(cfg, weights=weights, device=device, rank=rank, world=world)
        self.dev, self.dtype, self.model, self.layout = self.rt.dev, self.rt.dtype, self.rt.model, self.rt.layout
        self.source = self.rt.weights
        self.corpus = open_corpus(cfg.data)
        self.evalset = EvalSet(cfg.data) if cfg.train.eval_every else None  # a bad eval corpus fails here, at start
        for what, data in (("corpus", self.corpus), ("evaluation corpus", self.evalset)):
            if data is not None and data.vocab_size > vocab_size_of(self.model, cfg):
                raise ConfigError(
                    f"model.vocab_size = {vocab_size_of(self.model, cfg)} is smaller than the {what} vocabulary "
                    f"({data.vocab_size}); raise it to at least {data.vocab_size}, or tokenize with the model's "
                    "own tokenizer")
        self.lock = ScratchLock(cfg.io.paths, disposable=world > 1)  # one run per scratch directory
        try:
            self.rundir = RunDir(cfg.train.run_dir, cfg.checkpoint_root)  # and per run directory (ranks: each its own)
            for info in self.lock.unclean:
                log.warning("scratch %s was left by a run that did not finish (pid %s, started %s); its files are replaced",
                            info["path"], info.get("pid"), info.get("started"))
            cfg = self._plan_memory(cfg)
            self.storage = self.rt.open_storage()  # after the plan: it may lower io.chunk_kib to fit the budget
            self.plan = SpacePlan(declare_states(cfg, self.rt, self.acts.record_bytes))
            if rank == 0:  # a leg of this run on another number of ranks left its files beside ours
                for path, size in clean_other_legs(self.user_cfg.io.paths, world):
                    log.info("removed a file a leg of this run on %s left: %s (%.1f MiB)",
                             "one rank" if world > 1 else "several ranks", path, size / MIB)
            for path, size in clean_stale(self.storage.paths, self.lock.previous_files(), keep=self.plan.names):
                log.info("removed a stale file of an earlier run: %s (%.1f MiB)", path, size / MIB)
            for path in (clean_incomplete(self.checkpoint_root) if rank == 0 else ()):  # rank 0's to clean
                log.warning("removed an incomplete checkpoint left by an interrupted save: %s", path)
            log.info("model: %s %s, %s; %s", cfg.model.kind, self.dtype, self.layout.describe(), self.source.describe)
            log.info("scratch space needed on %s: %s", ", ".join(cfg.io.paths), self.plan.describe())
            # a full disk is reported here, before any work: with ranks, for every rank of this
            # machine at once (they share its drives: each alone would fit where all do not)
            self._check_space([*self.storage.space_needs(self.plan.files), *self.plan.placed])
            self.lock.record_files(self.plan.names)
            self._build()
            faults.point("start")
        except BaseException:
            self.close()
            raise

    def _check_space(self, needs: list[tuple[str, int]]) -> None:
        """Refuse now unless every filesystem can hold what it is asked (``needs``: this rank's
        ``(path, bytes)``): with ranks, the needs of every rank of this machine at once (they share
        its drives: each alone would fit where all do not), the error naming each rank's share."""
        if self.rt.world == 1:
            check_space(needs)
            return
        import socket

        host = socket.gethostname()
        mine = {r: ns for r, (h, ns) in enumerate(self.group.all_objects((host, needs))) if h == host}
        try:
            check_space([n for ns in mine.values() for n in ns])
        except OutOfSpaceError as exc:
            dev = os.stat(existing_dir(exc.filename)).st_dev
            share = {r: sum(b for p, b in ns if os.stat(existing_dir(p)).st_dev == dev) for r, ns in mine.items()}
            raise OutOfSpaceError(exc.filename, exc.needed, exc.free, f"the {len(mine)} ranks of this machine share it: "
                                  + ", ".join(f"rank {r} {human_bytes(b)}" for r, b in share.items())) from None

    # -- construction -------------------------------------------------------------------------------
    def _plan_memory(self, cfg: Config) -> Config:
        """Every unset memory.*_mib field set from the one budget (memory.host_mib), and the
        update path chosen where it is auto; the plan logged. Measures this machine only when not
        everything fits."""
        from ..cost import measure_rates
        from ..cost.budget import plan_budget
        from ..cost.choose import resolve_activations, resolve_update
        from ..cost.probe import probe_acts

        def rates():
            if self._rates is None:
                log.info("probing this machine to place the states by benefit per byte")
                self._rates = measure_rates(cfg, self.rt, probe_mib=64)
            return self._rates

        def act() -> tuple[int, int]:  # a dry run of block 0: bytes kept, bytes of an offloaded record
            rt = self.rt
            return probe_acts(cfg, rt.model, rt.layout, rt.dev, rt.dtype, rt.hidden_size)

        cfg, self.budget = plan_budget(cfg, self.rt, rates, act,
                                       agree=self.group.rank0s if self.rt.world > 1 else None)
        if cfg.model.vocab_pieces != self.user_cfg.model.vocab_pieces:  # the vocabulary was cut to fit
            self.model, self.layout, self.source = self.rt.model, self.rt.layout, self.rt.weights
            self.user_cfg.model.vocab_pieces = cfg.model.vocab_pieces  # a checkpoint resumes with the same units
        for line in self.budget.lines():
            log.info("%s", line)
        # the rates the budget measured, or those the prediction at start will (train.predict)
        measured = rates if cfg.train.predict or self._rates is not None else None
        cfg, why = resolve_update(cfg, self.rt, measured, agree=self.group.rank0s if self.rt.world > 1 else None)
        if why:
            log.info("update path (auto): %s", why)
        b = self.budget
        cfg, why = resolve_activations(cfg, self.rt, b.act_bytes, b.record_bytes, measured)
        if why:
            log.info("%s", why)
        self.acts = ActivationPlan.of(cfg, self.rt, b.act_bytes, b.record_bytes)
        self.cfg = self.rt.cfg = cfg
        return cfg

    def _accum_dtype(self) -> torch.dtype | None:
        return accum_dtype_for(self.cfg.train.grad_accum_dtype, self.cfg.data.micro_batches, self.dtype)

    def _build(self) -> None:
        cfg, m, rt = self.cfg, self.cfg.memory, self.rt
        unit = self.layout.max_unit_numel * self.dtype.itemsize
        accum = self._accum_dtype()
        self.dev.check_capacity({"parameter slots (memory.device_slots)": m.device_slots * unit,
                                 "gradient buffers": GradStore.buffers_for(self.layout) * unit,
                                 "gradient accumulators (train.grad_accum_dtype)": GradStore.accum_bytes_for(
                                     self.layout, accum),
                                 "kept activations (memory.keep_act_mib)": m.keep_act_mib * MIB})
        self.update: Update = self._part(UPDATES[cfg.update.mode](cfg, rt.state_layout, self.storage, self.dtype,
                                                                  pin=self.dev.pin))
        if self.update.states != self.plan.states[: len(self.update.states)]:
            raise RuntimeError(f"update path {self.update.name} built other states than it declared")
        # slots the update can write into: only where device memory is host memory, on one rank
        # (a rank's engines update its shard of a unit, a slot holds the whole gathered unit)
        shared = (None if self.dev.separate or rt.world > 1
                  else self.update.share_slots(m.device_slots, self.layout.max_unit_numel))
        source, sink = self.update.params, self.update.grads
        if self.group is not None and self.group.world > 1:  # whole units gathered, gradients reduced
            source = ShardedParams(source, rt.state_layout, self.group)
            sink = ShardedGrads(sink, rt.state_layout, self.group)
        self.params = self._part(rt.bind_params(source, slot_tensors=shared))  # closed before the update
        self.grads = self._part(GradStore(self.layout, sink, self.dev, accum_dtype=accum))
        d = cfg.data
        self.stash = self._part(HiddenStash(
            self.storage, self.dev, shape=(d.micro_batch_size, d.seq_len, rt.hidden_size), dtype=self.dtype,
            entries=len(self.model.blocks) * d.micro_batches, host_bytes=m.stash_host_mib * MIB,
            micro_batches=d.micro_batches))
        a = self.acts
        self.offloaded = None
        if a.offloaded:
            self.offloaded = self._part(OffloadedGraphs(self.storage, self.dev, record_bytes=a.record_bytes,
                                                        records=a.offloaded, buffers=m.act_buffers,
                                                        input_of=self.stash.get))
        self.executor = LayerMajorExecutor(self.model, self.params, self.grads, self.stash, self.dev,
                                           keep_bytes=m.keep_act_mib * MIB,
                                           policy=policy_for(m.activations, a.kept, a.offloaded),
                                           offloaded=self.offloaded, after_unit=trim_heap if m.trim_heap else None)
        self.executor.ranks = rt.world
        self.ckpt = self._part(CheckpointIO(rt.canonical_layout, chunk_bytes=cfg.io.chunk_kib << 10))
        self._flops_per_token = flops_per_token(self.model, cfg.data.seq_len, rt.hidden_size)
        self.step = 0
        self._superseded: list[str] = []  # checkpoints of a later course of a resumed run, replaced at its first save

    def _part(self, obj):
        self._parts.append(obj)
        return obj

    # -- introspection (tests, benchmarks) --------------------------------------------------------------
    @property
    def optim(self):
        """The streamed optimizer when the update runs in this process, else None."""
        return getattr(self.update, "optim", None)

    @property
    def engines(self):
        """The update engines when the update runs in them, else None."""
        return getattr(self.update, "engines", None)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(self.layout.total_numel * d.dtype.itemsize for d in checkpointed(self.plan.states))

    @property
    def pool_bytes(self) -> dict[str, int]:
        """Fixed memory of every pool, by part (host memory on CPU; device + pinned on CUDA)."""
        return {
            "param slots + host params": self.params.pool_bytes,
            "grad buffers + host grads": self.grads.pool_bytes,
            **self.update.pools(),
            "stash": self.stash.pool_bytes,
            **({"activation records": self.offloaded.pool_bytes} if self.offloaded is not None else {}),
            "io bounce": self.storage.pool_bytes,
            "checkpoint buffers": self.ckpt.pool_bytes,
        }

    @contextlib.contextmanager
    def state_regions(self):
        """Every checkpointed state, by checkpoint file name, readable and writable per unit
        (the update is paused meanwhile): exactly the declared checkpointed states."""
        with self.update.regions() as regions:
            want = {d.name for d in checkpointed(self.plan.states)}
            if set(regions) != want:
                raise RuntimeError(f"checkpointed states declared {sorted(want)} but the update gives {sorted(regions)}")
            yield {f"{name}.bin": r for name, r in regions.items()}

    # -- weights ------------------------------------------------------------------------------------
    def initialize(self, progress: bool = True) -> None:
        """Write initial weights (and optimizer state) unit by unit: memory of one unit."""
        from tqdm import tqdm

        flat = aligned_empty(self.layout.max_unit_numel * 4).view(torch.float32)
        for unit in tqdm(self.layout.units, desc="init weights", disable=not progress, unit="unit"):
            values = self.source.load(unit.index, [r.name for r in unit.params])
            view = flat[: unit.numel]
            view.zero_()
            for rec in unit.params:
                t = values[rec.name]
                if tuple(t.shape) != tuple(rec.shape):
                    raise ConfigError(f"weights for {rec.name} have shape {tuple(t.shape)}, the model expects {tuple(rec.shape)}")
                view[rec.offset : rec.offset + rec.numel].copy_(t.reshape(-1))
            self.update.init_unit(unit.index, view if self.rt.world == 1 else self.rt.state_layout.shard(unit.index, view))
        self.update.finish_init()
        self.params.invalidate()
        # dropout draws from the global generators, which PyTorch seeds at random per process
        torch.manual_seed(self.cfg.train.seed)
        if self.cfg.memory.trim_heap:
            trim_heap()  # the units' weights passed through the heap: none of it stays for the steps

    def weights(self) -> dict[str, torch.Tensor]:
        """Current weights by name, fp32 (the declared weights state: master weights where
        kept). Loads the whole model: for tests and small exports."""
        out = {}
        with self.state_regions() as regions:
            state = next(d for d in self.plan.states if d.weights)
            src = regions[f"{state.name}.bin"]
            buf = aligned_empty(self.layout.max_unit_numel * src.dtype.itemsize).view(src.dtype)
            whole = WholeTensors(self.model.row_pieces)  # vocabulary pieces by their whole matrix's name
            for unit in self.layout.units:
                if self.rt.world > 1:  # this rank's shard, the others' gathered (every rank calls this)
                    own = self.rt.state_layout.shard(unit.index, buf)
                    src.read(unit.index, own).get()
                    self.group.all_gather(buf[: unit.numel], own.clone())
                else:
                    src.read(unit.index, buf).get()
                for rec in unit.params:
                    out.update(whole.add(rec.name, buf[rec.offset : rec.offset + rec.numel].view(rec.shape).float().clone()))
        return out

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str:
        """checkpoint.dir, else <train.run_dir>/checkpoints; ranks: rank 0's, for every rank."""
        return self._shared_root if self.group is not None and self.group.world > 1 else self.cfg.checkpoint_root

    def save_checkpoint(self) -> SaveResult | None:
        """A complete checkpoint of the current step (after the last finished step). Ranks:
        every rank calls it; rank 0 writes and returns the result, the others None."""
        if self.rt.world > 1:
            return self._save_ranks()
        with self.state_regions() as regions:
            res = self.ckpt.save(regions, self.checkpoint_root, self.step, self.user_cfg.to_dict(), keep=self.cfg.checkpoint.keep,
                                 drop=self._superseded)
        self._superseded = []
        log.info("saved checkpoint %s: %.2f GB in %.1f s (%.2f GB/s)", res.path, res.nbytes / 1e9, res.seconds, res.gbps)
        return res

    def restore(self, path: str) -> Manifest:
        """Load checkpoint ``path``: weights, optimizer state, step, RNG."""
        t0 = time.perf_counter()
        zero = {f"{d.name}.bin" for d in checkpointed(self.plan.states) if d.zero_if_absent}
        with self.state_regions() as regions:
            if self.rt.world > 1:  # every rank reads the canonical files, keeping its shard
                regions = {n: ScatteredRegion(r, self.rt.state_layout) for n, r in regions.items()}
            man = self.ckpt.restore(regions, path, zero_if_absent=zero)
        self.params.invalidate()
        self.step = man.step
        self.update.restored(man.step)
        log.info("resumed from %s (step %d) in %.1f s", path, man.step, time.perf_counter() - t0)
        return man

    def _save_ranks(self) -> SaveResult | None:
        """Rank 0 writes the checkpoint in the canonical layout, gathering unit by unit; the
        others take part in the same gathers (``dist/checkpoint.py``)."""
        g = self.group
        with self.state_regions() as regions:
            whole = {n: GatheredRegion(r, self.rt.state_layout, g) for n, r in regions.items()}
            if g.rank == 0:
                res = self.ckpt.save(whole, self.checkpoint_root, self.step, self.user_cfg.to_dict(),
                                     keep=self.cfg.checkpoint.keep, drop=self._superseded)
            else:
                follow(whole, self.rt.canonical_layout)
                res = None
        g.barrier()  # sync point: the checkpoint is in place before any rank goes on
        self._superseded = []
        if res is not None:
            log.info("saved checkpoint %s: %.2f GB in %.1f s (%.2f GB/s)", res.path, res.nbytes / 1e9, res.seconds,
                     res.gbps)
        return res

    @property
    def resume_command(self) -> str:
        """The command that continues this run (the user's run directory; with ranks, on as many)."""
        return resume_command(self.user_cfg.train.run_dir, self.rt.world)

    # -- steps --------------------------------------------------------------------------------------
    def train_step(self) -> StepRecord:
        cfg = self.cfg
        s0, io0 = time.perf_counter(), self.storage.stats()
        waits0 = self._waits()
        net0 = (self.group.traffic.sent, self.group.traffic.received) if self.group is not None else (0, 0)
        self.dev.reset_peak()  # the record's device peak is this step's
        lr = lr_at(self.step + 1, cfg.optim, cfg.train.steps)
        self.update.begin_step(self.step + 1, lr)
        out = self._run_step()
        t0 = time.perf_counter()
        self.grads.flush()  # sync point: every gradient home before the update reads it
        norm = self.grads.total_norm()
        coef = None
        if cfg.optim.grad_clip > 0:
            coef = torch.clamp(cfg.optim.grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
        upd = self.update.step(self.step + 1, lr, coef)
        self.params.invalidate()  # slot copies are stale: the update rewrote (or is rewriting) every unit
        update_s = time.perf_counter() - t0
        self.step += 1
        step_s = time.perf_counter() - s0
        io1 = self.storage.stats()
        rb = sum(io1[k].read_bytes - io0[k].read_bytes for k in io1)
        wb = sum(io1[k].write_bytes - io0[k].write_bytes for k in io1)
        rbusy = max((io1[k].read_busy_s - io0[k].read_busy_s for k in io1), default=0.0)
        wbusy = max((io1[k].write_busy_s - io0[k].write_busy_s for k in io1), default=0.0)
        peak = peak_flops(torch.cuda.get_device_name(self.dev.device) if self.dev.cuda else None)
        mfu = self._flops_per_token * out.tokens / step_s / peak if peak else None
        rec = StepRecord(
            step=self.step,
            loss=out.loss,
            lr=lr,
            grad_norm=float(norm),
            tokens=out.tokens,
            step_s=step_s,
            forward_s=out.forward_s,
            backward_s=out.backward_s,
            update_s=update_s,
            io_wait_s=self._waits() - waits0 + upd.wait_s,
            ssd_read_bytes=rb,
            ssd_write_bytes=wb,
            ssd_read_gbps=rb / rbusy / 1e9 if rbusy > 0 else 0.0,
            ssd_write_gbps=wb / wbusy / 1e9 if wbusy > 0 else 0.0,
            peak_host_bytes=host_peak_rss(),
            peak_device_bytes=self.dev.peak_bytes(),
            mfu=mfu,
            extra={"losses": out.losses, **self.update.record(), **self._act_record(), **self._net_record(net0)},
        )
        if self.group is not None and self.group.world > 1:
            rec.extra["per_rank"] = per_rank_figures(self.group, rec)
        epoch = self.corpus.epoch_of(self.step - 1, self.rt.world)  # examples: epochs done (raw text: None)
        if epoch is not None:
            rec.extra["epoch"] = epoch
        every = cfg.train.eval_every
        if every and (self.step % every == 0 or self.step == cfg.train.steps):  # after the step: not in step_s
            rec.extra["eval_loss"] = validation_loss(self.evalset, self.executor, cfg.data.micro_batches,
                                                     self.group if self.rt.world > 1 else None)
        return rec

    def _run_step(self):
        """The executor's step on this rank's micro-batches; with ranks, the loss is every
        rank's mean (summed in rank order) and the tokens every rank's."""
        if self.rt.world == 1:
            return self.executor.step(self.corpus.batches(self.step), scored=self.corpus.scored(self.step),
                                      positions=self.corpus.positions(self.step))
        g, M = self.group, self.cfg.data.micro_batches
        scored = self.corpus.scored(self.step, g.world)
        g.at_step(self.step + 1)  # told to the others: a rank that stops is named with its step
        every = None
        if self.executor.embed_pieces:  # the embedding pieces any rank's tokens use, on every rank
            every = [x for r in range(g.world) for x, _ in self.corpus.batches(self.step, rank=r, world=g.world)]
        out = self.executor.step(self.corpus.batches(self.step, rank=g.rank, world=g.world), every, scored,
                                 self.corpus.positions(self.step, rank=g.rank, world=g.world))
        total = g.sum_in_rank_order(torch.tensor(sum(out.losses), dtype=torch.float64))  # sync point
        out.loss = float(total) if scored else float(total) / (M * g.world)
        out.tokens *= g.world
        return out

    def _net_record(self, before: tuple[int, int]) -> dict:
        """Bytes this rank sent to and received from the others in the step (ranks only)."""
        if self.group is None:
            return {}
        t = self.group.traffic
        return {"ranks": self.group.world, "net_sent_bytes": t.sent - before[0], "net_received_bytes": t.received - before[1]}

    def _waits(self) -> float:
        """Seconds the compute thread has waited for the storage tier so far (sync points)."""
        return (self.params.stats.wait_s + self.stash.wait_s
                + (self.offloaded.wait_s if self.offloaded is not None else 0.0))

    def _act_record(self) -> dict:
        pairs, written = self.offloaded.take_stats() if self.offloaded is not None else (0, 0)
        return {"act_kept": self.executor.kept_pairs, "act_offloaded": pairs,
                "act_recomputed": self.executor.recomputed, "act_offload_bytes": written}

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
        stop = StopFlag(announce=self.rt.rank == 0)  # rank 0 speaks for the ranks
        with stop:
            if resume is not None:
                self.restore(resume)
                self.rundir.continue_metrics(self.step)
                self._superseded = [p for p in list_checkpoints(self.checkpoint_root) if step_of(p) > self.step]
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
            self.rundir.write_config(self.user_cfg.to_dict())
            metrics = MetricsLog(cfg.train.run_dir, resume=resume is not None, tensorboard=cfg.train.tensorboard)
            pred = self.predict() if cfg.train.predict else None
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
                        if pred is not None and rec.step == first + 4:  # steps 2-4: past the warm-up
                            measured = statistics.median(r.step_s for r in metrics.records[-3:])
                            log.info("step time: predicted %.2f s, measured %.2f s (median of the last 3 steps; "
                                     "%.2fx)", pred.step_s, measured, measured / pred.step_s)
                        if ck.every and self.step % ck.every == 0 and self.step < cfg.train.steps:
                            self.save_checkpoint()
                if stop.set:
                    log.warning("interrupted after step %d (%s)", self.step, stop.set)
                    if ck.on_interrupt and self.step > first:
                        self.save_checkpoint()
                    if list_checkpoints(self.checkpoint_root) and self.rt.rank == 0:
                        log.warning("resume with: %s", self.resume_command)
                    raise KeyboardInterrupt(f"interrupted after step {self.step}")
                if ck.at_end:
                    self.save_checkpoint()
                log.info("done: %s; metrics in %s", metrics.summary(), metrics.path)
                return metrics.records
            finally:
                metrics.close()

    def predict(self) -> Prediction | None:
        """The cost model's prediction of this run's step, logged (None when probing fails:
        a prediction is never worth stopping a run for)."""
        from ..cost import estimate

        try:
            pred = estimate(self.cfg, self.rt, self._rates, probe_mib=64)
            self._rates = pred.rates
        except Exception as exc:  # noqa: BLE001
            log.warning("no step-time prediction: %s", one_line(exc))
            return None
        parts = ", ".join(f"{p.name} {p.time_s:.2f} s ({p.bound})" for p in pred.phases)
        log.info("predicted step: %.2f s (%s); `tiertrain plan` shows why", pred.step_s, parts)
        return pred

    def close(self) -> None:
        """Stop every part, remove this run's scratch files (checkpoints hold what is worth
        keeping) and release the directories. Never raises: a part that fails to close (a dead
        engine, a damaged file) is logged and the others are still closed."""
        with contextlib.suppress(Exception):
            self.dev.synchronize()  # no copy may still run into or out of memory about to go
        for part in [*reversed(self._parts), self.rt]:
            try:
                part.close()
            except Exception as exc:  # noqa: BLE001 - the rest must still be closed
                log.warning("while closing %s: %s", type(part).__name__, one_line(exc))
        self._parts = []
        self.storage = None
        if self.lock is not None:
            if self.plan is not None:
                with contextlib.suppress(OSError):
                    clean_stale(self.cfg.io.paths, self.plan.names)
            self.lock.release(remove=True)
            self.lock = None
        if self.rundir is not None:
            self.rundir.release(remove_if_empty=True)
            self.rundir = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
