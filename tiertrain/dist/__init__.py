"""Ranks over torch.distributed: the process group, its collectives and their bytes
(``group.py``). Sharded training builds on it (see docs/plans/sharding.md)."""

from .group import RankError, RankGroup, Traffic, env_world

__all__ = ["RankError", "RankGroup", "Traffic", "env_world"]
