"""Ranges of experts for JetMoE's mixture of experts (``JetMoeMoE``), whose experts are two
``JetMoeParallelExperts`` (``input_linear``: ``[E, 2 ff, d]``, ``output_linear``: ``[E, d, ff]``)
run on the (token, expert) pairs sorted by expert, split by a list of counts.

Its forward, read from transformers 5.24: the router (``JetMoeTopKGating``: top-k of the logits,
softmax over them, the pairs sorted by expert: ``batch_index``, ``batch_gates``, ``expert_size``),
every pair's input gathered (``expert_inputs``), ``input_linear``, the gated activation,
``output_linear``, each pair's output times its gate, ``index_add`` back into token order, then
``+ bias``.

``model.layer_pieces = N`` (N >= 3) cuts such a layer into attention | ``N - 1`` ranges of
experts (``ListExpertRange``), each its experts' rows of both weights (``pieces.RowPiece``):

- the first range takes the post-attention norm and the router, gathers every pair's input (so
  that its backward scatters every pair's gradient back in one go, as the whole layer's), and
  computes its experts' pairs;
- each range runs both ``JetMoeParallelExperts.forward`` on its experts' pairs (contiguous: they
  are sorted by expert) with its experts' weights and its experts' counts, the activation and the
  gates, as the whole does for every expert;
- the last adds the pairs' outputs back into token order and adds the bias, as the layer.

Between them goes the residual, the pairs' inputs (``k d`` a token), their gates (``k``), each
token's experts in token order (``k`` values of the compute dtype, exact up to 256 experts in
bf16: each range sorts them again, as the router does once) and the pairs' outputs so far
(``k d``). Losses and gradients are the whole layer's bit for bit on CPU
(``tests/test_experts_cut.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .base import no_cache
from .layouts import finish, layout_of, source_of
from .pieces import RowPiece
from .ranges import Shell, even_routing, exact_ids, place_range

__all__ = ["ListExpertRange", "list_form"]

_LINEARS = ("input_linear", "output_linear")


def list_form(moe: nn.Module) -> bool:
    """Whether ``moe`` is JetMoE's block whose forward (and its experts' and router's) the
    ranges replay."""
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoE, JetMoeParallelExperts, JetMoeTopKGating

    return (
        source_of(type(moe).forward) == source_of(JetMoeMoE.forward)
        and all(source_of(type(getattr(moe, a)).forward) == source_of(JetMoeParallelExperts.forward) for a in _LINEARS)
        and source_of(type(moe.router).forward) == source_of(JetMoeTopKGating.forward)
    )


class _RangeLinear(nn.Module):
    """A range's rows of a ``JetMoeParallelExperts`` weight, called with its forward (which
    reads ``num_experts`` and ``weight``)."""

    weight: nn.Parameter

    def __init__(self, whole: nn.Module, experts: int) -> None:
        super().__init__()
        self.num_experts, self.input_size, self.output_size = experts, whole.input_size, whole.output_size
        object.__setattr__(self, "_forward", type(whole).forward)

    def forward(self, x: torch.Tensor, expert_size: list[int]) -> torch.Tensor:
        # named as JetMoE's: the routed reads take the counts by this name (inference/routed.py)
        return self._forward(self, x, expert_size)


class ListExpertRange(nn.Module):
    """Experts ``[lo, hi)`` of JetMoE layer ``layer_index``, the ``k``-th of ``n`` ranges (see
    the module docstring)."""

    attends = False

    def __init__(self, block: Any, layer_index: int, k: int, n: int, lo: int, hi: int, model: Any, name: str) -> None:
        super().__init__()
        layer = block.layer
        moe = getattr(layer, name)
        place_range(self, layer_index, k, n, lo, hi)
        object.__setattr__(self, "whole", layer)
        object.__setattr__(self, "_act", moe.activation)
        self._d, self._k, self._e = moe.input_size, moe.router.top_k, moe.router.num_experts
        layout = layout_of(layer)
        assert not isinstance(layout, str), "cut_problem first"
        self._branch = layout.mlp
        self.layer = Shell()
        shell = Shell()
        setattr(self.layer, name, shell)
        if k == 0:
            if self._branch.pre:
                setattr(self.layer, self._branch.pre, getattr(layer, self._branch.pre))
            shell.router = moe.router
        if k == n - 1:
            shell.bias = moe.bias
        for attr in _LINEARS:
            whole = getattr(moe, attr)
            piece = _RangeLinear(whole, hi - lo)
            piece.weight = nn.Parameter(
                torch.empty((hi - lo, *whole.weight.shape[1:]), device="meta"), whole.weight.requires_grad
            )
            holder = Shell()
            setattr(holder, f"range{k}", piece)
            setattr(shell, attr, holder)
            model.row_pieces[f"blocks.{layer_index}.layer.{name}.{attr}.range{k}.weight"] = RowPiece(
                f"blocks.{layer_index}.layer.{name}.{attr}.weight", lo, hi, tuple(whole.weight.shape), whole, "weight"
            )
            model.cut_params.setdefault((whole, "weight"), []).append((piece, "weight"))
            object.__setattr__(self, f"_{attr}", piece)
        object.__setattr__(self, "_shell", shell)
        d, kk = self._d, self._k
        self.in_width = d if k == 0 else d + 2 * kk * d + 2 * kk

    def example_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this range takes for hidden states like ``x`` (``[B, T, d]``), routed evenly over
        the experts (the probes measure it: random values would name no expert)."""
        if self.k == 0:
            return x
        B, T, _ = x.shape
        k = self._k
        ids, sel = even_routing(x, k, self._e)
        return torch.cat([x, sel, torch.full((B, T, k), 1.0 / k, dtype=x.dtype, device=x.device), ids, sel], dim=-1)

    def record_slack(self, tokens: int, itemsize: int) -> int:
        """Bytes this range may save beyond one measured forward: from none to every pair (each
        its input, the up projection's output, the gated product and the gated output)."""
        ff = self._output_linear.weight.shape[-1]
        return tokens * self._k * (3 * self._d + 4 * ff + 8) * itemsize

    def _sorted(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The pairs' order by expert (``index_sorted_experts``, the router's sort) and each
        expert's count, from the token-order experts ``ids`` (longs)."""
        _, order = ids.sort(0)
        return order, torch.bincount(ids, minlength=self._e).tolist()  # sync point: the counts

    def forward(self, s: torch.Tensor, positions: torch.Tensor | None = None, cache: Any = None) -> torch.Tensor:
        no_cache(cache)
        d, k, e = self._d, self._k, self._e
        B, T = s.shape[:2]
        if self.k == 0:  # the block's start: the norm, the router, every pair's input gathered
            if e > exact_ids(s.dtype):
                raise RuntimeError(f"{e} experts: their ids carried as {s.dtype} values would round; train in float32")
            h = s
            x = getattr(self.layer, self._branch.pre)(h) if self._branch.pre else h
            xr = x.reshape(-1, d)
            order, batch_index, gates, sizes, _ = self._shell.router(xr)
            ids = torch.empty_like(order)
            ids[order] = torch.repeat_interleave(torch.arange(e, device=order.device), torch.tensor(sizes))
            sel = xr[batch_index]
            outs = torch.zeros_like(sel)
        else:
            h, sel, gates, ids_f, outs = torch.split(s, [d, k * d, k, k, k * d], dim=-1)
            sel, gates, outs = sel.reshape(-1, d), gates.reshape(-1), outs.reshape(-1, d).clone()
            ids = ids_f.detach().reshape(-1).long()
            order, sizes = self._sorted(ids)
            batch_index = order.div(k, rounding_mode="trunc")
        start, stop = sum(sizes[: self.lo]), sum(sizes[: self.hi])
        if stop > start:
            part = sizes[self.lo : self.hi]
            up = self._input_linear(sel[start:stop], part).chunk(2, dim=-1)
            out = self._output_linear(self._act(up[0]) * up[1], part)
            outs[start:stop] = out * gates[start:stop, None]
        if self.k == self.n - 1:  # the whole block's end: back to token order, the bias, the residual
            zeros = torch.zeros((B * T, d), dtype=outs.dtype, device=outs.device)
            out = zeros.index_add(0, batch_index, outs).view(B, T, d) + self._shell.bias
            return finish(self.whole, self._branch, h, out, self.layer)
        return torch.cat(
            [
                h,
                sel.reshape(B, T, k * d),
                gates.reshape(B, T, k),
                ids.to(s.dtype).reshape(B, T, k),
                outs.reshape(B, T, k * d),
            ],
            dim=-1,
        )

    def decode(self, s: torch.Tensor, masks: dict[str, Any], position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Generation: as in training (no key/value cache here)."""
        return self.forward(s)
