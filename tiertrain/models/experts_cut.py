"""Experts as pieces: a mixture-of-experts layer cut into sub-layer units, its experts' 3-D
parameters into ranges of whole experts (row ranges of a large parameter, as the vocabulary's
pieces: ``pieces.RowPiece``), so that slots and buffers follow the budget, not the layer (a
Qwen3-235B layer is 2.4 B parameters, 9.7 GB in fp32).

``model.layer_pieces = N`` (N >= 3) cuts such a layer into ``attention`` | ``N - 1`` ranges of
experts. transformers runs the experts with ``grouped_mm`` (``integrations/moe.py``): every
(token, expert) pair's input gathered in expert order, a product per expert, each token's ``k``
outputs summed in top-k order. The ranges compute exactly that:

- the first range takes the post-attention norm and the router, gathers *every* pair's input
  (so that its backward scatters their gradients back in one go, in the whole layer's order),
  and computes its experts' pairs;
- each range multiplies its experts' rows of the gathered inputs (they are contiguous: the
  pairs are sorted by expert) with its experts' weights, group by group as the whole does;
- the last sums each token's outputs and adds the residual.

Between them goes one tensor, as between any units: the residual, the gathered inputs (``k x
d`` a token), the pairs' routing weights and expert ids (``k`` each; ids as values of the compute
dtype, exact up to 256 experts in bf16; each range sorts them again, as the whole does once) and
the pairs' outputs so far (``k x d``), concatenated
on the last dimension: about ``(2k + 1) d`` values a token. Each value is made by the operations
of the whole layer, and every gradient that sums several is summed by one operation as in the
whole layer (the gather's scatter, the top-k sum), so losses and gradients are the whole
layer's bit for bit on CPU (``tests/test_experts_cut.py``; on CUDA, where ``grouped_mm``'s kernel
may tile fewer rows otherwise, checked against the CPU run only, within 1e-5). With clipping on, each range's share of an
expert parameter is a parameter of its own, and the global norm sums over the ranges' norms:
that rounds otherwise (``CLIP_NORM_DEVIATION``), so the planner cuts experts only where it must
and says so.

Shared experts (``_forms``: Qwen2-MoE's gated one, DeepSeek-V3's) run in the first range, in
their block's order around the router and the first range's experts (the order autograd sums
the normed states' gradients in: a test pins it), and their output is carried to the last range
(``d`` values a token more), which adds it as the block does.

gpt-oss's experts add a bias per pair (its rows gathered by the pairs' experts before each
product, as the whole gathers them) and keep their weights transposed: replayed too.

Cut only where the MoE block's ``forward`` is one of ``_forms`` (without Mixtral's jitter)
and the experts run transformers' ``grouped_mm`` forward as this module replays it (checked
on their source).
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any

import torch
import torch.nn as nn

from .base import no_cache
from .layouts import finish, layout_of, source_of
from .pieces import RowPiece
from .ranges import Shell, even_routing, exact_ids, place_range

__all__ = [
    "moe_problem",
    "expert_ranges",
    "ExpertRange",
    "is_moe_layer",
    "moe_block",
    "num_experts",
    "CLIP_NORM_DEVIATION",
]

# transformers' grouped_mm experts forward, whose source's sha256 is ``GROUPED_MM_SHA`` where this
# module replays it: another version's is refused, not replayed inexactly
_GROUPED_MM = "grouped_mm_experts_forward"


# a decoder layer's attribute holding its MoE block (Granite-MoE's: block_sparse_moe)
_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward")  # Llama 4's: feed_forward


def _is_moe(block: Any) -> bool:
    """A mixture-of-experts block: ``experts`` (transformers' 3-D ones), or JetMoE's two
    parallel-experts linears and router."""
    return hasattr(block, "experts") or all(hasattr(block, a) for a in ("input_linear", "output_linear", "router"))


def moe_block(layer: nn.Module) -> str | None:
    """The attribute of ``layer`` holding its mixture-of-experts block, or None: a dense layer."""
    return next((n for n in _BLOCKS if _is_moe(getattr(layer, n, None))), None)


def num_experts(layer: nn.Module) -> int:
    """A MoE layer's number of experts."""
    block = getattr(layer, moe_block(layer) or "mlp")
    return (block.experts if hasattr(block, "experts") else block.input_linear).num_experts


def is_moe_layer(layer: nn.Module) -> bool:
    return moe_block(layer) is not None


def moe_problem(layer: nn.Module, dtype: torch.dtype | None = None) -> str:
    """Why a mixture-of-experts layer's experts cannot be cut into ranges exactly ('') in the
    compute ``dtype`` (None: any): the ranges carry the routing weights and expert ids as values
    of it."""
    mlp = getattr(layer, moe_block(layer) or "mlp")
    from .experts_dense import dense_form
    from .experts_list import list_form

    if dense_form(mlp):  # Llama 4's: every expert on every token (``experts_dense.py``)
        return ""
    if not hasattr(mlp, "experts"):  # JetMoE's parallel experts (``experts_list.py``)
        if not list_form(mlp):
            return f"{type(mlp).__name__}'s forward is not JetMoE's, the one its ranges replay"
        most = exact_ids(dtype) if dtype is not None else 1 << 24
        if num_experts(layer) > most:
            return f"{num_experts(layer)} experts: their ids are carried as {dtype} values, exact up to {most}"
        return ""
    experts = mlp.experts
    if form_of(mlp) is None:
        return (
            f"{type(mlp).__name__}'s forward is not one the ranges replay (Qwen3-MoE's, OLMoE's, Mixtral's, "
            "Granite-MoE's, Phi-MoE's: a router, then the experts; DeepSeek-V3's and Qwen2-MoE's: with shared experts)"
        )
    if getattr(mlp, "jitter_noise", 0):
        return f"{type(mlp).__name__}'s jitter_noise = {mlp.jitter_noise} (random in training; not replayed)"
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    wrapped = hasattr(type(experts).forward, "__wrapped__") and all(
        hasattr(experts, a) for a in ("is_transposed", "has_gate", "_is_expert_parallel")
    )  # transformers' use_experts_implementation: the forward it dispatches is the implementation named
    if impl != "grouped_mm" or not wrapped:
        return (
            f"{type(experts).__name__} runs {'its own forward' if not wrapped else repr(impl)}, not transformers' "
            "grouped_mm experts forward the ranges replay: cut it into 2 (model.layer_pieces = 2)"
        )
    if not _grouped_mm_replayed():
        import transformers

        return (
            f"transformers {transformers.__version__}'s grouped_mm experts forward is not the one the ranges replay "
            "(transformers 5.24's)"
        )
    if dtype is not None and dtype != torch.float32:
        src = source_of(type(_router(mlp)).forward) or ""
        # routing weights in float32 (softmax in float, DeepSeek's scores of float32 logits) unless cast back
        cast_back = any(c in src for c in (".to(router_logits.dtype)", ".type_as(hidden_states)"))
        if re.search(r"torch\.float\b|torch\.float32|\.float\(\)", src) and not cast_back:
            return (
                f"{type(_router(mlp)).__name__} gives float32 routing weights while the model computes in {dtype}: "
                "train it in float32"
            )
        most = exact_ids(dtype)
        if experts.num_experts > most:
            return (
                f"{experts.num_experts} experts: their ids are carried as {dtype} values, exact up to {most}; "
                "train in float32 (train.param_dtype) or cut it into 2 (model.layer_pieces = 2)"
            )
    if not getattr(experts, "has_gate", True) or getattr(experts, "_is_expert_parallel", False):
        return f"{type(experts).__name__} has no gate or runs expert-parallel (not replayed)"
    if getattr(experts, "has_post_expert_norm", False):
        return f"{type(experts).__name__} has a post-expert norm (not replayed)"
    if getattr(experts, "has_bias", False) != all(getattr(experts, a, None) is not None for a in _ATTRS):
        return f"{type(experts).__name__}'s biases are not gate_up_proj_bias and down_proj_bias"
    return ""


# the MoE blocks' forms the ranges replay (``_forms``):
PLAIN = "plain"  # the router, then the experts (Qwen3-MoE, OLMoE, Mixtral without jitter, gpt-oss, Granite-MoE)
SHARED = "shared"  # router, experts, then + shared_experts(x) (DeepSeek-V2/V3, GLM-4.5, dots.llm1)
GATED = (
    "gated shared"  # shared_expert(x) first, router, experts, then + sigmoid(shared_expert_gate(x)) * it (Qwen2-MoE)
)
JITTER = "input jitter"  # training: the states times uniform noise in place, then router, experts (Phi-MoE)


@functools.lru_cache(maxsize=1)
def _forms() -> dict[str | None, str]:
    """The forms of MoE blocks' forwards the ranges replay, by their source."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.granitemoe import modeling_granitemoe
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.olmoe import modeling_olmoe
    from transformers.models.phimoe import modeling_phimoe
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    forms: dict[Any, str] = {
        modeling_qwen3_moe.Qwen3MoeSparseMoeBlock: PLAIN,
        modeling_olmoe.OlmoeSparseMoeBlock: PLAIN,
        modeling_mixtral.MixtralSparseMoeBlock: PLAIN,
        modeling_gpt_oss.GptOssMLP: PLAIN,  # its router's attribute is router; (states, scores) returned
        modeling_deepseek_v3.DeepseekV3MoE: SHARED,
        modeling_qwen2_moe.Qwen2MoeSparseMoeBlock: GATED,
        modeling_granitemoe.GraniteMoeMoE: PLAIN,  # as block_sparse_moe; its router's attribute is router
        modeling_phimoe.PhimoeSparseMoeBlock: JITTER,  # its router's sparsemixer: random in training, as dropout
    }
    return {source_of(b.forward): form for b, form in forms.items() if source_of(b.forward)}


def form_of(mlp: nn.Module) -> str | None:
    """The form of a MoE block (None: not one the ranges replay)."""
    return _forms().get(source_of(type(mlp).forward))


GROUPED_MM_SHA = "54beecae8764c6e99e73d0a6c85f9120c9535d713647d099dd91da6c74e1f15e"  # transformers 5.24's


# measured on a 16 x 1536 x 512 (12.6 M-element) expert gradient, fp32 on CPU: torch's norm of the
# whole tensor is 5e-4 from the exact (fp64) value, the ranges' 2e-4 to 8e-6
CLIP_NORM_DEVIATION = (
    "with clipping on, the clip's global norm is summed over the experts' ranges' norms, not taken over each "
    "whole expert parameter: it differs from plain PyTorch's by float rounding, 3e-4 to 5e-4 relative measured on "
    "a 12.6 M-element expert parameter (where torch's own fp32 norm of the whole is 5e-4 from the exact value), "
    "and so does the clip's factor in a step where it acts"
)


@functools.lru_cache(maxsize=1)
def _grouped_mm_replayed() -> bool:
    """Whether the installed transformers' grouped_mm experts forward is the one the ranges
    replay (its source's hash; read once, not for every layer of every cut planned)."""
    import transformers.integrations.moe as moe

    got = hashlib.sha256((source_of(getattr(moe, _GROUPED_MM, None)) or "").encode()).hexdigest()
    return got == GROUPED_MM_SHA


def expert_ranges(experts: int, ranges: int) -> list[tuple[int, int]]:
    """``ranges`` contiguous ranges of whole experts, as even as possible, first ones larger."""
    base, extra = divmod(experts, ranges)
    out, start = [], 0
    for k in range(ranges):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out


_ATTRS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # the experts' parameters cut
_ROUTERS = ("gate", "router")  # a MoE block's router, by its attribute (gpt-oss: router)


def _router(mlp: nn.Module) -> Any:
    return getattr(mlp, _ROUTERS[0], None) or getattr(mlp, _ROUTERS[1])


class _RangeExperts(nn.Module):
    """A range's experts: its rows of the layer's ``gate_up_proj`` and ``down_proj`` (set by
    ``ExpertRange``). It takes the routing as ``top_k_index`` (the pairs' experts, numbered within
    the range), as transformers' experts modules do, so that a forward-only run's routed reads
    (``inference/routed.py``) read the experts it names alone."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    gate_up_proj_bias: nn.Parameter | None  # gpt-oss's; None: no biases
    down_proj_bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("gate_up_proj_bias", None)
        self.register_parameter("down_proj_bias", None)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, offsets: torch.Tensor, experts: Any) -> torch.Tensor:
        """The products of ``x`` (the pairs' inputs, sorted by expert; ``offsets``: each
        expert's end among them) with their experts, group by group as the whole layer's (each
        pair's bias rows gathered before its product, as the whole gathers them)."""
        from transformers.integrations.moe import _grouped_linear

        t = bool(getattr(experts, "is_transposed", False))
        bias = self.gate_up_proj_bias[top_k_index] if self.gate_up_proj_bias is not None else None
        proj = _grouped_linear(x, self.gate_up_proj, offsets, bias=bias, is_transposed=t)
        proj = experts._apply_gate(proj)
        bias = self.down_proj_bias[top_k_index] if self.down_proj_bias is not None else None
        return _grouped_linear(proj, self.down_proj, offsets, bias=bias, is_transposed=t)


class ExpertRange(nn.Module):
    """Experts ``[lo, hi)`` of decoder layer ``layer_index``, the ``k``-th of ``n`` ranges,
    their parameters row ranges of the layer's expert parameters (``model.row_pieces``).
    ``forward(s) -> s'``: the first range takes the hidden states, the others the carried
    tensor; the last gives the hidden states back."""

    attends = False

    def __init__(self, block: Any, layer_index: int, k: int, n: int, lo: int, hi: int, model: Any) -> None:
        super().__init__()
        layer = block.layer
        name = moe_block(layer)
        assert name, "a MoE layer"
        mlp = getattr(layer, name)
        experts = mlp.experts
        place_range(self, layer_index, k, n, lo, hi)
        object.__setattr__(self, "whole", layer)  # the whole layer (its parameters' order)
        object.__setattr__(self, "_experts", experts)  # its activation and gate function
        router = _router(mlp)
        self._d = getattr(experts, "hidden_dim", None) or experts.hidden_size
        self._k, self._e = router.top_k, experts.num_experts
        piece = _RangeExperts()
        for attr in _ATTRS:
            whole = getattr(experts, attr, None)
            if whole is None:
                continue
            p = nn.Parameter(torch.empty((hi - lo, *whole.shape[1:]), device="meta"), whole.requires_grad)
            setattr(piece, attr, p)
            model.row_pieces[f"blocks.{layer_index}.layer.{name}.experts.range{k}.{attr}"] = RowPiece(
                f"blocks.{layer_index}.layer.{name}.experts.{attr}", lo, hi, tuple(whole.shape), experts, attr
            )
            model.cut_params.setdefault((experts, attr), []).append((piece, attr))
        layout = layout_of(layer)
        assert not isinstance(layout, str), "cut_problem first"
        self._branch = layout.mlp  # its norm before the block (first range), what follows it (last)
        self.layer = Shell()
        if k == 0 and self._branch.pre:  # FlexOlmo's block takes the residual stream itself
            setattr(self.layer, self._branch.pre, getattr(layer, self._branch.pre))
        if k == n - 1:
            for m in (self._branch.post, self._branch.dropout):
                if m:
                    setattr(self.layer, m, getattr(layer, m))
        shell = Shell()
        setattr(self.layer, name, shell)
        object.__setattr__(self, "_mlp", shell)  # the block's shell: router, shared experts, this range
        self._form = form_of(mlp)
        self._noise = float(getattr(mlp, "input_jitter_noise", 0.0) or 0.0)  # Phi-MoE's
        if k == 0:  # the router and the shared experts (their parameters in the first range)
            setattr(shell, _ROUTERS[0] if hasattr(mlp, _ROUTERS[0]) else _ROUTERS[1], router)
            for attr in ("shared_experts", "shared_expert", "shared_expert_gate"):
                if self._form in (SHARED, GATED) and hasattr(mlp, attr):
                    setattr(shell, attr, getattr(mlp, attr))
        shell.experts = Shell()
        setattr(shell.experts, f"range{k}", piece)
        object.__setattr__(self, "_piece", piece)
        d, kk = self._d, self._k
        self._shared = (
            d if self._form in (SHARED, GATED) else 0
        )  # the shared experts' output, carried to the last range
        carried = (2 * kk + 1) * d + 2 * kk + self._shared
        self.in_width = d if k == 0 else carried

    def example_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this range takes for hidden states like ``x`` (``[B, T, d]``), routed evenly over
        the experts (the probes measure it: random values would name no expert)."""
        if self.k == 0:
            return x
        B, T, d = x.shape
        k = self._k
        ids, sel = even_routing(x, k, self._e)
        weights = torch.full((B, T, k), 1.0 / k, dtype=x.dtype, device=x.device)
        shared = x[..., : self._shared]
        return torch.cat([x, sel, weights, ids, torch.zeros_like(sel), shared], dim=-1)

    def record_slack(self, tokens: int, itemsize: int) -> int:
        """Bytes this range may save for its backward beyond one measured forward: its rows are
        from none to every (token, expert) pair; each saves its input, its gate and up outputs,
        the gated product and the weighted output (generously ``3 d + 6 ff`` values)."""
        down = self._piece.down_proj  # [E, d, ff], or [E, ff, d] transposed (gpt-oss)
        ff = down.shape[-2] if getattr(self._experts, "is_transposed", False) else down.shape[-1]
        return tokens * self._k * (3 * self._d + 6 * ff + 8) * itemsize

    def _unpack(self, s: torch.Tensor):
        """(residual, gathered inputs, pairs' weights (expert order), expert ids (token order), pairs'
        outputs (expert order), the shared experts' output (``[B, T, d]``; empty: none)) of a
        carried tensor."""
        d, k = self._d, self._k
        cuts = [d, k * d, k, k, k * d, self._shared]
        h, sel, wg, ids, outs, shared = torch.split(s, cuts, dim=-1)
        # (contiguous: at top-1 the reshape is a view of rows 3d + 2 apart, which torch's grouped
        # matrix product refuses unless a multiple of 16 bytes)
        return h, sel.reshape(-1, d).contiguous(), wg.reshape(-1), ids.reshape(-1), outs.reshape(-1, d), shared

    def _route(self, h: torch.Tensor, dtype: torch.dtype):
        """The block's start, in its forward's order: (the flattened normed states, routing
        weights, expert ids, the shared experts' output so far). Only the first range."""
        d, mlp = self._d, self._mlp
        gate = _router(mlp)
        x = getattr(self.layer, self._branch.pre)(h) if self._branch.pre else h
        shared = None
        if self._form == SHARED:  # the router takes the [B, T, d] states and flattens them itself
            _, weights, index = gate(x)
            xr = x.view(-1, d)
        else:
            if self._form == JITTER and mlp.training and self._noise > 0:  # in place, as the block
                x *= torch.empty_like(x).uniform_(1.0 - self._noise, 1.0 + self._noise)
            xr = x.view(-1, d)
            if self._form == GATED:
                shared = mlp.shared_expert(xr)
            _, weights, index = gate(xr)
        if weights.dtype != dtype:  # Mixtral's and DeepSeek's are fp32 whatever the compute dtype
            raise RuntimeError(
                f"{type(gate).__name__} gives {weights.dtype} routing weights while the model "
                f"computes in {dtype}: ranges of its experts would carry them rounded; train it in float32 "
                "(train.param_dtype) or cut its layers into 2 (model.layer_pieces = 2)"
            )
        return x, xr, weights.reshape(-1), index.reshape(-1), shared

    def _shared_end(self, x: torch.Tensor, xr: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The shared experts' part of the block, after the (first range's) experts, as the
        block computes it: ``[B, T, d]``."""
        mlp = self._mlp
        if self._form == SHARED:
            return mlp.shared_experts(x)
        assert shared is not None
        return (torch.sigmoid(mlp.shared_expert_gate(xr)) * shared).view(x.shape)

    def forward(self, s: torch.Tensor, positions: torch.Tensor | None = None, cache: Any = None) -> torch.Tensor:
        no_cache(cache)
        d, k, experts = self._d, self._k, self._experts
        B, T = s.shape[:2]
        if self.k == 0:  # the MoE block's start: the norm, the router, every pair's input gathered
            if self._e > exact_ids(s.dtype):
                raise RuntimeError(
                    f"expert ranges carry expert ids as {s.dtype} values, exact up to {exact_ids(s.dtype)} experts, "
                    f"and this layer has {self._e}: train in float32 or cut it into 2 (model.layer_pieces = 2)"
                )
            h = s
            x, xr, sample_weights, expert_ids, shared = self._route(h, s.dtype)
            expert_ids_g, perm = torch.sort(expert_ids)
            sel = xr[perm // k]
            wg = sample_weights[perm]
            outs = torch.zeros_like(sel)
        else:
            h, sel, wg, ids, outs, shared = self._unpack(s)
            expert_ids = ids.detach().long()
            expert_ids_g, perm = torch.sort(expert_ids)  # the first range's order: a deterministic sort
            outs = outs.clone()
        histc_input = expert_ids_g.float() if expert_ids_g.device.type in ("cpu", "mps") else expert_ids_g.int()
        tokens_per_expert = torch.histc(histc_input, bins=self._e, min=0, max=self._e - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        start = int(offsets[self.lo - 1]) if self.lo else 0  # sync point: this range's rows
        stop = int(offsets[self.hi - 1])
        if stop > start:
            offs = offsets[self.lo : self.hi] - start
            local = expert_ids_g[start:stop] - self.lo
            proj = self._piece(sel[start:stop], top_k_index=local, offsets=offs, experts=experts)
            outs[start:stop] = proj * wg[start:stop].unsqueeze(-1)
        if self.k == 0 and self._shared:
            shared = self._shared_end(x, xr, shared)
        if self.k == self.n - 1:  # the whole block's end: back to token order, the top-k sum, the residual
            inv_perm = torch.empty_like(perm)
            inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
            weighted_out = outs[inv_perm]
            final = weighted_out.view(B * T, k, d).sum(dim=1).to(sel.dtype)  # the block's input's, as transformers
            if self._form == GATED:  # the block adds its gated shared expert to the [T, d] sum
                final = final + shared.reshape(B * T, d)
            elif self._form == SHARED:  # ... its shared experts' to the [B, T, d] one
                final = final.view(B, T, d) + shared
            return finish(self.whole, self._branch, h, final.reshape(B, T, d), self.layer)
        ids_out = expert_ids.to(s.dtype)
        pieces = [h, sel.reshape(B, T, k * d), wg.reshape(B, T, k), ids_out.reshape(B, T, k), outs.reshape(B, T, k * d)]
        return torch.cat([*pieces, shared] if self._shared else pieces, dim=-1)

    def decode(self, s: torch.Tensor, masks: dict[str, Any], position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Generation: as in training (no key/value cache here)."""
        return self.forward(s)
