"""The Python API: ``tiertrain.train(config)`` runs what ``tiertrain train`` runs, from a script
or a notebook, and returns the step records; ``Trainer`` gives the steps one by one.

``config`` is a ``Config``, a dict of sections (``{"model": {"n_layers": 4}, "train": {...}}``,
as a TOML file would hold them), the path of a TOML file, or None (the defaults); ``overrides``
are ``--section.field=value`` strings, applied on top as on the command line. Logging goes to
stderr as the CLI's does (the ``tiertrain`` logger, set up once where nobody set logging up; to
the caller's handlers where it configured the root logger), the
progress bar shows where stderr is a terminal (or ``progress=True``)."""

from __future__ import annotations

import gc
import logging
import sys

from .config import Config, as_config
from .training.metrics import StepRecord

__all__ = ["train", "as_config"]

log = logging.getLogger("tiertrain")


def train(
    config: Config | dict | str | None = None, *overrides: str, resume: str | None = None, progress: bool | None = None
) -> list[StepRecord]:
    """Train as ``tiertrain train`` does (see the module docstring); ``resume``: a checkpoint
    or run directory (its latest checkpoint) to continue, with ``config`` or else the
    checkpoint's own config. The records of the steps run (``StepRecord``: loss, tokens/s,
    bytes per tier, memory, ``extra['eval_loss']`` where taken)."""
    from .training.trainer import Trainer

    if resume is not None:
        from .checkpoint import Manifest
        from .config import parse_overrides
        from .training.advice import find_resumable
        from .training.rundir import resumed_tree

        where, resume = resume, find_resumable(resume, "resume")  # a run directory: its latest checkpoint
        if config is None:  # the checkpoint's own config where it now is, the overrides on top
            config = resumed_tree(Manifest.read(resume).config, resume, parse_overrides(overrides), where)
            overrides = ()
    cfg = as_config(config, overrides)
    _log_to_stderr()
    with Trainer(cfg, resuming=resume is not None) as trainer:
        records = trainer.run(resume=resume, progress=progress)
    del trainer
    gc.collect()  # its parts hold each other (its step meter its wait counter): its memory freed now
    return records


def _log_to_stderr() -> None:
    """The ``tiertrain`` logger to stderr, as the CLI's, where nobody set logging up: where the
    caller configured the root logger (``logging.basicConfig(filename=...)``), its handlers take
    the lines (at INFO where the caller set the logger no level), not a handler of ours beside
    them (its file got none of them, and a stderr handler of the caller's printed each twice)."""
    ours = [h for h in log.handlers if getattr(h, "_tiertrain", False)]
    if ours and logging.getLogger().handlers:  # the caller set logging up after an earlier train(): theirs now
        for h in ours:
            log.removeHandler(h)
        log.propagate = True
    elif log.handlers:
        return
    if logging.getLogger().handlers:
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    handler._tiertrain = True  # type: ignore[attr-defined]  # (given back where the caller sets logging up later)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
