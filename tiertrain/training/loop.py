"""The steps of ``Trainer.run``: each step's line and metrics, the periodic and final
checkpoints, the guard against a diverged loss, and a stop the ranks agreed on."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..checkpoint import list_checkpoints
from ..cost.report import against_measured
from ..data.examples import UnscoredStep
from .guard import LossGuard
from .interrupt import StopFlag
from .metrics import MetricsLog, StepRecord

__all__ = ["run_steps"]

log = logging.getLogger("tiertrain")
MIB = 1 << 20


def run_steps(tr: Any, stop: StopFlag, metrics: MetricsLog, first: int, progress: bool) -> list[StepRecord]:
    """The steps of ``Trainer.run`` (``tr``: the trainer; not imported, which imports this) from
    step ``first`` on, their lines and checkpoints."""
    from tqdm import tqdm

    cfg, ck = tr.cfg, tr.cfg.checkpoint
    _first_checkpoint_fits(tr, first)
    pred = tr.predict() if cfg.train.predict else None
    log.info("fixed pools: %s", ", ".join(f"{k} {v / MIB:,.1f} MiB" for k, v in tr.pool_bytes.items()))
    guard = LossGuard()
    # the periodic save of the step just taken (the last step's is checkpoint.at_end's)
    periodic = lambda: bool(ck.every) and tr.step % ck.every == 0 and tr.step < cfg.train.steps  # noqa: E731
    with tqdm(total=cfg.train.steps, initial=tr.step, desc="train", disable=not progress, unit="step") as bar:
        while not (why := stop.agreed(tr.group)) and tr.step < cfg.train.steps:
            try:
                rec = tr.train_step()
            except UnscoredStep:  # past what was checked at start: the steps done are kept
                saves = ck.every or ck.at_end  # (a run that keeps no checkpoint is not given one)
                if saves and tr.step > first and not periodic():  # every rank alike
                    tr.save_checkpoint()
                    if tr.group.leader:
                        log.warning("saved step %d, the last the data lets this run take", tr.step)
                raise
            metrics.add(rec)
            bar.update()
            bar.set_postfix(loss=f"{rec.loss:.3f}")
            diverged = guard.check(rec.step, rec.loss, rec.grad_norm)
            if rec.step % cfg.train.log_every == 0 or rec.step == cfg.train.steps or diverged:
                log.info(rec.line(cfg.train.steps))
            if diverged:
                raise diverged  # before any save: a non-finite step is never kept
            if pred is not None and rec.step == first + 4:  # steps 2-4: past the warm-up
                log.info(against_measured(cfg, tr.rt, pred, metrics.records[-3:]))
            if periodic():
                tr.save_checkpoint()
    if why:
        if tr.group.leader:
            log.warning("interrupted after step %d (%s)", tr.step, why)
        if ck.on_interrupt and tr.step > first and not periodic():  # the same step saved again only risks it
            tr.save_checkpoint()
        if list_checkpoints(tr.checkpoint_root) and tr.group.leader:
            log.warning("resume with: %s", tr.resume_command)
        raise KeyboardInterrupt(f"interrupted after step {tr.step}")
    if ck.at_end:
        tr.save_checkpoint()
    if os.path.exists(metrics.path):
        log.info("done: %s; metrics in %s", metrics.summary(), metrics.path)
    else:  # (written on through a file deleted under it: "metrics in" a file that was gone)
        log.warning(
            "done: %s; but %s was deleted during the run: its metrics and config.json are lost (the checkpoints: %s)",
            metrics.summary(),
            metrics.path,
            tr.checkpoint_root,
        )
    return metrics.records


def _first_checkpoint_fits(tr: Any, first: int) -> None:
    """The run's first checkpoint fits where checkpoints go, checked before any step (a run
    trained every step, then failed its final save: all of it lost)."""
    ck = tr.cfg.checkpoint
    if not (ck.every or ck.at_end):
        return
    step = min(first + ck.every, tr.cfg.train.steps) if ck.every else tr.cfg.train.steps
    with tr.state_regions() as regions:
        tr.checkpoints.check_space_at_start(regions, step, tr.checkpoint_extra())
