"""Decoder layers cut into sub-layer units, so that the fixed pools follow the budget, not the
block: a Llama-3-70B layer is 0.86 B parameters (3.4 GB in fp32), its MLP alone 0.70 B, and
every slot, gradient buffer and working unit is sized by the largest unit.

A layer is cut *between whole modules*, in the order its forward runs them, never inside a
matrix (a row range's input gradient is a sum over pieces: another order of additions):

- ``2`` pieces: ``[input norm, attention, residual]`` | ``[post-attention norm, MLP, residual]``
  (each branch with the norms and residual add its layer has);
- ``3``: attention | ``[post-attention norm, the MLP up to down_proj]`` | ``[down, residual]``
  (any MLP whose forward ends in ``self.down_proj(...)``: gated, fused, two matrices; its own
  forward run and stopped at that call, ``layouts.before_down``);
- ``4``: attention | ``[post-attention norm, gate]`` | ``[up, act(gate) * up]`` | ``[down, residual]``.

A mixture-of-experts layer of that form (Qwen3-MoE's) cuts into 2: attention | the MoE block
whole (its router's logits go to the auxiliary loss under the layer's number, ``routers.py``).

Each piece maps one tensor to one tensor, as a whole block does: where the MLP is cut, what
one piece hands the next is its inputs and outputs concatenated on the last dimension (the
residual ``h``; the normed ``x`` and the gate's ``g``; the intermediate ``a``), which the next
piece slices. Concatenating and slicing copy values, and every tensor is used by the same
operations as in the whole layer, so the gradients are summed in the same order: a cut model
computes the whole one's losses and gradients bit for bit (``tests/test_sublayers.py``).

Cut only layers whose ``forward`` is two residual branches, attention then MLP, as read from
the installed transformers' source (``layouts.py``: pre-norm Llama and its copies, post-norm
OLMo 2, Gemma 2 and 3's four norms, residual dropouts and multipliers); into 3 and 4 only where
the MLP is Llama's (checked on its source) behind a norm of its own. Names: a piece's parameters keep the whole layer's names
(``blocks.3.layer.mlp.up_proj.weight``), so a cut model reads and writes the same files.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.nn as nn

from .base import LayeredModel, no_cache
from .decoder import DecoderBlock
from .experts_cut import ExpertRange, expert_ranges, is_moe_layer, moe_block, moe_problem, num_experts
from .experts_dense import DenseExpertRange, dense_form
from .experts_list import ListExpertRange
from .layouts import (
    Layout,
    attention_keywords,
    before_down,
    down_last_problem,
    finish,
    layout_of,
    parallel_attention,
    parallel_mlp,
    run_branch,
    source_of,
)

__all__ = ["PARTS", "cut_problem", "cut_layers", "cut_options", "describe_cut", "SubLayer"]

# what each cut makes of a layer, in forward order
PARTS: dict[int, tuple[str, ...]] = {
    2: ("attention", "mlp"),
    3: ("attention", "gate_up", "down"),
    4: ("attention", "gate", "up", "down"),
}


def cut_problem(model: LayeredModel, parts: int, dtype: torch.dtype | None = None) -> str:
    """Why ``model``'s layers cannot be cut into ``parts`` pieces exactly ('' where they can).
    A dense layer cuts into 2, 3 or 4 (``PARTS``); a mixture-of-experts layer into attention |
    its MoE block whole (2), or attention and ``parts - 1`` ranges of its experts
    (``experts_cut.py``; in the compute ``dtype``, None: any); the dense layers of such a model into 2."""
    if parts < 2:
        return f"{parts} pieces (a layer cuts into at least 2)"
    if not model.blocks or not all(isinstance(b, DecoderBlock) for b in model.blocks):
        return f"its layers are not transformers decoder layers (model kind {model.kind!r})"
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp_ref = source_of(LlamaMLP.forward)
    moe = any(is_moe_layer(cast(DecoderBlock, b).layer) for b in model.blocks)
    for b in model.blocks:
        layer = cast(DecoderBlock, b).layer
        name = type(layer).__name__
        layout = layout_of(layer)
        if isinstance(layout, str):
            return f"{name}: {layout}"
        branch = layout.mlp
        if is_moe_layer(layer):
            count = num_experts(layer)
            if parts > 2:
                problem = moe_problem(layer, dtype) or _plain_mlp_branch(name, branch, moe_block(layer))
                if problem or parts - 1 > count:
                    return problem or f"{parts - 1} ranges of experts, more than its {count} experts"
            continue
        if moe:
            continue  # a dense layer of a mixture of experts: cut into 2
        if parts > 4:
            return f"{parts} pieces (a dense layer cuts into 2, 3 or 4)"
        if parts == 2:
            continue
        if layout.parallel:
            return f"{name} runs attention and MLP side by side: cut it into 2 pieces"
        mlp = getattr(layer, branch.module)
        if hasattr(mlp, "experts") or "moe" in type(mlp).__name__.lower():
            return f"{type(mlp).__name__} is a mixture of experts whose experts are not cut into ranges: cut it into 2 pieces"
        last = down_last_problem(type(mlp)) if branch.module == "mlp" and branch.outputs == 1 else "not the mlp"
        if last:  # 3: attention | the MLP up to down_proj | down_proj
            return f"{type(mlp).__name__}'s forward does not end in its down_proj ({last}): cut it into 2 pieces"
        if parts == 4 and (
            source_of(type(mlp).forward) != mlp_ref
            or not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        ):
            return f"{type(mlp).__name__} is not the Llama MLP (down(act(gate(x)) * up(x))): cut it into 2 or 3 pieces"
        if branch.pre is None:
            # its input is the residual itself, used three times (residual, gate, up): pieces would
            # sum those gradients in another order than autograd does in the whole layer
            return f"{name}'s MLP takes the residual stream with no norm before it: cut it into 2 pieces"
    return ""


def _plain_mlp_branch(name: str, branch: Any, block: str | None) -> str:
    """Why a MoE layer's MLP branch is not the form expert ranges replay ('' where it is): the
    MoE ``block`` after its norm or none (its first output the states: gpt-oss's returns its scores too;
    post-norm and residual add, or times a multiplier: any)."""
    if branch.module != block:
        return (
            f"{name}'s MoE branch is not a norm, then the block as mlp (what expert ranges replay): "
            "cut it into 2 (model.layer_pieces = 2)"
        )
    return ""


def cut_options(model: LayeredModel, *, ranges: bool = True, dtype: torch.dtype | None = None) -> list[int]:
    """The cuts to try for ``model``'s layers, fewest pieces first, those it cuts into exactly:
    2, 3, 4 for dense layers; for a mixture of experts 2, then (``ranges``) attention and 2, 4,
    8, ... ranges of experts (at last one expert a range)."""
    experts = max((num_experts(cast(DecoderBlock, b).layer) for b in model.blocks if _moe(b)), default=0)
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
    ranges = [b for b in model.blocks if isinstance(b, (ExpertRange, DenseExpertRange, ListExpertRange))]
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
    ``in_width`` is the last dimension of what it takes (the stash holds its input). The
    layer's ``layout`` (``layouts.py``) names its norms, modules and residual adds."""

    def __init__(self, block: DecoderBlock, layer_index: int, kind: str, hidden: int, ff: int) -> None:
        super().__init__()
        layer = block.layer
        layout = layout_of(layer)
        assert isinstance(layout, Layout), "cut_problem first"
        self.kind, self.layer_index, self.attn_kind = kind, layer_index, block.kind
        self.attends = kind == "attention"  # holds the layer's attention (and, generating, its key/value cache)
        self._d, self._layout = hidden, layout
        object.__setattr__(self, "_block", block)  # masks and rotary tables: not part of this unit
        object.__setattr__(self, "whole", layer)  # the whole layer (its parameters' order), not this unit's
        branch = layout.mlp
        own = {m: getattr(layer, m) for m in branch.modules}
        if kind == "attention":
            self.layer = _shell(**{m: getattr(layer, m) for m in layout.attention.modules})
        elif kind == "mlp":
            self.layer = _shell(**own)
        else:  # the Llama MLP's modules, after its pre-norm (gate_up, gate) or before its post-norm (down)
            mlp, pre = layer.mlp, own.get(branch.pre or "")
            names = {
                # everything of the MLP but down_proj (gate and up; a fused gate_up_proj; up alone)
                "gate_up": tuple(n for n, _ in mlp.named_children() if n != "down_proj"),
                "gate": ("gate_proj",),
                "up": ("up_proj",),
                "down": ("down_proj",),
            }
            if kind not in names:
                raise ValueError(f"no sub-layer piece {kind!r}")
            around = {branch.pre: pre} if kind in ("gate_up", "gate") else {}
            if kind == "down":
                around = {m: own[m] for m in (branch.post, branch.dropout) if m}
            self.layer = _shell(**around, mlp=_shell(**{n: getattr(mlp, n) for n in names[kind]}))
        if kind == "up":
            object.__setattr__(self, "_act", layer.mlp.act_fn)
        # what down_proj takes (the intermediate width; Phi-3's fused MLP: half its first matrix's)
        d, f = hidden, getattr(getattr(getattr(layer, "mlp", None), "down_proj", None), "in_features", ff)
        mlp_in = 3 * d if layout.parallel else d  # side by side: the residual, the normed input, attention's output
        self.in_width = {"attention": d, "mlp": mlp_in, "gate_up": d, "gate": d, "up": 2 * d + f, "down": d + f}[kind]

    def forward(self, s: torch.Tensor, positions: torch.Tensor | None = None, cache: Any = None) -> torch.Tensor:
        no_cache(cache)
        if self.kind == "attention":
            pos, mask, rope = self._block.context(s, positions)
            return self._attention(s, mask, pos, rope, None)
        return self._mlp(s)

    def _attention(self, h: torch.Tensor, mask, pos, rope, cache) -> torch.Tensor:
        """The layer's forward up to its first residual add, attention given what the layer gives it."""
        keywords = attention_keywords(mask, pos, rope, cache)
        if self._layout.parallel:
            return parallel_attention(self.whole, self._layout, h, self.layer, keywords)
        return run_branch(self.whole, self._layout.attention, h, self.layer, keywords)

    def _mlp(self, s: torch.Tensor) -> torch.Tensor:
        layer, d, branch = self.layer, self._d, self._layout.mlp
        if self.kind == "mlp" and self._layout.parallel:
            return parallel_mlp(self.whole, self._layout, s, layer)
        if self.kind == "mlp":
            return run_branch(self.whole, branch, s, layer)
        if self.kind == "gate_up":  # the MLP's own forward, up to what it hands down_proj
            x = getattr(layer, branch.pre)(s)
            return torch.cat([s, before_down(self.whole.mlp, x)], dim=-1)
        if self.kind == "gate":
            x = getattr(layer, branch.pre)(s)
            return torch.cat([s, x, layer.mlp.gate_proj(x)], dim=-1)
        if self.kind == "up":
            # contiguous, as the whole layer's gate and normed input are: the activation of a column
            # slice computed its last elements (a width no multiple of the vector length) otherwise
            h, x, g = s[..., :d], s[..., d : 2 * d].contiguous(), s[..., 2 * d :].contiguous()
            return torch.cat([h, self._act(g) * layer.mlp.up_proj(x)], dim=-1)
        h, a = s[..., :d], s[..., d:]  # down: its post-norm, the layer's last residual add
        return finish(self.whole, branch, h, layer.mlp.down_proj(a), layer)

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
            ranges = expert_ranges(num_experts(block.layer), parts - 1)
            pieces.append(SubLayer(block, i, "attention", d, f))
            name = moe_block(block.layer)
            assert name is not None
            moe = getattr(block.layer, name)
            if dense_form(moe):  # Llama 4's: every expert on every token
                kind: Any = functools.partial(DenseExpertRange, name=name)
            elif not hasattr(moe, "experts"):  # JetMoE's parallel experts
                kind = functools.partial(ListExpertRange, name=name)
            else:
                kind = ExpertRange
            pieces += [kind(block, i, k, len(ranges), lo, hi, model) for k, (lo, hi) in enumerate(ranges)]
        else:
            pieces += [SubLayer(block, i, k, d, f) for k in PARTS[2 if moe else parts]]
    model.blocks = nn.ModuleList(pieces)
    model.block_layers = [cast(Any, p).layer_index for p in pieces]
    model.block_widths = [cast(Any, p).in_width for p in pieces]
    model.layer_parts = parts
