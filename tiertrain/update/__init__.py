"""Update paths: the streamed optimizer in the trainer (``baseline``) or next to storage
(``engines``), behind one interface (``base.Update``)."""

from __future__ import annotations

from .base import GradSink, ParamSource, Update, UpdateStats
from .baseline import BaselineUpdate
from .engines import EngineError, EngineUpdate

__all__ = ["Update", "ParamSource", "GradSink", "UpdateStats", "BaselineUpdate", "EngineUpdate", "EngineError", "UPDATES"]

# update.mode -> its implementation; a new path is one more entry
UPDATES: dict[str, type[Update]] = {"baseline": BaselineUpdate, "engines": EngineUpdate}
