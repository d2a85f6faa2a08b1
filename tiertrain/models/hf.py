"""Hugging Face ``transformers`` models cut into units: GPT-2 here, the decoder-only families
in ``decoder.py`` (``layer_hf`` picks); the key/value cache's shape and bytes; the units'
seeded initialisation.

The units wrap the model's own modules and call them exactly as the model's forward does
(same masks, same rotary tables, same loss function), so a layered run computes what
``model(input_ids, labels=..., shift_labels=targets)`` computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .base import LayeredModel, no_cache
from .decoder import CausalLMHead, layer_decoder, layer_types, layout_problem
from .families import unsupported_reason
from .masks import FULL, causal_mask, decode_masks, new_cache
from .positions import hf_positions, packed_positions

__all__ = [
    "layer_hf",
    "layer_gpt2",
    "hf_problem",
    "hf_layout_problem",
    "decode_mask",
    "kv_bytes",
    "kv_shape",
    "kv_dims",
    "kv_positions",
    "new_cache",
]


class GPT2Embed(nn.Module):
    TOKENS = "wte"

    def __init__(self, hf: Any) -> None:
        super().__init__()
        t = hf.transformer
        self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.finish(self.wte(input_ids), positions)

    def finish(self, inputs_embeds: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = inputs_embeds + self.wpe(hf_positions(inputs_embeds, positions)).to(inputs_embeds.device)
        return self.drop(h)

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))


class GPT2Block(nn.Module):
    def __init__(self, hf: Any, index: int) -> None:
        super().__init__()
        self.block = hf.transformer.h[index]
        object.__setattr__(self, "_config", hf.config)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        no_cache(cache)
        pos = hf_positions(h, positions)
        mask = causal_mask(self._config, h, packed_positions(positions))
        return self.block(h, None, mask, None, use_cache=False, position_ids=pos)

    def decode(self, h: torch.Tensor, masks, position_ids: torch.Tensor, cache) -> torch.Tensor:
        return self.block(h, cache, masks[FULL], None, use_cache=True, position_ids=position_ids)


def decode_mask(config: Any, h: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache):
    """The masks of a generation step by attention type (each block takes its own's):
    ``attention_mask`` (``[B, past + T]``, 0 at left padding) with causality, for the new
    positions ``h`` against ``cache`` as it is before the step (made before any block adds the
    step's keys)."""
    kinds = [FULL] if config.model_type == "gpt2" else layer_types(config)
    return decode_masks(config, h, attention_mask, position_ids, cache, kinds)


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a model's key/value cache; where keys and values
    differ in width (``kv_dims``), the head dim is the larger: the cache stores both at it."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    if _latent(config):  # one "head": the compressed latent and the rotary key, shared by every query head
        return layers, 1, max(kv_dims(config))
    # (a field the config's class does not declare is not the model's: a GPT-2 config.json holding
    # a stray num_key_value_heads sized the cache for it, and generation failed at its first step)
    kv_heads = (
        getattr(config, "num_key_value_heads", None) if _declares(config, "num_key_value_heads") else None
    ) or heads
    return layers, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def _declares(config: Any, name: str) -> bool:
    """Whether ``config``'s class has the field ``name`` (as a class attribute or an argument of
    its ``__init__``), not merely an instance that config.json gave it."""
    import inspect

    cls = type(config)
    return hasattr(cls, name) or name in inspect.signature(cls.__init__).parameters


def _latent(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek V2/V3): transformers caches the compressed latent
    (as the "keys") and the rotary part of the key (as the "values"), one head each, and expands
    them into every head's keys and values at each step."""
    return getattr(config, "kv_lora_rank", None) is not None and hasattr(config, "v_head_dim")


def kv_dims(config: Any) -> tuple[int, int]:
    """(key width, value width) of one cached head: with multi-head latent attention the
    latent's (``kv_lora_rank``) and the rotary key's (``qk_rope_head_dim``); else both the head dim."""
    if _latent(config):
        return config.kv_lora_rank, config.qk_rope_head_dim
    d = kv_shape(config)[2]
    return d, d


def kv_positions(config: Any, max_len: int) -> list[int]:
    """Positions each layer's cache holds for sequences of ``max_len``: ``max_len``, a sliding
    layer's its window where that is less (transformers' static cache's layers, which keep the
    last ``sliding_window`` positions and roll)."""
    return [min(getattr(layer, "max_cache_len", max_len), max_len) for layer in new_cache(config, max_len).layers]


def kv_bytes(config: Any, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of the key/value cache of ``rows`` sequences of ``max_len`` positions; ``config``:
    a model's config (sliding layers hold their window, ``kv_positions``), or a ``kv_shape``
    (layers, key/value heads, head dim) whose layers each hold ``max_len``."""
    if isinstance(config, tuple):
        layers, kv_heads, head_dim = config
        return 2 * layers * rows * kv_heads * max_len * head_dim * dtype.itemsize
    _, kv_heads, head_dim = kv_shape(config)
    return 2 * rows * kv_heads * sum(kv_positions(config, max_len)) * head_dim * dtype.itemsize


def _hf_init(hf: Any):
    def init(unit_index: int, unit: nn.Module, gen: torch.Generator) -> None:
        # transformers' initialisers draw from the global generator: seed it per unit
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        for module in unit.modules():
            for p in module.parameters(recurse=False):
                p.data.zero_()  # parameters that _init_weights leaves alone start defined
            hf._init_weights(module)

    return init


def _finish(model: LayeredModel, hf: Any) -> LayeredModel:
    model.hf_model, model.hf_config = hf, hf.config
    model.init_unit = _hf_init(hf)
    return model


def hf_problem(config: Any) -> str:
    """Why a transformers model, known by its config, is not one tiertrain runs ('' where it is)."""
    return unsupported_reason(config)


def hf_layout_problem(hf: Any) -> str:
    """What of a built transformers model is not the layout its units wrap ('' where it is)."""
    return "" if hf.config.model_type == "gpt2" else layout_problem(hf)


def layer_hf(hf: Any) -> LayeredModel:
    """Units of a transformers causal LM of a supported family (``hf_problem`` and
    ``hf_layout_problem`` first): GPT-2's or a decoder-only family's."""
    model = layer_gpt2(hf) if hf.config.model_type == "gpt2" else layer_decoder(hf)
    return _finish(model, hf)


def layer_gpt2(hf: Any) -> LayeredModel:
    """Units of a ``GPT2LMHeadModel`` (head tied to the token embedding unless the config unties it)."""
    blocks = [GPT2Block(hf, i) for i in range(hf.config.n_layer)]
    return LayeredModel(GPT2Embed(hf), blocks, CausalLMHead(hf, hf.transformer.ln_f), kind="gpt2")
