"""Ranges of experts for a mixture of experts that runs every expert on every token: Llama 4's
``Llama4TextMoe`` (a Llama 4 Scout MoE layer is 2.1 B parameters, 8.5 GB in fp32: no small
budget's slot holds it whole).

Its forward, read from transformers 5.24: the router's sigmoid scores (zero for the experts a
token did not pick), every token's normed states repeated once per expert and multiplied by its
score (``routed_in``, expert-major: expert ``e``'s rows are ``[e T, (e + 1) T)``), the experts'
``bmm`` over all of them (``Llama4TextExperts``: a batch of one matrix product per expert), the
shared expert, and ``shared + routed_out.reshape(E, T, d).sum(0)``.

``model.layer_pieces = N`` (N >= 3) cuts such a layer into attention | ``N - 1`` ranges of
experts (``DenseExpertRange``), each its experts' rows of ``gate_up_proj`` and ``down_proj``
(``pieces.RowPiece``, as ``experts_cut.py``'s):

- the first range takes the post-attention norm and the router, makes ``routed_in`` for every
  expert (so that its backward sums every expert's gradient into the normed states in one go, as
  the whole layer's), computes its experts, then the shared expert (the layer's order);
- each range runs ``Llama4TextExperts.forward`` on its experts' rows of ``routed_in`` (contiguous:
  they are expert-major) with its experts' weights: a ``bmm`` of its experts, each product the
  whole ``bmm``'s;
- the last sums the experts' outputs over the experts and adds the shared expert's, as the layer.

Between them goes the residual, ``routed_in``, the experts' outputs so far and the shared expert's
output: ``(2 E + 2) d`` values a token (the layer itself holds ``routed_in`` and the outputs of
every expert). Every gradient that sums several is summed by one operation as in the whole layer,
so losses and gradients are the whole layer's bit for bit on CPU (``tests/test_experts_cut.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .base import no_cache
from .layouts import finish, layout_of
from .pieces import RowPiece
from .ranges import Shell, place_range

__all__ = ["DenseExpertRange", "dense_form", "dense_problem", "every_expert_module"]

_ATTRS = ("gate_up_proj", "down_proj")


def dense_form(moe: nn.Module) -> bool:
    """Whether ``moe`` is Llama 4's every-expert block whose forward the ranges replay."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts, Llama4TextMoe

    from .layouts import source_of

    return (
        source_of(type(moe).forward) == source_of(Llama4TextMoe.forward)
        and source_of(type(moe.experts).forward) == source_of(Llama4TextExperts.forward)
        and all(hasattr(moe, a) for a in ("router", "shared_expert", "hidden_dim", "num_experts"))
    )


def every_expert_module(module: nn.Module) -> bool:
    """Whether ``module`` is Llama 4's experts module (``Llama4TextExperts``) or a range's: it
    takes one expert-major input, ``[E x tokens, d]``, and runs every expert on its rows. An
    expert no token picked gets rows of zeros (its score is 0), so its output is zero whatever
    its weights, as long as they are finite: what lets a forward-only run leave it unread
    (``inference/routed.py``)."""
    if isinstance(module, _RangeExperts):
        return True
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from .layouts import source_of

    return source_of(type(module).forward) == source_of(Llama4TextExperts.forward)


def dense_problem(moe: nn.Module) -> str:
    """Why ``moe`` (a block with ``experts``) cannot be cut into ranges as Llama 4's ('' where it
    can)."""
    if not dense_form(moe):
        return f"{type(moe).__name__}'s forward is not Llama 4's (every expert on every token) the ranges replay"
    return ""


class _RangeExperts(nn.Module):
    """A range's experts: its rows of the layer's ``gate_up_proj`` (``[E, d, 2 ff]``) and
    ``down_proj``; called with ``Llama4TextExperts.forward`` (it reads ``hidden_size``,
    ``act_fn`` and the parameters' first dimension)."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.hidden_size = experts.hidden_size
        object.__setattr__(self, "act_fn", experts.act_fn)
        object.__setattr__(self, "_forward", type(experts).forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(self, x)


class DenseExpertRange(nn.Module):
    """Experts ``[lo, hi)`` of Llama 4 layer ``layer_index``, the ``k``-th of ``n`` ranges (see
    the module docstring). ``forward(s) -> s'``: the first range takes the hidden states, the
    others the carried tensor; the last gives the hidden states back."""

    attends = False

    def __init__(self, block: Any, layer_index: int, k: int, n: int, lo: int, hi: int, model: Any, name: str) -> None:
        super().__init__()
        layer = block.layer
        moe = getattr(layer, name)
        experts = moe.experts
        place_range(self, layer_index, k, n, lo, hi)
        object.__setattr__(self, "whole", layer)
        self._d, self._e = moe.hidden_dim, moe.num_experts
        piece = _RangeExperts(experts)
        for attr in _ATTRS:
            whole = getattr(experts, attr)
            setattr(
                piece, attr, nn.Parameter(torch.empty((hi - lo, *whole.shape[1:]), device="meta"), whole.requires_grad)
            )
            model.row_pieces[f"blocks.{layer_index}.layer.{name}.experts.range{k}.{attr}"] = RowPiece(
                f"blocks.{layer_index}.layer.{name}.experts.{attr}", lo, hi, tuple(whole.shape), experts, attr
            )
            model.cut_params.setdefault((experts, attr), []).append((piece, attr))
        layout = layout_of(layer)
        assert not isinstance(layout, str), "cut_problem first"
        self._branch = layout.mlp
        self.layer = Shell()
        if k == 0 and self._branch.pre:
            setattr(self.layer, self._branch.pre, getattr(layer, self._branch.pre))
        shell = Shell()
        setattr(self.layer, name, shell)
        if k == 0:  # the router and the shared expert (their parameters in the first range)
            shell.router, shell.shared_expert = moe.router, moe.shared_expert
        shell.experts = Shell()
        setattr(shell.experts, f"range{k}", piece)
        object.__setattr__(self, "_shell", shell)
        object.__setattr__(self, "_piece", piece)
        self.in_width = self._d if k == 0 else (2 * self._e + 2) * self._d

    def example_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this range takes for hidden states like ``x`` (``[B, T, d]``)."""
        if self.k == 0:
            return x
        e = self._e
        return torch.cat([x, x.repeat(1, 1, 2 * e), x], dim=-1)

    def record_slack(self, tokens: int, itemsize: int) -> int:
        return 0  # every expert computes every token: a measured forward saves what any routing would

    def _carry(self, t: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """``[E x B T, d]`` (expert-major) as ``[B, T, E d]``."""
        e, d = self._e, self._d
        return t.view(e, B * T, d).transpose(0, 1).reshape(B, T, e * d)

    def _uncarry(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, T, E d]`` back to ``[E x B T, d]`` (expert-major, contiguous)."""
        B, T = t.shape[:2]
        e, d = self._e, self._d
        return t.reshape(B * T, e, d).transpose(0, 1).reshape(e * B * T, d)

    def forward(self, s: torch.Tensor, positions: torch.Tensor | None = None, cache: Any = None) -> torch.Tensor:
        no_cache(cache)
        d, e, shell = self._d, self._e, self._shell
        B, T = s.shape[:2]
        if self.k == 0:  # the block's start, in its forward's order
            h = s
            x = getattr(self.layer, self._branch.pre)(h) if self._branch.pre else h
            hs = x.reshape(-1, d)
            scores, _ = shell.router(hs)
            routed_in = hs.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)
            outs = torch.zeros_like(routed_in)
            shared = None
        else:
            h, ri, so, shared = torch.split(s, [d, e * d, e * d, d], dim=-1)
            routed_in, outs = self._uncarry(ri), self._uncarry(so).clone()
        rows = slice(self.lo * B * T, self.hi * B * T)
        outs[rows] = self._piece(routed_in[rows])
        if self.k == 0:
            shared = shell.shared_expert(hs).view(B, T, d)
        assert shared is not None
        if self.k == self.n - 1:  # the whole block's end: the sum over the experts, the shared expert's added
            out = shared.reshape(-1, d) + outs.reshape(e, -1, d).sum(dim=0)
            return finish(self.whole, self._branch, h, out, self.layer)
        return torch.cat([h, self._carry(routed_in, B, T), self._carry(outs, B, T), shared], dim=-1)

    def decode(self, s: torch.Tensor, masks: dict[str, Any], position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Generation: as in training (no key/value cache here)."""
        return self.forward(s)
