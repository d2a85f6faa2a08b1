"""The trainer: the training driver. Plans the run (``plan.py``), builds the runtime's stores,
one update path, the gradient store, the hidden-state stash and the layer-major executor from
the plan, and runs steps.

What it owns and may call: the ``Runtime`` (device, model, layout, storage, parameter
store), an ``Update`` (never asking which kind), ``GradStore``, ``HiddenStash``, the
executor, its checkpoints (``checkpoints.py``), its step meter (``meter.py``) and the run
directory; and the ranks' group, one process being a group of one (it never asks how many
ranks there are: what differs is the group's). Every part's states are declared before any
file exists (``SpacePlan``): the scratch space is claimed, stale files removed and checkpoints
made from those declarations.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING

import torch

from .. import faults
from ..activations.offload import OffloadedGraphs
from ..activations.policy import policy_for
from ..activations.stash import HiddenStash
from ..adapters import ADAPTER_FILE, AdapterUpdate
from ..checkpoint import (
    CheckpointError,
    CheckpointIO,
    CheckpointMismatch,
    Manifest,
    SaveResult,
    read_tensors,
)
from ..config import Config, ConfigError, ineffective_settings
from ..data import EvalSet, open_corpus
from ..device.host import HeapTrim, fix_mmap_threshold, host_rss, trim_heap
from ..dist.group import BrokenGroupError, SoloGroup
from ..dist.launch import resume_command
from ..errors import TiertrainError, one_line
from ..execute.executor import LayerMajorExecutor
from ..execute.loss import LossScale
from ..inference.validation import validation_loss
from ..io.scratch import ScratchLock, clean_stale
from ..models import WeightSource
from ..runtime import Runtime
from ..state.decl import SpacePlan, checkpointed
from ..state.grads import GradStore, accum_dtype_for
from ..state.quant import quant_spec
from ..update import UPDATES, Update
from ..update.lr import lr_at
from .advice import nothing_to_train, restorable
from .checkpoints import Checkpoints, refuse_another_kind, rows_read, said_after_restore
from .initial import write_initial_weights
from .interrupt import StopFlag
from .loop import run_steps
from .meter import StepMeter
from .metrics import MetricsLog, StepRecord, flops_per_token
from .plan import ActivationPlan, declare_states, device_needs, plan_run, predict_step, refuse_small_vocab, say_model
from .rundir import RunDir, clean_leftovers
from .step_guard import StepGuard

if TYPE_CHECKING:  # annotations only: the cost model is imported where it is used
    from ..cost.model import Prediction
    from ..dist.group import Group

__all__ = ["Trainer", "SpacePlan", "declare_states", "resume_command"]

log = logging.getLogger("tiertrain")
MIB = 1 << 20


class Trainer:
    """Everything a run needs, sized from the config once.

    ``weights`` overrides where the initial weights come from (tests load a plain
    PyTorch model's state this way); ``device`` the compute device (tests run on
    ``AsyncCpuDevice``); ``group`` the ranks of a sharded run (``dist.RankGroup``; each rank
    builds its own Trainer with the same config, see ``dist/ranks.py``), by default one.
    """

    def __init__(
        self,
        cfg: Config | dict,
        *,
        weights: WeightSource | None = None,
        device=None,
        group: Group | None = None,
        resuming: bool = False,
    ) -> None:
        self._started = {"at": time.perf_counter()}  # the start's parts, said as training begins (``run``)
        if isinstance(cfg, dict):  # sections as a TOML file holds them (the Python API)
            cfg = Config.from_dict(cfg)
        if not isinstance(cfg, Config):  # (None: an AttributeError, 'absolute')
            raise ConfigError(f"Trainer(cfg = {cfg!r}): give a Config or a dict of sections, as a TOML file holds them")
        cfg = cfg.absolute()  # stored in checkpoints: resume and export work from any directory
        self.group = group or SoloGroup()
        self._rss_at_start = host_rss()  # the budget bounds the growth from here
        self.user_cfg = cfg  # as given (checkpoints keep it: a resumed run plans its memory again)
        cfg = self.group.rank_config(cfg)  # with ranks: this rank's scratch and run subdirectories
        fix_mmap_threshold(cfg.memory.mmap_threshold_kib << 10)  # before any large tensor of the run
        cfg.check_writable()
        self.cfg = cfg
        self._rates = None
        self.acts = ActivationPlan(0, 0, 0, 0)
        self.budget = None
        self._parts: list = []
        self.lock: ScratchLock | None = None
        self.rundir: RunDir | None = None
        self.plan: SpacePlan | None = None  # set by _plan(), before anything reads it
        self._files_ours = False  # the plan's scratch files are this run's to remove (none was the user's)
        g = self.group  # (``resuming``: ``run(resume=...)`` comes, with the checkpoint's adapters)
        self.rt = Runtime(cfg, weights=weights, device=device, rank=g.rank, world=g.world, resuming=resuming)
        self.corpus = open_corpus(cfg.data)
        # a bad eval corpus (or one too small for the ranks) fails here, at start
        self.evalset = EvalSet(cfg.data, self.group.world) if cfg.train.eval_every else None
        refuse_small_vocab(self.model, cfg, self.corpus, self.evalset)
        # one run per scratch directory; a rank's own subdirectories are removed when left empty
        mine = cfg.io.paths != self.user_cfg.io.paths
        self.lock = ScratchLock(cfg.io.paths, disposable=mine, run_dir=cfg.train.run_dir)
        try:
            # per rank; the checkpoints rank 0's (a rank's own subdirectory holds none: "wrote none", it said)
            self.rundir = RunDir(cfg.train.run_dir, self.checkpoint_root, self.user_cfg.train.run_dir)
            for info in self.lock.unclean:
                log.warning("scratch %s was left by a run that did not finish (pid %s, started %s); its files are "
                            "replaced", info["path"], info.get("pid"), info.get("started"))  # fmt: skip
            t0 = time.perf_counter()
            self._started["the model and data"] = t0 - self._started["at"]
            self.plan = self._plan()
            t1 = time.perf_counter()
            self._started["the plan"] = t1 - t0
            self.lock.claim(self.plan.names)  # before any file is opened: a user's is never replaced
            self._files_ours = True  # from here on the scratch files of the plan's names are this run's
            cfg = self.cfg
            self.storage = self.rt.open_storage(cfg.io)  # after the plan: it may lower io.chunk_kib to fit the budget
            clean_leftovers(
                self.user_cfg.io.paths, self.group, self.checkpoint_root, self.storage.paths, self.lock, self.plan.names
            )
            say_model(cfg, self.rt, self.source)
            log.info("scratch space needed on %s: %s", ", ".join(cfg.io.paths), self.plan.describe())
            # a full disk is reported here, before any work: with ranks, for every rank of this
            # machine at once (they share its drives: each alone would fit where all do not)
            p = self.plan  # (checksum sidecars included: a disk filled to the data's size failed at the first save)
            self.group.check_space(self.storage.space_needs(p.files, placed=p.placed, records=p.records))
            self._build()
            self._started["pools and files"] = time.perf_counter() - t1
            faults.point("start")
        except BaseException:
            self.close()
            raise

    # -- construction -------------------------------------------------------------------------------
    def _plan(self) -> SpacePlan:
        """The run's plan (``plan.py``): memory budget, update path, activations, states; logged;
        the states' space plan returned."""
        plan = plan_run(self.cfg, self.rt, self.group)
        if plan.cfg.memory.trim_heap:
            trim_heap()  # the probes' tensors passed through the heap: given back before the pools are made
        self._rates = plan.rates
        # the model was cut to fit: a checkpoint resumes with the same units
        for cut in ("vocab_pieces", "layer_pieces"):
            if getattr(plan.cfg.model, cut) != getattr(self.user_cfg.model, cut):
                setattr(self.user_cfg.model, cut, getattr(plan.cfg.model, cut))
        for line in plan.lines():
            log.info("%s", line)
        self.cfg, self.budget, self.acts = plan.cfg, plan.budget, plan.acts
        return SpacePlan(plan.states)

    def _heap_trim(self) -> HeapTrim:
        """Trim the heap after a unit step once the process has grown past its budget less the
        working set a training step's unit step holds (every unit step where there is no budget)."""
        b = self.budget
        limit = None if b is None else self._rss_at_start + b.host_bytes - b.step_working
        self.heap_trim = HeapTrim(limit)
        return self.heap_trim

    def _accum_dtype(self) -> torch.dtype | None:
        return accum_dtype_for(self.cfg.train.grad_accum_dtype, self.cfg.data.micro_batches, self.dtype)

    def _build(self) -> None:
        cfg, m, rt = self.cfg, self.cfg.memory, self.rt
        unit = self.layout.max_unit_numel * self.dtype.itemsize
        accum = self._accum_dtype()
        self.dev.check_capacity(device_needs(cfg, rt, unit, accum))
        self.update: Update = self._part(
            UPDATES[cfg.update.mode](cfg, rt.state_layout, self.storage, self.dtype, pin=self.dev.pin, dev=self.dev)
        )
        if self.update.states != self.plan.states[: len(self.update.states)]:
            raise RuntimeError(f"update path {self.update.name} built other states than it declared")
        # slots the update can write into: where device memory is host memory and the update's
        # units are the slots' (a rank's update has its shard of a unit, a slot the whole unit)
        shared = self.update.share_slots(m.device_slots, self.layout.max_unit_numel) if rt.update_writes_slots else None
        # with ranks, whole units gathered from the shards and gradients summed over the ranks
        source, sink = self.group.wrap_update(self.update, rt.state_layout)
        self.params = self._part(
            rt.bind_params(source, slots=m.device_slots, slot_tensors=shared)
        )  # closed before the update
        self.grads = self._part(GradStore(self.layout, sink, self.dev, accum_dtype=accum))
        d = cfg.data
        self.stash = self._part(
            HiddenStash(
                self.storage,
                self.dev,
                shape=(d.micro_batch_size, d.seq_len, rt.hidden_size),
                dtype=self.dtype,
                entries=len(self.model.blocks) * d.micro_batches,
                host_bytes=m.stash_host_mib * MIB,
                micro_batches=d.micro_batches,
                widths=self.model.block_widths,
            )
        )
        a = self.acts
        self.offloaded = None
        if a.offloaded:
            self.offloaded = self._part(
                OffloadedGraphs(
                    self.storage,
                    self.dev,
                    record_bytes=a.record_bytes,
                    records=a.offloaded,
                    buffers=m.act_buffers,
                    input_of=self.stash.get,
                )
            )
        self.executor = LayerMajorExecutor(
            self.model,
            self.params,
            self.grads,
            self.stash,
            self.dev,
            keep_bytes=m.keep_act_mib * MIB,
            policy=policy_for(m.activations, a.kept, a.offloaded),
            offloaded=self.offloaded,
            after_unit=self._heap_trim() if m.trim_heap else None,
        )
        self.ckpt = self._part(CheckpointIO(rt.canonical_layout, chunk_bytes=cfg.io.chunk_kib << 10))
        self.checkpoints = Checkpoints(
            self.ckpt,
            self.group,
            rt.state_layout,
            rt.canonical_layout,
            lambda: self.user_cfg,
            weights=f"{self._weights_state().name}.bin",
            compute_dtype=str(self.dtype) if quant_spec(cfg.model) is not None else "",
        )
        self.meter = StepMeter(
            self.storage,
            self.dev,
            self.group,
            self._waits,
            flops_per_token(
                self.model,
                cfg.data.seq_len,
                rt.hidden_size,
                adapters=rt.adapters.flops() if rt.adapters is not None else None,
                micro_batch_tokens=cfg.data.seq_len * cfg.data.micro_batch_size,
            ),
        )
        self.adapter_update = AdapterUpdate(rt.adapters, cfg.optim) if rt.adapters is not None else None
        self.step = 0
        self._weighted = False  # initialize() or restore() gave the states their values
        self._closed = False  # close(): the parts stopped, the scratch files removed
        self._ran = False  # run() was called: a second would start the run over (or delete it)
        self._stop: StopFlag | None = None  # run()'s, while it steps: Ctrl-C cuts a validation short
        self._guard = StepGuard()  # a step cut short (a notebook's interrupt): what may still be done
        self._unchecked_start = False  # initialize() by hand: the run directory not yet asked (first save)

    def _need_open(self, what: str) -> None:
        """Refuse ``what`` once closed: states kept in memory would still step, with nothing on
        the storage tier behind them and nowhere to save."""
        if self._closed:
            raise TiertrainError(
                f"Trainer.{what}: this Trainer is closed (its parts stopped, its scratch files removed); "
                "make a new Trainer and restore(checkpoint) to go on"
            )

    def _need_weights(self, what: str) -> None:
        """Refuse ``what`` before the states have values: they are allocated zeroed, and a step
        from them trains a model of zeros without a word."""
        self._need_open(what)
        if not self._weighted:
            raise TiertrainError(
                f"Trainer.{what}: no weights yet; call initialize() (the configured initial weights) or "
                "restore(checkpoint) first (Trainer.run() does)"
            )

    def _part(self, obj):
        self._parts.append(obj)
        return obj

    # -- introspection (tests, benchmarks) --------------------------------------------------------------
    @property
    def dev(self):
        return self.rt.dev

    @property
    def dtype(self) -> torch.dtype:
        return self.rt.dtype

    @property
    def model(self):
        return self.rt.model

    @property
    def layout(self):
        return self.rt.layout

    @property
    def source(self) -> WeightSource:
        return self.rt.weights

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
        self._need_open("pool_bytes")
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
                raise RuntimeError(f"checkpointed states declared {sorted(want)}, the update gives {sorted(regions)}")
            yield {f"{name}.bin": r for name, r in regions.items()}

    # -- weights ------------------------------------------------------------------------------------
    def initialize(self, progress: bool = True) -> None:
        """Write initial weights (and optimizer state) unit by unit: memory of one unit. Seeds
        torch's global generators with ``train.seed`` (dropout draws from them) for the caller too."""
        self._need_open("initialize()")
        self._guard.refuse("initialize()")
        if self.step:  # a notebook's cell run again: the initial weights put back at step 3, saved as step 4
            raise TiertrainError(
                f"Trainer.initialize(): this Trainer is at step {self.step}; initial weights now would train on "
                "from that step's schedule and rows. Make a new Trainer to start over"
            )
        self._unchecked_start = not self._ran  # by hand: the run directory is asked at the first save
        write_initial_weights(self, progress)
        self.update.finish_init()
        self.params.invalidate()
        # dropout draws from the global generators (seeded at random per process): each rank its own
        torch.manual_seed(self.cfg.train.seed + self.group.rank)
        if self.cfg.memory.trim_heap:
            trim_heap()  # the units' weights passed through the heap: none of it stays for the steps
        self._weighted = True

    def _weights_state(self):
        """The declared state that holds the weights: master weights where kept, else the parameters."""
        return next(d for d in self.plan.states if d.weights)

    def weights(self) -> dict[str, torch.Tensor]:
        """Current weights by name, fp32 (the declared weights state: master weights where
        kept). Loads the whole model: for tests and small exports; every rank calls it."""
        self._need_weights("weights()")
        self._guard.refuse("weights()", reads_states=True)
        with self.state_regions() as regions:
            return self.checkpoints.weights(
                regions[f"{self._weights_state().name}.bin"],
                self.layout,
                self.model.row_pieces,
                getattr(self.update, "quant", None),
            )

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str:
        """checkpoint.dir, else <train.run_dir>/checkpoints; ranks: rank 0's, for every rank."""
        return self.user_cfg.checkpoint_root

    def save_checkpoint(self) -> SaveResult | None:
        """A complete checkpoint of the current step (after the last finished step). Ranks:
        every rank calls it; rank 0 writes and returns the result, the others None."""
        self._need_weights("save_checkpoint()")
        self._guard.refuse("save_checkpoint()", reads_states=True)
        if self._unchecked_start:  # started by hand (initialize(), no run()): another run's checkpoints there
            self.rundir.start_fresh(self.cfg.train.overwrite, self.group.world)  # were replaced by this one's
            self._unchecked_start = False
        with self.state_regions() as regions:
            rows = self.corpus.rows_read(self.step, self.group.world)
            return self.checkpoints.save(regions, self.step, self.checkpoint_extra(), rows, self.corpus.identity)

    def checkpoint_extra(self) -> dict | None:
        """A checkpoint's small files beside the states (the adapters'), by name."""
        return {ADAPTER_FILE: self.adapter_update.state(self.user_cfg)} if self.adapter_update is not None else None

    def restore(self, path: str) -> Manifest:
        """Load checkpoint ``path`` (a run directory: its latest): weights, optimizer state, step, RNG."""
        self._need_open("restore()")
        self._guard.refuse("restore()")
        path = restorable(path)
        if not self._ran and self.group.leader:  # by hand: into a directory of another run's, as run() refuses
            self.rundir.take_over(path, self.cfg.train.overwrite, self.group.world)
        self._unchecked_start = False
        zero = {f"{d.name}.bin" for d in checkpointed(self.plan.states) if d.zero_if_absent}
        # adapters or none, and which: named before any state is read (the files differ too)
        man = Manifest.read(path)
        refuse_another_kind(self.user_cfg, self.dtype, man, path)
        self.checkpoints.say_other_ranks(man, path, self.cfg.data)
        self.checkpoints.say_schedule(man, path, self.cfg.optim, self.cfg.train.steps)
        with self.state_regions() as regions:
            man = self.checkpoints.restore(regions, path, zero)
        if self.adapter_update is not None:
            tensors, meta = read_tensors(path, ADAPTER_FILE, man.entry(ADAPTER_FILE))
            self.adapter_update.load(tensors, meta, self.user_cfg, f"checkpoint {path}")
        self.params.invalidate()
        self.step = man.step  # and the data goes on from the rows it had read, whatever the batch now
        self.corpus.resume_at(man.step, rows_read(man, self.cfg.data, self.group.world))
        if self.group.leader:
            said_after_restore(man, self.user_cfg, self.corpus)
        self.update.restored(man.step)
        self._weighted = True
        return man

    @property
    def resume_command(self) -> str:
        """The command that continues this run (the user's run directory; with ranks, on as many)."""
        return resume_command(self.user_cfg.train.run_dir, self.group.world)

    # -- steps --------------------------------------------------------------------------------------
    def train_step(self) -> StepRecord:
        self._need_weights("train_step()")
        self._guard.refuse("train_step()")
        cfg = self.cfg
        if self.step >= cfg.train.steps:  # the schedule is laid out over train.steps: step 3/2 had no rate of its own
            raise TiertrainError(
                f"Trainer.train_step(): the run's train.steps = {cfg.train.steps} steps are done; to train on, "
                f"make the Trainer with a larger train.steps (the learning-rate schedule spans it) and "
                f"restore(checkpoint) of this run"
            )
        # before anything of the step is done: a step whose rows score nothing leaves the states
        # at the last step (``UnscoredStep``), as they can be saved
        scored = self.corpus.scored(self.step, self.group.world)
        with self._guard.step(self.step + 1):
            return self._step_once(scored)

    def _step_once(self, scored: int | None) -> StepRecord:
        """Step ``self.step + 1`` (``train_step``), its phases told to the guard."""
        cfg = self.cfg
        self.meter.begin()
        lr = lr_at(self.step + 1, cfg.optim, cfg.train.steps)
        self.update.begin_step(self.step + 1, lr)
        out = self._run_step(scored)
        self._guard.phase = "computed"
        t0 = time.perf_counter()
        self.grads.flush()  # sync point: every gradient home before the update reads it
        if self.adapter_update is not None:  # the only trained parameters: the base forms no gradient
            self.adapter_update.reduce(self.group)
            norm = self.adapter_update.total_norm()
        else:
            norm = self.grads.total_norm()
        coef = None
        if cfg.optim.grad_clip > 0:
            coef = torch.clamp(cfg.optim.grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
        self._guard.phase = "updating"  # from here some units may hold this step's update
        upd = self.update.step(self.step + 1, lr, coef)
        if self.adapter_update is not None:
            self.adapter_update.step(lr, norm)
        self.params.invalidate()  # slot copies are stale: the update rewrote (or is rewriting) every unit
        update_s = time.perf_counter() - t0
        self.step += 1
        self._guard.phase = "done"
        rec = self.meter.record(
            step=self.step,
            out=out,
            lr=lr,
            norm=float(norm),
            update_s=update_s,
            update_wait_s=upd.wait_s,
            extra={"losses": out.losses, **self.update.record(), **self._act_record()},
        )
        epoch = self.corpus.epoch_of(self.step - 1, self.group.world)  # examples: epochs done (raw text: None)
        if epoch is not None:
            rec.extra["epoch"] = epoch
        every = cfg.train.eval_every
        if every and (self.step % every == 0 or self.step == cfg.train.steps):  # after the step: not in step_s
            flag = self._stop  # Ctrl-C during the validation: cut short, not waited for (with ranks: agreed)
            stop = (lambda: bool(flag.agreed(self.group))) if flag is not None else None
            loss = validation_loss(self.evalset, self.executor, cfg.data.micro_batches, self.group, stop=stop)
            if loss is None and self.group.leader:  # (every rank's: the same answer)
                log.warning("step %d: its validation cut short by %s (no validation loss)", self.step, flag.agreed_on)
            else:
                rec.extra["eval_loss"] = loss
        return rec

    def _run_step(self, scored: int | None):
        """The executor's step on this rank's micro-batches (``scored``: the step's scored
        targets over every rank, None where every target counts); the loss is every rank's mean
        (summed in rank order) and the tokens every rank's."""
        g, step = self.group, self.step
        scale = LossScale(self.cfg.data.micro_batches, g.world, scored)
        g.at_step(step + 1)  # told to the others: a rank that stops is named with its step
        every = None
        if self.executor.embed_pieces:  # the embedding pieces any rank's tokens use, on every rank
            every = [x for r in range(g.world) for x, _ in self.corpus.batches(step, rank=r, world=g.world)]
        out = self.executor.step(
            self.corpus.batches(step, rank=g.rank, world=g.world),
            scale,
            every,
            self.corpus.positions(step, rank=g.rank, world=g.world),
            self.corpus.attention(step, rank=g.rank, world=g.world),
        )
        out.loss = scale.mean(float(g.sum_in_rank_order(torch.tensor(sum(out.losses), dtype=torch.float64))))
        out.tokens *= g.world
        return out

    def _waits(self) -> float:
        """Seconds the compute thread has waited for the storage tier so far (sync points)."""
        offloaded = self.offloaded.wait_s if self.offloaded is not None else 0.0
        return self.params.stats.wait_s + self.stash.wait_s + offloaded

    def _act_record(self) -> dict:
        pairs, written = self.offloaded.take_stats() if self.offloaded is not None else (0, 0)
        ex = self.executor
        return {"act_kept": ex.kept_pairs, "act_offloaded": pairs, "act_recomputed": ex.recomputed, "act_offload_bytes": written}  # fmt: skip

    def run(self, *, resume: str | None = None, progress: bool | None = None) -> list[StepRecord]:
        """Initialise (or restore checkpoint ``resume``), then train up to ``train.steps``,
        printing the per-step line and saving checkpoints as configured. Ctrl-C or SIGTERM
        stops after the current step (saving first when ``checkpoint.on_interrupt``; with ranks,
        every rank after the same step, whichever rank got it); a second one stops at once.
        Raises ``KeyboardInterrupt`` after an interrupted run has stopped."""
        cfg = self.cfg
        self._need_open("run()")
        if self.step or self._ran:  # run() starts (or resumes) a run: it would start it over, or delete it
            raise TiertrainError(
                f"Trainer.run(): this Trainer ran, or took steps or a checkpoint (step {self.step}); make a new "
                "Trainer for another run, with resume= the checkpoint to go on from"
            )
        if progress is None:  # no bar in a log file: its redraws would interleave with the step lines
            progress = cfg.train.progress and sys.stderr.isatty()
        for line in ineffective_settings(cfg) if self.group.leader else ():
            log.warning("%s", line)
        t_weights = time.perf_counter()
        if resume is None:
            self.rundir.start_fresh(cfg.train.overwrite, self.group.world)
        elif self.group.leader:  # a checkpoint of another run directory: this one must hold no run
            self.rundir.take_over(resume, cfg.train.overwrite, self.group.world)
        self._ran = True  # (a start refused above left nothing to redo: it may be asked again)
        with StopFlag(announce=self.group.leader) as stop:  # rank 0 speaks for the ranks
            if resume is not None:
                try:
                    self.restore(resume)
                except (CheckpointMismatch, ConfigError) as exc:  # another run's: every rank finds it, rank 0 says it
                    exc.quiet = not self.group.leader  # type: ignore[attr-defined]
                    raise
                except CheckpointError as exc:
                    exc.restoring = True  # type: ignore[attr-defined]  # the hint's cue: this checkpoint is the bad one
                    raise
            else:
                self.initialize(progress=progress)
            self._say_started("the checkpoint restored" if resume is not None else "initial weights", t_weights)
            first = self.step
            if first >= cfg.train.steps:  # before a later course is set aside: nothing of it is replaced
                (log.warning if self.group.leader else log.debug)("%s", nothing_to_train(first, cfg.train.steps, self.resume_command))  # fmt: skip  # rank 0 speaks for the ranks
                return []
            if resume is not None:
                self.rundir.continue_metrics(self.step)
                self.checkpoints.continue_from(self.step)
            # (examples: a step of no scored token) before the run directory holds anything
            self.corpus.refuse_unscored(first, self.cfg.train.steps, self.group.world)
            self.rundir.write_config(self.user_cfg.to_dict())
            metrics = MetricsLog(cfg.train.run_dir, resume=resume is not None, tensorboard=cfg.train.tensorboard)
            try:
                self._stop = stop
                return self._steps(stop, metrics, first, progress)
            finally:
                self._stop = None
                metrics.close()

    def _say_started(self, weights: str, since: float) -> None:
        """How long the start took, by part (a large model's start takes minutes: what of them),
        the construction's parts and ``weights`` (made or restored from ``since``)."""
        parts = {k: v for k, v in self._started.items() if k != "at"}
        parts[weights] = time.perf_counter() - since
        if self.group.leader:
            log.info(
                "started in %.1f s: %s", sum(parts.values()), ", ".join(f"{k} {v:.1f} s" for k, v in parts.items())
            )

    def _steps(self, stop: StopFlag, metrics: MetricsLog, first: int, progress: bool) -> list[StepRecord]:
        """The steps of ``run`` from step ``first`` on, their lines and checkpoints (``loop.py``)."""
        return run_steps(self, stop, metrics, first, progress)

    def predict(self) -> Prediction | None:
        """The cost model's prediction of this run's step, logged (None where probing failed)."""
        pred = predict_step(self.cfg, self.rt, self._rates)
        self._rates = pred.rates if pred is not None else self._rates
        return pred

    def close(self) -> None:
        """Stop every part, remove this run's scratch files (checkpoints hold what is worth
        keeping) and release the directories. Never raises: a part that fails to close (a dead
        engine, a damaged file) is logged and the others are still closed."""
        self._closed = True
        with contextlib.suppress(Exception):
            self.dev.synchronize()  # no copy may still run into or out of memory about to go
        for part in [*reversed(self._parts), self.rt]:
            try:
                part.close()
            except BrokenGroupError as exc:  # a unit still gathering: the error that broke the group said why
                log.debug("while closing %s: %s", type(part).__name__, one_line(exc))
            except Exception as exc:  # noqa: BLE001 - the rest must still be closed
                log.warning("while closing %s: %s", type(part).__name__, one_line(exc))
        self._parts = []
        self.storage = None
        if self.lock is not None:
            if self.plan is not None and self._files_ours:
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
