"""Generation with the built-in GPT: its key/value cache and attention masks, in the shapes
``generate.py`` and ``kvcache.TieredKV`` use for transformers' static cache.

``GPTCache``: per block, keys and values ``[rows, heads, max_len, head dim]`` claimed by the
tiered cache (host memory or a pool buffer brought in for the block's turn) and a count of the
positions written (``cumulative_length``, kept on the host: it never leaves with the spilled
tensors). ``decode_mask``: the new positions attend to every earlier position a row has (left
padding excluded) and to themselves causally; a padded query with nothing to attend to attends
to itself (its output is never used: no later position attends to it)."""

from __future__ import annotations

import torch

__all__ = ["GPTCache", "decode_mask"]


class _Layer:
    """One block's cache (the attributes ``TieredKV`` sets and reads)."""

    def __init__(self) -> None:
        self.keys = self.values = None
        self.cumulative_length = 0  # positions written (a host int: no device sync to read it)
        self.is_initialized = False


class GPTCache:
    def __init__(self, layers: int) -> None:
        self.layers = [_Layer() for _ in range(layers)]


def decode_mask(attention_mask: torch.Tensor, new: int) -> torch.Tensor:
    """``[B, 1, new, past + new]`` bool: key j visible to new position i where the row has a
    token at j (``attention_mask`` ``[B, past + new]``, 0 at left padding) and j <= past + i."""
    b, total = attention_mask.shape
    past = total - new
    i = torch.arange(new, device=attention_mask.device)[:, None]
    j = torch.arange(total, device=attention_mask.device)[None, :]
    allowed = attention_mask[:, None, :].bool() & (j <= past + i)[None]  # [B, new, total]
    alone = ~allowed.any(-1, keepdim=True)  # a padded query: itself only (no NaN from an empty row)
    allowed = allowed | (alone & (j == past + i)[None])
    return allowed[:, None]
