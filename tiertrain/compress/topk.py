"""Top-k gradient compression (Smart-Infinity's SmartComp).

The trainer keeps, in every chunk of ``chunk`` elements of a gradient slice, the
``ceil(fraction * len(chunk))`` entries of largest magnitude (``torch.topk`` on the device,
chunk by chunk so its workspace stays small), and sends their int32 indices and their
values; the engine scatters them into a zeroed dense buffer before its update. Bytes on
the wire: ``k * (4 + itemsize)`` instead of ``n * itemsize``.

This is the one mode that changes the math: the update sees a sparse gradient. With error
feedback the dropped part is added to the next step's gradient instead of being lost.
"""

from __future__ import annotations

import math

import torch

__all__ = ["topk_encode", "topk_decode", "pack", "unpack", "payload_bytes", "kept"]

CHUNK = 1 << 20


def kept(n: int, fraction: float, chunk: int = CHUNK) -> int:
    """How many entries ``topk_encode`` keeps of ``n``."""
    full, rest = divmod(n, chunk)
    return full * math.ceil(fraction * chunk) + (math.ceil(fraction * rest) if rest else 0)


def topk_encode(g: torch.Tensor, fraction: float, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 indices, values) of the largest-magnitude entries of the 1-D ``g``, per chunk."""
    idx, vals = [], []
    for a in range(0, g.numel(), chunk):
        c = g[a : a + chunk]
        k = math.ceil(fraction * c.numel())
        _, i = torch.topk(c.abs(), k, sorted=False)
        idx.append(i.to(torch.int32) + a)
        vals.append(c[i])
    if not idx:
        return torch.empty(0, dtype=torch.int32, device=g.device), torch.empty(0, dtype=g.dtype, device=g.device)
    return torch.cat(idx), torch.cat(vals)


def topk_decode(idx: torch.Tensor, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The dense gradient: ``vals`` at ``idx``, zero elsewhere (in ``out``)."""
    out.zero_()
    out[idx.long()] = vals.to(out.dtype)
    return out


def payload_bytes(k: int, dtype: torch.dtype) -> int:
    return k * (4 + dtype.itemsize)


def pack(idx: torch.Tensor, vals: torch.Tensor, dst: torch.Tensor) -> int:
    """Write indices then values into the uint8 buffer ``dst``; return the bytes used."""
    k = idx.numel()
    n_idx = 4 * k
    dst[:n_idx].copy_(idx.cpu().view(torch.uint8))
    dst[n_idx : n_idx + k * vals.element_size()].copy_(vals.cpu().contiguous().view(torch.uint8))
    return n_idx + k * vals.element_size()


def unpack(src: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the indices and values that ``pack`` wrote into ``src``."""
    idx = src[: 4 * k].view(torch.int32)
    vals = src[4 * k : 4 * k + k * dtype.itemsize].view(dtype)
    return idx, vals
