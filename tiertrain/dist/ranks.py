"""A rank's view of the run: its config, checked against the other ranks'.

Every rank starts with the same config (``torchrun`` starts the same command N times).
What differs per rank is derived here, so that ranks never share a file:

- scratch: rank ``r`` works in ``<path>/rank<r>`` of every ``io.paths`` entry (the ranks of a
  machine share its drives; each rank's files, locks and space claims are its own). For a
  drive per rank, give each rank's machine its own ``io.paths``: the subdirectory is added
  the same way;
- run directory: rank 0 writes ``train.run_dir`` (metrics, the per-step line, the config);
  rank ``r > 0`` writes its own metrics to ``<run_dir>/ranks/<r>``;
- the device: the CPU, over Gloo (CUDA ranks are refused: not built yet);
- the update path: ``baseline`` (``auto`` resolves to it). Its parameter loads are issued in
  the schedule's order alone, which is what keeps every rank's collectives in the same order;
  the overlapped update and the engines let the update's progress decide when a unit is
  loaded, and are refused.

The config every rank must share (everything but the per-rank paths) is compared at start;
a rank that differs is named.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..config import Config, ConfigError
from .group import RankGroup

__all__ = ["rank_config", "RANK_MODES"]

RANK_MODES = ("auto", "baseline")


def rank_config(cfg: Config, group: RankGroup) -> Config:
    """``cfg`` (the same on every rank, refused otherwise) as rank ``group.rank`` runs it."""
    shared = cfg.to_dict()
    group.check_same("the config", shared)
    if cfg.update.mode not in RANK_MODES:
        raise ConfigError(f"update.mode = {cfg.update.mode!r} with {group.world} ranks: sharded training runs the "
                          "baseline update (the others decide when a unit is loaded by the update's progress, which "
                          "would differ between ranks); set update.mode = 'baseline' or 'auto'")
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cuda or cfg.ranks.backend == "nccl":
        raise ConfigError(f"train.device = {cfg.train.device!r} / ranks.backend = {cfg.ranks.backend!r} with "
                          f"{group.world} ranks: sharded training runs on the CPU with Gloo so far (CUDA ranks are not "
                          "built yet); set train.device = 'cpu', or train on one rank")
    r = group.rank
    io = dataclasses.replace(cfg.io, paths=[os.path.join(p, f"rank{r}") for p in cfg.io.paths])
    train = cfg.train if r == 0 else dataclasses.replace(cfg.train, run_dir=os.path.join(cfg.train.run_dir, "ranks", str(r)))
    update = dataclasses.replace(cfg.update, mode="baseline")
    return dataclasses.replace(cfg, io=io, train=train, update=update)
