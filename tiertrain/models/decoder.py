"""transformers decoder-only causal LMs cut into units: the families of ``families.py``.

The units wrap the model's own modules and call them exactly as the model's forward does:
the embedding module (and what the family does to its output), each decoder layer whole with
the mask of its own attention type (full or sliding window) and the rotary table of its type,
the final norm and ``lm_head`` (and what the family does to the logits), and the model's own
loss function. So a layered run computes what ``model(input_ids, labels=..., shift_labels=
targets)`` computes, bit for bit.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from .base import LayeredModel, no_cache
from .families import Family, family_of
from .masks import CHUNKED, FULL, SLIDING, cache_keyword, causal_mask
from .positions import hf_positions, packed_positions
from .routers import router_loss

__all__ = ["DecoderEmbed", "DecoderBlock", "CausalLMHead", "layer_decoder", "layer_types", "layout_problem"]


def layer_types(config: Any) -> list[str]:
    """Each layer's attention type, as the model's forward picks its mask: ``config.layer_types``
    where the config has them (Qwen2, Qwen3, Gemma 2 and 3), else every layer sliding where
    ``config.sliding_window`` is set in a family whose forward goes by it (Mistral, Phi-3:
    ``Family.window_slides``; a Llama config carrying the key from a conversion attends in full,
    as its forward does), else every layer full."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types[:n])
    family = family_of(config)
    slides = getattr(config, "sliding_window", None) is not None and (family is None or family.window_slides)
    return [SLIDING if slides else FULL] * n


class DecoderEmbed(nn.Module):
    """The token embedding, then the family's embedding quirks: a scale its embedding module
    applies (Gemma; applied here only when the vocabulary is cut into pieces, which replace
    that module), a multiplier (Granite), a dropout (Phi's module, Starcoder 2's function). All
    affine in the token embeddings."""

    TOKENS = "embed_tokens"

    def __init__(self, hf: Any, family: Family) -> None:
        super().__init__()
        self.embed_tokens = hf.model.embed_tokens
        self.drop = getattr(hf.model, family.embed_dropout) if family.embed_dropout else None
        self._drop_p = getattr(hf.config, family.embed_dropout_p) if family.embed_dropout_p else None
        object.__setattr__(self, "_scale", getattr(self.embed_tokens, "embed_scale", None))
        self._multiplier = getattr(hf.config, family.embed_multiplier) if family.embed_multiplier else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.finish(self.embed_tokens(input_ids), positions)

    def finish(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self._scale is not None and not hasattr(self.embed_tokens, "embed_scale"):  # pieces: not scaled yet
            tokens = tokens * self._scale.to(tokens.dtype)
        if self._multiplier is not None:
            tokens = tokens * self._multiplier
        if self._drop_p is not None:  # a functional dropout in the model's forward (Starcoder 2)
            tokens = nn.functional.dropout(tokens, p=self._drop_p, training=self.training)
        return self.drop(tokens) if self.drop is not None else tokens

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Generation: ``[B, T]`` ids at per-row ``position_ids`` (``[B, T]``)."""
        return self.finish(self.embed_tokens(input_ids))


class DecoderBlock(nn.Module):
    """Decoder layer ``index``, called whole with the mask of its attention type and its rotary
    table (per type where the model's rotary embedding takes one: Gemma 3)."""

    def __init__(self, hf: Any, index: int, kind: str = FULL) -> None:
        super().__init__()
        self.layer = hf.model.layers[index]
        self.kind = kind
        # Shared, parameter-free (its inv_freq is a buffer): kept out of the module tree so
        # it is not counted as part of any unit.
        rotary = hf.model.rotary_emb
        object.__setattr__(self, "_rotary", rotary)
        object.__setattr__(self, "_config", hf.config)
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self._rope_kw = {"layer_type": kind} if takes_type else {}

    def rope(self, h: torch.Tensor, position_ids: torch.Tensor):
        """The rotary table of this layer's type at ``position_ids``."""
        return self._rotary(h, position_ids=position_ids, **self._rope_kw)

    def context(self, h: torch.Tensor, positions: torch.Tensor | None):
        """(position ids, mask, rotary table) of the layer's forward on ``h``, as the model makes them."""
        pos = hf_positions(h, positions)
        return pos, causal_mask(self._config, h, packed_positions(positions), self.kind), self.rope(h, pos)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        no_cache(cache)
        pos, mask, rope = self.context(h, positions)
        return self.layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)

    def decode(self, h: torch.Tensor, masks, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """Generation: the new positions ``h`` attend to themselves and to ``cache`` (updated
        with their keys and values); ``masks`` by attention type (``masks.decode_masks``)."""
        return self.layer(
            h,
            attention_mask=masks[self.kind],
            position_ids=position_ids,
            position_embeddings=self.rope(h, position_ids),
            use_cache=True,
            **{cache_keyword(): cache},
        )


class CausalLMHead(nn.Module):
    """Final norm, output projection, the family's logit quirks (``cap_logits``) and the
    model's own causal-LM loss."""

    PROJ = "lm_head"

    def __init__(self, hf: Any, norm: nn.Module, family: Family | None = None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = hf.lm_head
        object.__setattr__(self, "_loss", hf.loss_function)
        self.vocab_size = (
            hf.lm_head.out_features
        )  # the logits' (Apertus 1.5's output_vocab_size: fewer than the input's)
        config, f = hf.config, family or Family("")
        self._divisor = getattr(config, f.logits_divisor) if f.logits_divisor else None
        self._logit_scale = getattr(config, f.logits_multiplier) if f.logits_multiplier else None
        self._hidden_divisor = getattr(config, f.hidden_divisor) if f.hidden_divisor else None
        self._cap = getattr(config, f.logit_softcap, None) if f.logit_softcap else None

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm's output, as the output projection takes it (MiniCPM3 divides it first)."""
        h = self.norm(h)
        return h / self._hidden_divisor if self._hidden_divisor is not None else h

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the family's forward does to the output projection's logits: multiplied by
        ``logit_scale`` (Cohere), divided by ``logits_scaling`` (Granite), soft-capped ``tanh(x /
        c) * c`` (Gemma 2 and 3), in the model's order of operations."""
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._divisor is not None:
            logits = logits / self._divisor
        if self._cap is not None:
            logits = logits / self._cap
            logits = torch.tanh(logits)
            logits = logits * self._cap
        return logits

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(self.lm_head(self.hidden(h)))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, divisor: int | None = None) -> torch.Tensor:
        """transformers' loss: the mean over the targets, or with ``divisor`` their sum over it
        (its ``num_items_in_batch``)."""
        return self._loss(
            logits=logits, labels=targets, vocab_size=self.vocab_size, shift_labels=targets, num_items_in_batch=divisor
        )

    def forward(self, h: torch.Tensor, targets: torch.Tensor, divisor: int | None = None) -> torch.Tensor:
        return self.loss(self.logits(h), targets, divisor)


_TOP = ("embed_tokens", "layers", "rotary_emb")


def layout_problem(hf: Any) -> str:
    """What of a transformers causal LM of a supported family is not the layout the units wrap
    ('' where it is): ``model.embed_tokens``, ``model.layers``, ``model.rotary_emb``, the
    family's final norm, ``lm_head``."""
    family = family_of(hf.config)
    if family is None:
        return "not a family tiertrain runs"
    inner = getattr(hf, "model", None)
    for name in (*_TOP, family.final_norm):
        if not hasattr(inner, name):
            return f"no model.{name}"
    if not hasattr(hf, "lm_head"):
        return "no lm_head"
    unknown = sorted(set(layer_types(hf.config)) - {FULL, SLIDING, CHUNKED})
    if unknown:
        return f"attention types {', '.join(unknown)} (tiertrain runs full, sliding-window and chunked attention)"
    return ""


def layer_decoder(hf: Any) -> LayeredModel:
    """Units of a decoder-only causal LM of one of ``families.FAMILIES``."""
    family = family_of(hf.config)
    assert family is not None, "layout_problem first"
    kinds = layer_types(hf.config)
    blocks = [DecoderBlock(hf, i, kinds[i]) for i in range(hf.config.num_hidden_layers)]
    head = CausalLMHead(hf, getattr(hf.model, family.final_norm), family)
    model = LayeredModel(DecoderEmbed(hf, family), blocks, head, kind="llama")
    model.routers = router_loss(hf, [b.layer for b in blocks])
    return model
