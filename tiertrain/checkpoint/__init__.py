"""Checkpoints: complete-or-absent directories of the whole run state, checked on load."""

from .manifest import (
    CheckpointError,
    CheckpointMismatch,
    Manifest,
    clean_incomplete,
    find_checkpoint,
    intact_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    set_aside,
    set_aside_damaged,
    set_aside_dirs,
    step_of,
    verify_checkpoint,
)
from .saver import CheckpointIO, SaveResult, read_tensors, write_tensors

__all__ = [
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointIO",
    "Manifest",
    "SaveResult",
    "clean_incomplete",
    "find_checkpoint",
    "intact_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "set_aside",
    "set_aside_dirs",
    "set_aside_damaged",
    "step_of",
    "verify_checkpoint",
    "read_tensors",
    "write_tensors",
]
