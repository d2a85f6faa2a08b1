"""Named shared-memory segments mapped as tensors, for the trainer and its engines.

The mapping is torch's own (``torch.from_file`` on ``/dev/shm/<name>``), so no Python
buffer is exported and closing never fails with "exported pointers exist". The trainer
creates a segment and unlinks its name as soon as every engine has mapped it: the memory
lives as long as a mapping does, and a killed run leaves nothing in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
from multiprocessing.shared_memory import SharedMemory

import torch

__all__ = ["SharedSegment", "attach"]

_DIR = "/dev/shm"


class SharedSegment:
    """A new segment of ``size`` bytes (zero-filled), mapped here as ``tensor`` (uint8)."""

    def __init__(self, size: int) -> None:
        shm = SharedMemory(create=True, size=size)  # a unique name, registered for cleanup if we die
        self.name, self.size = shm.name, size
        self._shm: SharedMemory | None = shm
        self.tensor = torch.from_file(f"{_DIR}/{self.name}", shared=True, size=size, dtype=torch.uint8)
        shm.close()  # its own mmap: ours is the tensor's

    def unlink(self) -> None:
        """Remove the name (mappings stay valid until unmapped). Idempotent."""
        if self._shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
            self._shm = None


def attach(name: str, size: int) -> torch.Tensor:
    """Map segment ``name`` (made by another process) as a uint8 tensor of ``size`` bytes."""
    return torch.from_file(f"{_DIR}/{name}", shared=True, size=size, dtype=torch.uint8)
