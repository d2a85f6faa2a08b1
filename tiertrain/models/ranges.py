"""What the units of a layer's experts cut into ranges share, whatever the MoE block's form
(``experts_cut.py``, ``experts_dense.py``, ``experts_list.py``): their place and their probe's
input."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["place_range", "even_routing", "exact_ids", "Shell"]


def place_range(unit: nn.Module, layer_index: int, k: int, n: int, lo: int, hi: int) -> None:
    """A range of experts' place: experts ``[lo, hi)`` of layer ``layer_index``, the ``k``-th of
    ``n`` ranges (its ``kind``, as the step line and the plan name it)."""
    unit.kind, unit.layer_index, unit.k, unit.n, unit.lo, unit.hi = (
        f"experts {lo}-{hi - 1}",
        layer_index,
        k,
        n,
        lo,
        hi,
    )


def even_routing(x: torch.Tensor, k: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's ``k`` experts spread evenly over ``e``, as values of ``x``'s dtype; ``x``
    repeated once per pair): what a range's probe takes (random values would name no expert)."""
    B, T, _ = x.shape
    ids = torch.arange(B * T * k, device=x.device).remainder(e).to(x.dtype).view(B, T, k)
    return ids, x.repeat_interleave(k, dim=-1)


def exact_ids(dtype: torch.dtype) -> int:
    """The most experts whose ids a carried tensor of ``dtype`` holds exactly (every integer up
    to 2 ** (mantissa bits + 1))."""
    return {torch.bfloat16: 256, torch.float16: 2048}.get(dtype, 1 << 24)


class Shell(nn.Module):
    """A unit's container of the whole layer's modules it calls, under their paths."""
