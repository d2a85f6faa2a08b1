"""Decoder layers cut into sub-layer units, so that the fixed pools follow the budget, not the
block: a Llama-3-70B layer is 0.86 B parameters (3.4 GB in fp32), its MLP alone 0.70 B, and
every slot, gradient buffer and working unit is sized by the largest unit.

A layer is cut *between whole modules*, in the order its forward runs them, never inside a
matrix (a row range's input gradient is a sum over pieces: another order of additions):

- ``2`` pieces: ``[input norm, attention, residual]`` | ``[post-attention norm, MLP, residual]``;
- ``3``: attention | ``[post-attention norm, gate, up, act(gate) * up]`` | ``[down, residual]``;
- ``4``: attention | ``[post-attention norm, gate]`` | ``[up, act(gate) * up]`` | ``[down, residual]``.

A mixture-of-experts layer of that form (Qwen3-MoE's) cuts into 2: attention | the MoE block
whole (its router's logits go to the auxiliary loss under the layer's number, ``routers.py``).

Each piece maps one tensor to one tensor, as a whole block does: where the MLP is cut, what
one piece hands the next is its inputs and outputs concatenated on the last dimension (the
residual ``h``; the normed ``x`` and the gate's ``g``; the intermediate ``a``), which the next
piece slices. Concatenating and slicing copy values, and every tensor is used by the same
operations as in the whole layer, so the gradients are summed in the same order: a cut model
computes the whole one's losses and gradients bit for bit (``tests/test_sublayers.py``).

Cut only layers whose ``forward`` is, in the installed transformers, the Llama decoder
layer's (pre-norm: Llama, Mistral, Qwen2, Qwen3 and others; checked on the source, with the
MLP's for 3 and 4 pieces). Names: a piece's parameters keep the whole layer's names
(``blocks.3.layer.mlp.up_proj.weight``), so a cut model reads and writes the same files.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, cast

import torch
import torch.nn as nn

from .base import LayeredModel, no_cache
from .decoder import DecoderBlock
from .experts_cut import ExpertRange, expert_ranges, is_moe_layer, moe_problem
from .masks import cache_keyword

__all__ = ["PARTS", "cut_problem", "cut_layers", "cut_options", "describe_cut", "SubLayer"]

# what each cut makes of a layer, in forward order
PARTS: dict[int, tuple[str, ...]] = {
    2: ("attention", "mlp"),
    3: ("attention", "gate_up", "down"),
    4: ("attention", "gate", "up", "down"),
}


def _source(fn: Any) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def cut_problem(model: LayeredModel, parts: int, dtype: torch.dtype | None = None) -> str:
    """Why ``model``'s layers cannot be cut into ``parts`` pieces exactly ('' where they can).
    A dense layer cuts into 2, 3 or 4 (``PARTS``); a mixture-of-experts layer into attention |
    its MoE block whole (2), or attention and ``parts - 1`` ranges of its experts
    (``experts_cut.py``; in the compute ``dtype``, None: any); the dense layers of such a model into 2."""
    if parts < 2:
        return f"{parts} pieces (a layer cuts into at least 2)"
    if not model.blocks or not all(isinstance(b, DecoderBlock) for b in model.blocks):
        return f"its layers are not transformers decoder layers (model kind {model.kind!r})"
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    # Mixtral's layer computes Llama's: the same modules in the same order (its attention takes
    # no use_cache); checked by tests/test_experts_cut.py
    layers_ref = {_source(LlamaDecoderLayer.forward), _source(MixtralDecoderLayer.forward)} - {None}
    mlp_ref = _source(LlamaMLP.forward)
    moe = any(is_moe_layer(cast(DecoderBlock, b).layer) for b in model.blocks)
    for b in model.blocks:
        layer = cast(DecoderBlock, b).layer
        name = type(layer).__name__
        if getattr(layer, "mlp", None) is None:
            return f"{name} has no mlp"
        if _source(type(layer).forward) not in layers_ref:
            return f"{name}'s forward is not the pre-norm Llama layer's (attention, then MLP, each with its norm)"
        if is_moe_layer(layer):
            count = getattr(layer.mlp.experts, "num_experts", 0)
            if parts > 2 and (moe_problem(layer, dtype) or parts - 1 > count):
                return moe_problem(layer, dtype) or f"{parts - 1} ranges of experts, more than its {count} experts"
            continue
        if moe:
            continue  # a dense layer of a mixture of experts: cut into 2
        if parts > 4:
            return f"{parts} pieces (a dense layer cuts into 2, 3 or 4)"
        mlp = layer.mlp
        if parts > 2 and (
            _source(type(mlp).forward) != mlp_ref
            or not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        ):
            return f"{type(mlp).__name__} is not the Llama MLP (down(act(gate(x)) * up(x))): cut it into 2 pieces"
    return ""


def cut_options(model: LayeredModel, *, ranges: bool = True, dtype: torch.dtype | None = None) -> list[int]:
    """The cuts to try for ``model``'s layers, fewest pieces first, those it cuts into exactly:
    2, 3, 4 for dense layers; for a mixture of experts 2, then (``ranges``) attention and 2, 4,
    8, ... ranges of experts (at last one expert a range)."""
    experts = max((cast(DecoderBlock, b).layer.mlp.experts.num_experts for b in model.blocks if _moe(b)), default=0)
    options = list(PARTS)
    if experts and not ranges:
        options = [2]
    elif experts:
        counts, r = [], 2
        while r < experts:
            counts.append(r)
            r *= 2
        options = [2, *(1 + c for c in (*counts, experts))]
    return [p for p in options if not cut_problem(model, p, dtype)]


def describe_cut(model: LayeredModel, parts: int) -> str:
    """What each layer is cut into, for the plan's note."""
    ranges = [b for b in model.blocks if isinstance(b, ExpertRange)]
    if not ranges:
        return " | ".join(PARTS[min(parts, 4)])
    return f"attention | {parts - 1} ranges of whole experts"


def _moe(b: nn.Module) -> bool:
    return isinstance(b, DecoderBlock) and is_moe_layer(b.layer)


def _shell(**children: nn.Module) -> nn.Module:
    """A container holding ``children`` under their names (the whole layer's paths)."""
    shell = nn.Module()
    for name, child in children.items():
        setattr(shell, name, child)
    return shell


class SubLayer(nn.Module):
    """Piece ``kind`` of decoder layer ``layer_index`` (``PARTS``): ``forward(s, positions) ->
    s'``, where ``s`` is the hidden states or, between the MLP's pieces, the carried tensor.
    ``in_width`` is the last dimension of what it takes (the stash holds its input)."""

    def __init__(self, block: DecoderBlock, layer_index: int, kind: str, hidden: int, ff: int) -> None:
        super().__init__()
        layer = block.layer
        self.kind, self.layer_index, self.attn_kind = kind, layer_index, block.kind
        self.attends = kind == "attention"  # holds the layer's attention (and, generating, its key/value cache)
        self._d, self._ff = hidden, ff
        object.__setattr__(self, "_block", block)  # masks and rotary tables: not part of this unit
        object.__setattr__(self, "whole", layer)  # the whole layer (its parameters' order), not this unit's
        mlp = layer.mlp
        if kind == "attention":
            self.layer = _shell(input_layernorm=layer.input_layernorm, self_attn=layer.self_attn)
        elif kind == "mlp":
            self.layer = _shell(post_attention_layernorm=layer.post_attention_layernorm, mlp=mlp)
        elif kind == "gate_up":
            proj = _shell(gate_proj=mlp.gate_proj, up_proj=mlp.up_proj)
            self.layer = _shell(post_attention_layernorm=layer.post_attention_layernorm, mlp=proj)
        elif kind == "gate":
            self.layer = _shell(
                post_attention_layernorm=layer.post_attention_layernorm, mlp=_shell(gate_proj=mlp.gate_proj)
            )
        elif kind == "up":
            self.layer = _shell(mlp=_shell(up_proj=mlp.up_proj))
        elif kind == "down":
            self.layer = _shell(mlp=_shell(down_proj=mlp.down_proj))
        else:
            raise ValueError(f"no sub-layer piece {kind!r}")
        if kind in ("gate_up", "up"):
            object.__setattr__(self, "_act", mlp.act_fn)
        d, f = hidden, ff
        self.in_width = {"attention": d, "mlp": d, "gate_up": d, "gate": d, "up": 2 * d + f, "down": d + f}[kind]

    def forward(self, s: torch.Tensor, positions: torch.Tensor | None = None, cache: Any = None) -> torch.Tensor:
        no_cache(cache)
        if self.kind == "attention":
            pos, mask, rope = self._block.context(s, positions)
            return self._attention(s, mask, pos, rope, None)
        return self._mlp(s)

    def _attention(self, h: torch.Tensor, mask, pos, rope, cache) -> torch.Tensor:
        """The layer's forward up to its first residual, with its arguments to attention."""
        layer = self.layer
        residual = h
        h = layer.input_layernorm(h)
        h, _ = layer.self_attn(
            hidden_states=h,
            attention_mask=mask,
            position_ids=pos,
            use_cache=cache is not None,
            position_embeddings=rope,
            **{cache_keyword(): cache},
        )
        return residual + h

    def _mlp(self, s: torch.Tensor) -> torch.Tensor:
        layer, d = self.layer, self._d
        if self.kind == "mlp":
            residual = s
            return residual + layer.mlp(layer.post_attention_layernorm(s))
        if self.kind == "gate_up":  # the MLP's order: gate, act, up, product
            x = layer.post_attention_layernorm(s)
            a = self._act(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)
            return torch.cat([s, a], dim=-1)
        if self.kind == "gate":
            x = layer.post_attention_layernorm(s)
            return torch.cat([s, x, layer.mlp.gate_proj(x)], dim=-1)
        if self.kind == "up":
            h, x, g = s[..., :d], s[..., d : 2 * d], s[..., 2 * d :]
            return torch.cat([h, self._act(g) * layer.mlp.up_proj(x)], dim=-1)
        h, a = s[..., :d], s[..., d:]  # down: the layer's last residual
        return h + layer.mlp.down_proj(a)

    def decode(self, s: torch.Tensor, masks: dict[str, Any], position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Generation: the attention piece with the layer's key/value cache, the others as in training."""
        if self.kind != "attention":
            return self._mlp(s)
        return self._attention(s, masks[self.attn_kind], position_ids, self._block.rope(s, position_ids), cache)


def _widths(model: LayeredModel) -> tuple[int, int]:
    cfg = model.hf_config
    return cfg.hidden_size, getattr(cfg, "intermediate_size", 0) or 0


def cut_layers(model: LayeredModel, parts: int) -> None:
    """Replace ``model``'s blocks by their pieces (``cut_problem`` first)."""
    d, f = _widths(model)
    moe = any(_moe(b) for b in model.blocks)
    pieces: list[nn.Module] = []
    for i, b in enumerate(model.blocks):
        block = cast(DecoderBlock, b)
        if is_moe_layer(block.layer) and parts > 2:
            ranges = expert_ranges(block.layer.mlp.experts.num_experts, parts - 1)
            pieces.append(SubLayer(block, i, "attention", d, f))
            pieces += [ExpertRange(block, i, k, len(ranges), lo, hi, model) for k, (lo, hi) in enumerate(ranges)]
        else:
            pieces += [SubLayer(block, i, k, d, f) for k in PARTS[2 if moe else parts]]
    model.blocks = nn.ModuleList(pieces)
    model.block_layers = [cast(Any, p).layer_index for p in pieces]
    model.block_widths = [cast(Any, p).in_width for p in pieces]
    model.layer_parts = parts
