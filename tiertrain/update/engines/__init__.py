"""Update engines: the optimizer next to the storage that holds its state (Smart-Infinity).

``client.py`` is the trainer's side (``EngineUpdate``, an ``Update``), ``worker.py`` the
engine process, ``protocol.py`` the messages between them and the engine's lifecycle.
"""

from .client import EngineError, EngineUpdate
from .decl import engine_file

__all__ = ["EngineUpdate", "EngineError", "engine_file"]
