"""Update paths: the streamed optimizer in the trainer after the backward (``baseline``), in a
background thread under compute (``overlap``) or next to storage (``engines``), behind one
interface (``base.Update``)."""

from __future__ import annotations

from .base import GradSink, ParamSource, Update, UpdateStats
from .baseline import BaselineUpdate
from .engines import EngineError, EngineUpdate
from .frozen import FrozenUpdate
from .overlap import OverlapUpdate

__all__ = [
    "Update",
    "ParamSource",
    "GradSink",
    "UpdateStats",
    "BaselineUpdate",
    "EngineUpdate",
    "OverlapUpdate",
    "FrozenUpdate",
    "EngineError",
    "UPDATES",
]

# update.mode -> its implementation; a new path is one more entry. 'auto' is resolved before a
# run is built (cost/choose.py) to the baseline or the overlap, which declare the same states:
# where a saved config is only read (export), it declares as the baseline.
UPDATES: dict[str, type[Update]] = {
    "baseline": BaselineUpdate,
    "overlap": OverlapUpdate,
    "engines": EngineUpdate,
    "frozen": FrozenUpdate,  # every unit frozen (adapters): chosen by the planner, never by hand
    "auto": BaselineUpdate,
}
