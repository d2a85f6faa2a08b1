"""A rank's view of the run: its config, checked against the other ranks'.

Every rank starts with the same config (``torchrun`` starts the same command N times).
What differs per rank is derived here, so that ranks never share a file:

- scratch: rank ``r`` works in ``<path>/rank<r>`` of every ``io.paths`` entry (the ranks of a
  machine share its drives; each rank's files, locks and space claims are its own). For a
  drive per rank, give each rank's machine its own ``io.paths``: the subdirectory is added
  the same way;
- run directory: rank 0 writes ``train.run_dir`` (metrics, the per-step line, the config);
  rank ``r > 0`` writes its own metrics to ``<run_dir>/ranks/<r>``;
- the device: the CPU, or on CUDA the machine's GPU ``LOCAL_RANK``; the collectives run on
  host memory over Gloo either way (``shard.py``), and ``ranks.backend = 'nccl'`` is refused;
- the update path: any (``baseline``, ``overlap``, ``engines``), each rank updating its own
  shard. ``auto`` is resolved by every rank's planner, and rank 0's choice is taken by all
  (``Trainer``): a mode from one rank's own measurements could differ from another's. The
  parameter loads that the gathers follow are issued in the schedule's order alone, whatever
  the update's progress (``ShardedParams.can_prefetch``), so every rank issues its
  collectives in the same order with every update path.

The config every rank must share (everything but the per-rank paths) is compared at start;
a rank that differs is named.
"""

from __future__ import annotations


import dataclasses
import os

import torch

from ..config import Config
from ..device.core import resolve_device
from ..ranks_fit import refuse_nccl


__all__ = ["rank_config", "per_rank_figures"]


def rank_config(cfg: Config, group) -> Config:
    """``cfg`` (the same on every rank, refused otherwise) as rank ``group.rank`` runs it."""
    shared = cfg.to_dict()
    group.check_same("the config", shared)
    refuse_nccl(cfg.ranks.backend, group.world)
    # (a CPU build or no visible GPU refused as one rank refuses it, not a modulo by no devices)
    cuda = resolve_device(cfg.train.device).type == "cuda"
    if cuda:  # a machine's rank r computes on its GPU r (torchrun's LOCAL_RANK), wrapping round
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", group.rank)) % torch.cuda.device_count())
    r = group.rank
    io = dataclasses.replace(cfg.io, paths=[os.path.join(p, f"rank{r}") for p in cfg.io.paths])
    train = cfg.train if r == 0 else dataclasses.replace(cfg.train, run_dir=os.path.join(cfg.train.run_dir, "ranks", str(r)))
    return dataclasses.replace(cfg, io=io, train=train)


def per_rank_figures(group, rec) -> list[dict]:
    """Every rank's disk bytes, I/O wait and peak RSS of the step ``rec`` (a ``StepRecord``),
    gathered on every rank (rank 0 prints them). Sync point; after the step's traffic was
    counted, before the next's."""
    mine = torch.tensor([rec.ssd_read_bytes, rec.ssd_write_bytes, rec.io_wait_s, rec.peak_host_bytes],
                        dtype=torch.float64)
    every = torch.empty(group.world, mine.numel(), dtype=torch.float64)
    group.all_gather(every, mine)
    return [dict(ssd_read_bytes=int(r[0]), ssd_write_bytes=int(r[1]), io_wait_s=float(r[2]),
                 peak_host_bytes=int(r[3])) for r in every.tolist()]
