"""Hugging Face ``transformers`` models cut into units.

``LlamaForCausalLM`` (which covers Qwen2 and Mistral shapes) and ``GPT2LMHeadModel``.
The units wrap the model's own modules and call them exactly as the model's forward
does (same masks, same rotary tables, same loss function), so a layered run computes
what ``model(input_ids, labels=..., shift_labels=targets)`` computes.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

from .base import LayeredModel, default_positions, no_cache

__all__ = [
    "layer_llama",
    "layer_gpt2",
    "config_problem",
    "layout_problem",
    "decode_mask",
    "kv_bytes",
    "kv_shape",
    "new_cache",
]


# The causal masks are made without position ids where every row is one sequence (``[T]``
# positions): given them, transformers looks for packed sequences in them, a device-to-host
# sync per block and micro-batch. Packed rows with attention kept within each document come
# with ``[B, T]`` positions that restart at each document: those are passed, and transformers
# makes the block-diagonal causal mask from them.


def _positions(h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """``[1, T]`` position ids (HF layout) of the hidden states ``h``, or the ``[B, T]`` ones
    of packed rows."""
    if positions is not None and positions.dim() == 2:
        return positions
    return (default_positions(h) if positions is None else positions).view(1, -1)


def _packed(positions: torch.Tensor | None) -> torch.Tensor | None:
    return positions if positions is not None and positions.dim() == 2 else None


class LlamaEmbed(nn.Module):
    TOKENS = "embed_tokens"

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.embed_tokens = hf.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.finish(self.embed_tokens(input_ids), positions)

    def finish(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return tokens

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Generation: ``[B, T]`` ids at per-row ``position_ids`` (``[B, T]``)."""
        return self.embed_tokens(input_ids)


class LlamaBlock(nn.Module):
    def __init__(self, hf: Any, index: int) -> None:
        super().__init__()
        self.layer = hf.model.layers[index]
        # Shared, parameter-free (its inv_freq is a buffer): kept out of the module tree so
        # it is not counted as part of any unit.
        object.__setattr__(self, "_rotary", hf.model.rotary_emb)
        object.__setattr__(self, "_config", hf.config)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        no_cache(cache)
        pos = _positions(h, positions)
        mask = _causal_mask(self._config, h, _packed(positions))
        rope = self._rotary(h, position_ids=pos)
        return self.layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)

    def decode(self, h: torch.Tensor, mask, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """Generation: the new positions ``h`` attend to themselves and to ``cache`` (updated
        with their keys and values), ``mask`` from ``decode_mask``."""
        rope = self._rotary(h, position_ids=position_ids)
        return self.layer(
            h,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=rope,
            use_cache=True,
            **{_masks()[1]: cache},
        )


class CausalLMHead(nn.Module):
    """Final norm, output projection and the model's own causal-LM loss."""

    PROJ = "lm_head"

    def __init__(self, hf: Any, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = hf.lm_head
        object.__setattr__(self, "_loss", hf.loss_function)
        self.vocab_size = hf.config.vocab_size

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(h))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, divisor: int | None = None) -> torch.Tensor:
        """transformers' loss: the mean over the targets, or with ``divisor`` their sum over it
        (its ``num_items_in_batch``)."""
        return self._loss(
            logits=logits, labels=targets, vocab_size=self.vocab_size, shift_labels=targets, num_items_in_batch=divisor
        )

    def forward(self, h: torch.Tensor, targets: torch.Tensor, divisor: int | None = None) -> torch.Tensor:
        return self.loss(self.logits(h), targets, divisor)


class GPT2Embed(nn.Module):
    TOKENS = "wte"

    def __init__(self, hf: Any) -> None:
        super().__init__()
        t = hf.transformer
        self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.finish(self.wte(input_ids), positions)

    def finish(self, inputs_embeds: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = inputs_embeds + self.wpe(_positions(inputs_embeds, positions)).to(inputs_embeds.device)
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
        pos = _positions(h, positions)
        mask = _causal_mask(self._config, h, _packed(positions))
        return self.block(h, None, mask, None, use_cache=False, position_ids=pos)

    def decode(self, h: torch.Tensor, mask, position_ids: torch.Tensor, cache) -> torch.Tensor:
        return self.block(h, cache, mask, None, use_cache=True, position_ids=position_ids)


@functools.cache
def _masks() -> tuple[Callable[..., Any], str]:
    """transformers' ``create_causal_mask`` and its key/value cache keyword. Imported on first
    use: transformers takes seconds to import, and the built-in models never need it (every
    process of a run, engines and ranks included, would pay them).

    transformers renamed the keyword ``past_key_values`` to ``cache`` (5.x; the old name warns):
    whichever this version takes."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask, "cache" if "cache" in inspect.signature(
        create_causal_mask
    ).parameters else "past_key_values"


def _mask(
    config: Any, h: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, cache=None
):
    create_causal_mask, keyword = _masks()
    return create_causal_mask(
        config=config, inputs_embeds=h, attention_mask=attention_mask, position_ids=position_ids, **{keyword: cache}
    )


# id(packed positions) -> (a weak reference to them, config, shape, dtype, device, mask): a
# micro-batch's block-diagonal mask, dropped when its positions tensor (the step's) goes
_packed_masks: dict[int, tuple] = {}


def _causal_mask(config: Any, h: torch.Tensor, packed: torch.Tensor | None = None):
    """The causal mask of ``h``; with ``packed`` (positions restarting at each document) the
    block-diagonal one, made once per micro-batch (transformers finds the documents with a
    device-to-host sync) and reused by every block, recompute and backward of it."""
    if packed is None:
        return _mask(config, h, None, None)
    key = (config, h.shape, h.dtype, h.device)
    hit = _packed_masks.get(id(packed))
    if hit is not None and hit[0]() is packed and hit[1] is config and hit[2:5] == key[1:]:
        return hit[5]
    mask = _mask(config, h, None, packed)
    k = id(packed)

    def forget(_: object, k: int = k) -> None:
        _packed_masks.pop(k, None)

    _packed_masks[k] = (weakref.ref(packed, forget), *key, mask)
    return mask


def decode_mask(config: Any, h: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache):
    """The attention mask of a generation step: ``attention_mask`` (``[B, past + T]``, 0 at
    left padding) with causality, for the new positions ``h`` against ``cache`` as it is
    before the step (made before any block adds the step's keys)."""
    return _mask(config, h, attention_mask, position_ids, cache)


def new_cache(config: Any, max_len: int):
    """A key/value cache for every layer of one micro-batch, of ``max_len`` positions
    (transformers' static cache: its size fixed when made, never grown)."""
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=max_len)


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a model's key/value cache."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return layers, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def kv_bytes(config: Any, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of the key/value cache of ``rows`` sequences of ``max_len`` positions; ``config``:
    a model's config, or its ``kv_shape`` (layers, key/value heads, head dim) itself."""
    layers, kv_heads, head_dim = config if isinstance(config, tuple) else kv_shape(config)
    return 2 * layers * rows * kv_heads * max_len * head_dim * dtype.itemsize


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


# The Llama layout the units wrap: the model's embedding, decoder layers called whole, final norm
# and head, the layers with Llama's attention and MLP modules (Mistral and Qwen2 have it too)
_LLAMA_MODULES = (
    ("model", "embed_tokens"),
    ("model", "layers"),
    ("model", "norm"),
    ("model", "rotary_emb"),
    ("", "lm_head"),
)
_LLAMA_LAYER = (
    ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("mlp", ("gate_proj", "up_proj", "down_proj")),
    ("", ("input_layernorm", "post_attention_layernorm")),
)
# Families with that layout whose own forward computes outside those modules (the units would
# leave it out, silently): Gemma 2 and 3 soft-cap the logits (and take per-layer-type masks and
# rotary tables), Granite multiplies embeddings, residuals and logits. (Gemma scales its
# embeddings within its embedding module, which the units call: it is computed exactly.)
_LLAMA_LOOKALIKES = {"gemma2", "gemma3", "gemma3_text", "granite"}


def config_problem(config: Any) -> str:
    """What of a model known by its config alone is not what the units compute ('' where
    nothing is): checked before the model is built (transformers refuses to build Gemma 2 with
    the attention the units use, a traceback)."""
    if getattr(config, "model_type", "") in _LLAMA_LOOKALIKES:
        return "its forward scales the embeddings or the logits outside the layers, which the units do not"
    return ""


def layout_problem(hf: Any) -> str:
    """What of a transformers causal LM is not the layout tiertrain cuts into units ('' where it
    is): Llama's (``_LLAMA_MODULES``, ``_LLAMA_LAYER``) or GPT-2's. Checked when the model is
    built: another family failed later, as an AttributeError (Phi: no ``model.norm``)."""
    if getattr(hf.config, "model_type", "") == "gpt2":
        return ""
    if config_problem(hf.config):
        return config_problem(hf.config)
    for owner, name in _LLAMA_MODULES:
        if not hasattr(getattr(hf, owner) if owner else hf, name):
            return f"no {owner + '.' if owner else ''}{name}"
    for i, layer in enumerate(hf.model.layers):
        for part, names in _LLAMA_LAYER:
            module = getattr(layer, part, None) if part else layer
            missing = [n for n in names if not hasattr(module, n)]
            if missing:
                return f"layer {i}{'.' + part if part else ''} has no {', '.join(missing)}"
    return ""


def layer_llama(hf: Any) -> LayeredModel:
    """Units of a ``LlamaForCausalLM`` (or a model with its layout)."""
    blocks = [LlamaBlock(hf, i) for i in range(hf.config.num_hidden_layers)]
    model = LayeredModel(LlamaEmbed(hf), blocks, CausalLMHead(hf, hf.model.norm), kind="llama")
    return _finish(model, hf)


def layer_gpt2(hf: Any) -> LayeredModel:
    """Units of a ``GPT2LMHeadModel`` (head tied to the token embedding unless the config unties it)."""
    blocks = [GPT2Block(hf, i) for i in range(hf.config.n_layer)]
    model = LayeredModel(GPT2Embed(hf), blocks, CausalLMHead(hf, hf.transformer.ln_f), kind="gpt2")
    return _finish(model, hf)
