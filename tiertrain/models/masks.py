"""Attention masks of transformers models, made by transformers' own functions, per attention
type: ``full_attention`` (causal), ``sliding_attention`` (causal within the config's
``sliding_window``) and ``chunked_attention`` (causal within chunks of ``attention_chunk_size``:
Llama 4), as the model's forward makes them for each of its layers.

The causal masks are made without position ids where every row is one sequence (``[T]``
positions): given them, transformers looks for packed sequences in them, a device-to-host sync
per block and micro-batch. Packed rows with attention kept within each document come with
``[B, T]`` positions that restart at each document: those are passed, and transformers makes
the block-diagonal mask from them, once per micro-batch and type (cached here).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable

import torch

__all__ = ["FULL", "SLIDING", "CHUNKED", "cache_keyword", "causal_mask", "decode_masks", "new_cache"]

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


@functools.cache
def _makers() -> tuple[dict[str, Callable[..., Any]], str]:
    """transformers' mask functions by attention type, and their key/value cache keyword.
    Imported on first use: transformers takes seconds to import, and the built-in models never
    need it (every process of a run, engines and ranks included, would pay them).

    transformers renamed the keyword ``past_key_values`` to ``cache`` (5.x; the old name warns):
    whichever this version takes."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_chunked_causal_mask,
        create_sliding_window_causal_mask,
    )

    keyword = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    makers = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask, CHUNKED: create_chunked_causal_mask}
    return makers, keyword


def cache_keyword() -> str:
    """The keyword transformers' layers and masks take the key/value cache by (``cache`` in 5.x)."""
    return _makers()[1]


def _mask(config: Any, h: torch.Tensor, attention_mask, position_ids, cache=None, kind: str = FULL):
    makers, keyword = _makers()
    if kind not in makers:
        raise ValueError(f"attention type {kind!r}: tiertrain makes masks for {', '.join(makers)} only")
    return makers[kind](
        config=config, inputs_embeds=h, attention_mask=attention_mask, position_ids=position_ids, **{keyword: cache}
    )


# (id(packed positions), kind) -> (a weak reference to them, config, shape, dtype, device, mask):
# a micro-batch's block-diagonal mask, dropped when its positions tensor (the step's) goes
_packed_masks: dict[tuple[int, str], tuple] = {}


def causal_mask(config: Any, h: torch.Tensor, packed: torch.Tensor | None = None, kind: str = FULL):
    """The mask of attention type ``kind`` for ``h``; with ``packed`` (positions restarting at
    each document) the block-diagonal one, made once per micro-batch (transformers finds the
    documents with a device-to-host sync) and reused by every block, recompute and backward."""
    if packed is None:
        return _mask(config, h, None, None, kind=kind)
    key = (config, h.shape, h.dtype, h.device)
    k = (id(packed), kind)
    hit = _packed_masks.get(k)
    if hit is not None and hit[0]() is packed and hit[1] is config and hit[2:5] == key[1:]:
        return hit[5]
    mask = _mask(config, h, None, packed, kind=kind)

    def forget(_: object, k: tuple[int, str] = k) -> None:
        _packed_masks.pop(k, None)

    _packed_masks[k] = (weakref.ref(packed, forget), *key, mask)
    return mask


def decode_masks(
    config: Any, h: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache, kinds
) -> dict[str, Any]:
    """The masks of a generation step by attention type (``kinds``: those the model's layers
    have): ``attention_mask`` (``[B, past + T]``, 0 at left padding) with causality (and the
    window), for the new positions ``h`` against ``cache`` as it is before the step."""
    return {kind: _mask(config, h, attention_mask, position_ids, cache, kind) for kind in sorted(set(kinds))}


def new_cache(config: Any, max_len: int):
    """A key/value cache for every layer of one micro-batch, of ``max_len`` positions
    (transformers' static cache: its size fixed when made, never grown). A sliding layer keeps
    its window alone (``min(sliding_window, max_len)`` positions, rolled once full), as
    transformers' own sliding layer does; its mask is made from that cache."""
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=max_len)
