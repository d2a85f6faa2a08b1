"""Position ids of transformers models from the units' ``positions`` (``[T]``, or ``[B, T]``
for packed rows whose positions restart at each document)."""

from __future__ import annotations

import torch

from .base import default_positions

__all__ = ["hf_positions", "packed_positions"]


def hf_positions(h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """``[1, T]`` position ids (HF layout) of the hidden states ``h``, or the ``[B, T]`` ones
    of packed rows."""
    if positions is not None and positions.dim() == 2:
        return positions
    return (default_positions(h) if positions is None else positions).view(1, -1)


def packed_positions(positions: torch.Tensor | None) -> torch.Tensor | None:
    """The positions of packed rows (``[B, T]``), given to the mask; None for one sequence a row."""
    return positions if positions is not None and positions.dim() == 2 else None
