"""Ranks over torch.distributed: the process group, its collectives and their bytes
(``group.py``), and the launcher of ``tiertrain train --nproc N`` (``launch.py``). Sharded
training builds on it (see docs/plans/sharding.md).

The group's names are imported on first use, so that the launcher, which needs none of them,
does not import torch (seconds at its start and its exit)."""

from __future__ import annotations

from typing import Any

__all__ = ["RankError", "RankGroup", "SoloGroup", "Group", "Traffic", "env_world"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import group

        return getattr(group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
