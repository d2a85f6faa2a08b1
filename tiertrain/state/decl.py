"""State declared by its owner: what every part keeps per unit, where, and whether a
checkpoint holds it.

Each part (the update path, the hidden-state stash, the top-k residual) declares its
states once, as ``StateDecl`` records computed from the config without touching a disk,
and builds itself from the same records. Everything that must know about all states
iterates over the declarations: the scratch space claimed before the first step
(``SpacePlan``), the files a later run may remove as stale, checkpoint save and restore,
export (the weights state), the host memory printed at start. Adding a kind of state is
one declaration in its owner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

from ..io import IOFuture

__all__ = ["FileDecl", "StateDecl", "SpacePlan", "Region", "checkpointed"]


@dataclass(frozen=True)
class FileDecl:
    """A file on the storage tier: ``name`` striped over every path (``path`` None) or on one
    path; ``size`` bytes, claimed before the first step (with its checksum sidecar: per
    ``record_bytes`` record where it is checksummed so, ``Storage.block_for``)."""

    name: str
    size: int
    path: str | None = None
    record_bytes: int = 0


@dataclass(frozen=True)
class StateDecl:
    """One kind of state a part owns, per unit.

    ``name`` is the state's name and, for checkpointed states, its checkpoint file
    (``<name>.bin``, always in the whole model's layout order, whatever the run's placement).
    ``weights``: the model's weights (export takes the first weights state declared with
    ``weights`` set: fp32 master weights are declared before lower-precision parameters).
    ``zero_if_absent``: a checkpoint without it restores it as zeros (with a warning), e.g. a
    residual of error feedback turned on at resume.
    """

    name: str
    dtype: torch.dtype
    owner: str
    checkpointed: bool
    host_bytes: int = 0
    files: tuple[FileDecl, ...] = ()
    weights: bool = False
    zero_if_absent: bool = False
    double: bool = False  # held twice (``state/double.py``, the speculative update): two files
    # units held in device memory (``memory.optim_device_mib``): neither in host_bytes nor on file
    device_units: frozenset[int] = frozenset()

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.files)


class Region(Protocol):
    """A state's values per unit, wherever they live (RAM, one file, engines' files): what
    checkpoints read and write. Element ranges are unit-local."""

    dtype: torch.dtype
    esize: int

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture: ...

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture: ...


def checkpointed(decls: Iterable[StateDecl]) -> list[StateDecl]:
    return [d for d in decls if d.checkpointed]


@dataclass
class SpacePlan:
    """Every file the run will make on the storage tier, from the parts' declarations."""

    states: list[StateDecl] = field(default_factory=list)

    @property
    def all_files(self) -> list[FileDecl]:
        return [f for d in self.states for f in d.files if f.size]

    @property
    def total(self) -> int:
        return sum(f.size for f in self.all_files)

    @property
    def names(self) -> list[str]:
        """File names (as they appear in each scratch directory) this run keeps."""
        return [f.name for f in self.all_files]

    @property
    def files(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of the files striped over every path."""
        return [(f.name, f.size) for f in self.all_files if f.path is None]

    @property
    def records(self) -> dict[str, int]:
        """Record bytes of the files checksummed per record (their sidecars are larger)."""
        return {f.name: f.record_bytes for f in self.all_files if f.record_bytes}

    @property
    def placed(self) -> list[tuple[str, int]]:
        """``(full path, bytes)`` of the files on one path (update engines' files)."""
        return [(os.path.join(f.path, f.name), f.size) for f in self.all_files if f.path is not None]

    def describe(self) -> str:
        if not self.all_files:
            return "none (every state in memory)"
        parts = ", ".join(f"{f.name} {f.size / 2**20:,.1f} MiB" for f in self.all_files)
        return f"{self.total / 2**30:.2f} GiB ({parts})"

    def host_bytes(self) -> dict[str, int]:
        """Host memory the states hold, by owner."""
        out: dict[str, int] = {}
        for d in self.states:
            out[d.owner] = out.get(d.owner, 0) + d.host_bytes
        return out
