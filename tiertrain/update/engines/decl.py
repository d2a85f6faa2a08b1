"""What the update engines declare before any of them exists: each engine's slice of every
unit, the states it keeps in its own files (optimizer moments, parameters, gradients spilled
past their budget), their merge into the trainer's one list of declared states, and the bytes
of their shared gradient slots (the one memory budget counts them)."""

from __future__ import annotations

import dataclasses

import torch

from ...compress.feedback import ErrorFeedback
from ...config import Config
from ...io import round_up
from ...state.decl import FileDecl, StateDecl
from ...state.double import declare_state
from ...state.layout import FlatLayout, chunk_align
from ...state.regions import TieredRegions
from ...state.slices import SliceLayout, partition, unit_records
from ..streamed import optimizer_states

__all__ = ["declare_states", "engine_states", "engine_file", "engine_slot_bytes", "slot_bytes_of", "OWNER", "SLOTS"]

MIB = 1 << 20
SLOTS = 2  # gradient slots per engine: back-pressure, nothing grows
OWNER = "update engines"


def slot_bytes_of(views) -> int:
    """Bytes of each engine's gradient slot: the largest slice of a unit, in fp32."""
    return max(4096, round_up(max(v.max_unit_numel for v in views) * 4, 4096))


def engine_slot_bytes(layout: FlatLayout, engines: int, align: int, pdtype: torch.dtype) -> int:
    """All engines' shared gradient slots (``SLOTS`` each), before any engine exists."""
    return engines * SLOTS * slot_bytes_of(slice_views(layout, engines, chunk_align(align, pdtype))[1])


OWNER = "update engines"


def engine_file(index: int, kind: str) -> str:
    """Name of engine ``index``'s file of one kind of state (engines may share a path)."""
    return f"engine{index}.{kind}.bin"


def slice_views(layout: FlatLayout, n: int, align: int) -> tuple[list, list[SliceLayout]]:
    slices = partition(layout, n, align)
    records = unit_records(layout)
    return slices, [SliceLayout(records, s, frozen_of(layout)) for s in slices]


def frozen_of(layout: FlatLayout) -> set[int]:
    """The units ``train.freeze`` keeps: no engine updates them."""
    return {u.index for u in layout.units if u.frozen}


def engine_states(
    cfg: Config, layout: FlatLayout, pdtype: torch.dtype, align: int, paths: list[str]
) -> list[list[StateDecl]]:
    """Per engine, the states it keeps in its files on its path (built by the worker);
    speculating, every state its update writes is held twice (``state/double.py``)."""
    n = cfg.update.engines or len(paths)
    double = cfg.update.speculate == "on"
    _, views = slice_views(layout, n, chunk_align(align, pdtype))
    out = []
    for i, v in enumerate(views):
        path = paths[i % len(paths)]
        own = lambda name, i=i: engine_file(i, name)  # noqa: E731
        out.append(
            [
                *optimizer_states(cfg.optim, v, pdtype, align, 0, owner=OWNER, file=own, path=path, double=double),
                declare_state(
                    double,
                    v,
                    own("params"),
                    pdtype,
                    0,
                    align,
                    name="params",
                    owner=OWNER,
                    checkpointed=True,
                    path=path,
                    weights=pdtype == torch.float32,
                ),
                TieredRegions.declare(
                    v,
                    own("grads"),
                    pdtype,
                    cfg.memory.grad_host_mib * MIB // n,
                    align,
                    name="grads",
                    owner=OWNER,
                    checkpointed=False,
                    path=path,
                ),
            ]
        )
    return out


def declare_states(
    cfg: Config, layout: FlatLayout, pdtype: torch.dtype, align: int, paths: list[str]
) -> list[StateDecl]:
    """Every state, over all engines' files, and (error feedback) the top-k residual."""
    per = engine_states(cfg, layout, pdtype, align, paths)
    merged = []
    for j, first in enumerate(per[0]):
        parts = [states[j] for states in per]
        files: tuple[FileDecl, ...] = tuple(f for d in parts for f in d.files)
        merged.append(dataclasses.replace(first, host_bytes=sum(d.host_bytes for d in parts), files=files))
    if cfg.update.error_feedback:
        merged.append(ErrorFeedback.declare(layout, align, cfg.memory.residual_host_mib * MIB))
    return merged
