"""The run's checkpoints: written (by rank 0, in the layout of one rank, the other ranks taking
part in its gathers), restored (every rank its shard), rotated, the later course of a resumed
run replaced at its first save, and the command that continues a run.

What it reads and writes are the checkpointed states' regions, which the trainer gives it
while the update is paused (``Trainer.state_regions``); it knows nothing of which update path
holds them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch

from ..checkpoint import (
    CheckpointError,
    CheckpointIO,
    Manifest,
    SaveResult,
    list_checkpoints,
    set_aside,
    set_aside_dirs,
    step_of,
)
from ..dist.checkpoint import follow
from ..io import aligned_empty
from ..models.pieces import WholeTensors
from .rundir import mark_saved_elsewhere

__all__ = ["Checkpoints", "other_ranks_note", "rows_read", "changed_rows", "refuse_another_kind", "said_after_restore"]

log = logging.getLogger("tiertrain")


def other_ranks_note(trained: int, before: tuple[int, int], world: int, now: tuple[int, int]) -> str | None:
    """What a checkpoint trained on ``trained`` ranks (0: not recorded) of ``before`` =
    (micro-batches, rows each) a rank, resumed on ``world`` ranks of ``now``, must say; None
    where a step takes as many sequences as before. Allowed (every checkpoint holds whole
    states), but each rank takes its own micro-batches, so the global batch may change."""
    was, will = trained * before[0] * before[1], world * now[0] * now[1]
    if not trained or was == will or trained == world:  # the same ranks: the changed-settings line names it
        return None
    keep = was % (world * now[1]) == 0 and was // (world * now[1])
    hint = (
        f"--data.micro_batches={keep} keeps the checkpoint's"
        if keep
        else "no whole data.micro_batches keeps the checkpoint's"
    )
    return (
        f"was trained on {trained} rank(s), this run has {world}: each rank takes {now[0]} micro-batches of {now[1]} "
        f"sequences, so a step now takes {will} sequences (the checkpoint's steps took {was}); {hint}"
    )


def refuse_another_kind(user_cfg, dtype, man: Manifest, path: str) -> None:
    """Refuse checkpoint ``man`` (at ``path``) made for another kind of run than ``user_cfg``'s
    (its adapters, its base's precision, its heads, its optimizer), before any state is read."""
    from ..adapters.train import same_adapter_config
    from ..state.quant import same_base
    from ..update.adamw8bit import same_optimizer
    from .rundir import same_heads

    where, ours = f"checkpoint {path}", user_cfg.to_dict()
    same_adapter_config(ours["adapter"], man.config.get("adapter"), where)
    same_base(ours["model"], str(dtype), man, where)
    same_heads(ours["model"], man.config.get("model") or {}, where)
    theirs = man.config.get("optim", {}).get("name", "adamw")
    same_optimizer(user_cfg.optim.name, theirs, where, adapters=user_cfg.adapter.on)


def said_after_restore(man: Manifest, user_cfg, corpus) -> None:
    """What a restore of ``man`` tells (rank 0): the scratch its run left in other io.paths,
    removed; rows changed since it was saved."""
    from .rundir import abandoned_scratch

    abandoned_scratch(man.config, user_cfg.io.paths)  # a run killed, resumed with other io.paths
    if man.rows_of and corpus.identity and corpus.identity != man.rows_of:
        log.warning(changed_rows(man, corpus.identity, corpus.rows_per_epoch))


def changed_rows(man: Manifest, now: str, per_epoch: int) -> str:
    """What a resume says where the rows changed since checkpoint ``man`` (``now``: their
    identity now): the rows it had read are counted into the new ones."""
    return (
        f"data.corpus changed since the checkpoint of step {man.step} (then: {man.rows_of}; now: {now}): it goes "
        f"on from row {man.rows} of the new rows ({per_epoch} an epoch), in the order their epoch draws; rows may "
        "be read twice or never. Resume with the rows it was trained on to keep to its order"
    )


def rows_read(man: Manifest, data, world: int) -> int:
    """Fine-tuning rows a checkpoint's steps had read: as recorded, else (older checkpoints) its
    steps by its global batch (its ranks, micro-batches and rows, this run's where unrecorded)."""
    if man.rows:
        return man.rows
    d = man.config.get("data", {})
    return (
        man.step
        * (man.ranks or world)
        * d.get("micro_batches", data.micro_batches)
        * d.get("micro_batch_size", data.micro_batch_size)
    )


class Checkpoints:
    """``io``: the checkpoint writer and reader; ``group``: the ranks (one: a group of one);
    ``state_layout``: this rank's share of every unit; ``canonical``: the layout of one rank
    (the files'); ``config()``: the user's config (where checkpoints go, how many are kept, and
    what they store), read at each save."""

    def __init__(
        self, io: CheckpointIO, group, state_layout, canonical, config, weights: str, compute_dtype: str = ""
    ) -> None:
        self.io, self.group, self.state_layout, self.canonical, self.config = io, group, state_layout, canonical, config
        self.weights_file = weights  # the region that holds the weights (the manifest names it)
        self.compute_dtype = compute_dtype  # recorded: what a 4-bit base's weights are made in
        self._superseded: list[str] = []  # checkpoints of a later course of a resumed run

    @property
    def root(self) -> str:
        """checkpoint.dir, else <train.run_dir>/checkpoints: rank 0's, for every rank."""
        return self.config().checkpoint_root

    @property
    def pool_bytes(self) -> int:
        return self.io.pool_bytes

    def check_space_at_start(self, regions: dict, step: int, extra: dict | None = None) -> None:
        """Refuse a run whose first checkpoint (of ``step``) would not fit where checkpoints go,
        before it trains (found from outside: a run trained every step, then failed its final
        save: all of it lost). Every rank calls it, as ``save``."""
        g = self.group
        whole = g.gathered(regions, self.state_layout)
        problem = g.rank0s(self.io.space_problem(whole, self.root, step, extra) if g.leader else "")
        if problem:
            raise CheckpointError(
                f"at start, before any step: {problem}; free space there, or give checkpoint.dir another disk "
                "(the run would train, then fail to save)"
            )

    def save(
        self, regions: dict, step: int, extra: dict | None = None, rows: int = 0, rows_of: str = ""
    ) -> SaveResult | None:
        """A complete checkpoint of ``step`` from ``regions``. Every rank calls it; rank 0 writes
        and returns the result, the others take part in its gathers and return None. ``extra``:
        small files by name, ``(tensors, metadata)`` (the adapters)."""
        g, cfg = self.group, self.config()
        whole = g.gathered(regions, self.state_layout)
        # rank 0's disk, known to every rank before the gathers they would wait in
        problem = g.rank0s(self.io.space_problem(whole, self.root, step, extra) if g.leader else "")
        if problem:
            raise CheckpointError(problem)
        res = None
        if g.leader:
            res = self.io.save(
                whole,
                self.root,
                step,
                cfg.to_dict(),
                keep=cfg.checkpoint.keep,
                drop=self._superseded,
                weights=self.weights_file,
                extra=extra,
                compute_dtype=self.compute_dtype,
                ranks=g.world,
                rows=rows,
                rows_of=rows_of,
            )
        else:
            follow(whole, self.canonical)
        g.barrier()  # sync point: the checkpoint is in place before any rank goes on
        self._superseded = []
        if res is not None:
            mark_saved_elsewhere(cfg.train.run_dir, self.root)
            log.info(
                "saved checkpoint %s: %.2f GB in %.1f s (%.2f GB/s)", res.path, res.nbytes / 1e9, res.seconds, res.gbps
            )
        return res

    def say_other_ranks(self, man: Manifest, path: str, data) -> None:
        """A checkpoint resumed on other ranks than trained it (``other_ranks_note``), said by
        rank 0: ``--nproc`` is not a config setting that the changed-settings line names."""
        d = man.config.get("data", {})  # the checkpoint's own batch (this run's where it records none)
        before = (d.get("micro_batches", data.micro_batches), d.get("micro_batch_size", data.micro_batch_size))
        note = other_ranks_note(man.ranks, before, self.group.world, (data.micro_batches, data.micro_batch_size))
        if note and self.group.leader:
            log.warning("checkpoint %s %s", path, note)

    def say_schedule(self, man: Manifest, path: str, optim, steps: int) -> None:
        """A checkpoint resumed with another ``train.steps`` under a schedule that depends on
        it (cosine): the rates from here on are the new length's, which the changed-settings line
        does not name (raising the steps is how a run is continued); said with the jump and the
        setting that keeps the checkpoint's last rate, by rank 0."""
        from ..update.lr import lr_at

        before = man.config.get("train", {}).get("steps")
        if not isinstance(before, int) or before == steps or man.step >= steps or not self.group.leader:
            return
        had = {f.name for f in dataclasses.fields(optim)}  # the checkpoint's own settings set its rate
        trained = dataclasses.replace(optim, **{k: v for k, v in man.config.get("optim", {}).items() if k in had})
        was, now = lr_at(min(man.step, before), trained, before), lr_at(man.step + 1, optim, steps)
        if optim.schedule == "constant" or math.isclose(was, now, rel_tol=1e-3):
            return
        log.warning(
            "checkpoint %s was trained for train.steps = %d, now %d: the %s learning-rate schedule spans the %d, so "
            "step %d takes %.3g where step %d took %.3g (a run of %d steps from the start would have taken other "
            "rates before step %d); to go on at the checkpoint's rate: --optim.schedule=constant --optim.lr=%.3g",
            path, before, steps, optim.schedule, steps, man.step + 1, now, man.step, was, steps, man.step + 1, was,
        )  # fmt: skip

    def restore(self, regions: dict, path: str, zero_if_absent: set[str]) -> Manifest:
        """Checkpoint ``path`` into ``regions`` (every rank reads the files, keeping its shard)."""
        t0 = time.perf_counter()
        man = self.io.restore(self.group.scattered(regions, self.state_layout), path, zero_if_absent=zero_if_absent)
        log.info("resumed from %s (step %d) in %.1f s", path, man.step, time.perf_counter() - t0)
        return man

    def continue_from(self, step: int) -> None:
        """A run continued from ``step``: the checkpoints of a later course of it are replaced by
        its first save."""
        if not self.group.leader:  # (rank 0 keeps the checkpoints, for every rank)
            return
        later = [p for p in list_checkpoints(self.root) if step_of(p) > step]
        # a course set aside by an earlier resume that stopped before its first save: it goes too
        self._superseded = set_aside_dirs(self.root, "superseded")
        if not later:
            return
        # set aside at once, under names no resume takes: a crash before this course's first save
        # otherwise left `--resume RUN_DIR` (and its hint) the abandoned course, whose metrics a
        # resume had moved out (its steps mixed with this course's)
        self._superseded += set_aside(later, "superseded")
        log.warning(
            "%s hold(s) a later course of this run than step %d: set aside as %s (deleted by this run's first "
            "checkpoint; to take that course up again instead, rename it back before then)",
            ", ".join(map(os.path.basename, later)),
            step,
            ", ".join(map(os.path.basename, self._superseded)),
        )

    def weights(self, region, layout, row_pieces: dict, quant=None) -> dict[str, torch.Tensor]:
        """Every weight of ``region`` (the weights state) by name, fp32, vocabulary pieces as
        their whole matrices; ``quant``: the region holds a 4-bit base in this ``QuantLayout``
        (its weights dequantized). Loads the whole model; every rank calls it (ranks gather)."""
        out = {}
        dtype = region.dtype if quant is None else quant.dtype
        buf = aligned_empty(layout.max_unit_numel * dtype.itemsize).view(dtype)
        raw = None if quant is None else aligned_empty(quant.max_unit_numel)
        whole = WholeTensors(row_pieces)
        for unit in layout.units:
            if quant is not None:  # ranks: the record's bytes gathered whole (the region's own shards)
                lay = region.layout if hasattr(region.layout, "full") else None
                self.group.read_unit(region, unit.index, raw[: quant.units[unit.index].numel], lay)
                quant.dequantize_into(unit.index, raw, buf)
            else:
                self.group.read_unit(region, unit.index, buf, self.state_layout)
            for rec in unit.params:
                out.update(
                    whole.add(rec.name, buf[rec.offset : rec.offset + rec.numel].view(rec.shape).float().clone())
                )
        return out

    def close(self) -> None:
        self.io.close()
