"""Cutting the model to fit the budget: the vocabulary into pieces (``models/pieces.py``) and
the decoder layers into sub-layer units (``models/sublayers.py``), each only where the budget
cannot hold the units as configured, as little as fits, said at start with what it changes."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError, one_line
from ..models.experts_cut import CLIP_NORM_DEVIATION, is_moe_layer
from ..models.sublayers import cut_options, describe_cut
from ..state.grads import GradStore
from ..state.scales import BLOCK
from .budget import (
    GIB,
    MIB,
    BudgetPlan,
    PoolsOverBudget,
    accum_dtype_of,
    pools_fit_unmeasured,
    resolve_budget,
    warn_above_available,
)

__all__ = ["plan_budget", "PIECES_TOLERANCE"]


# What cutting the vocabulary changes (measured in tests/test_pieces.py): said when the plan cuts.
PIECES_TOLERANCE = (
    "the cut head's cross-entropy is an online log-sum-exp over the pieces: losses differ from plain "
    "PyTorch's by rounding (relative 1e-6), weights after a few steps by up to 1e-5"
)


def plan_budget(
    cfg: Config, rt: Any, rates_fn: Any, act_fn: Any = None, agree: Any = None
) -> tuple[Config, "BudgetPlan"]:
    """``_plan_budget``; where the experts are cut into ranges and clipping is on, the plan says
    what that changes, whoever chose the cut."""
    cfg_out, plan = _plan_budget(cfg, rt, rates_fn, act_fn, agree)
    if rt.model.cut_params and cfg_out.optim.grad_clip > 0 and not any(CLIP_NORM_DEVIATION in n for n in plan.notes):
        plan.notes.append(
            f"experts cut into ranges (model.layer_pieces = {cfg_out.model.layer_pieces}): {CLIP_NORM_DEVIATION}"
        )
    return cfg_out, plan


def _plan_budget(cfg: Config, rt, rates_fn, act_fn=None, agree=None) -> tuple[Config, "BudgetPlan"]:
    """``resolve_budget``, with the model as configured (exact) unless the budget cannot hold its
    units (the host's fixed pools, or on CUDA the device's slots and buffers): then cut, as
    little as fits, each cut only where its field is unset, said with what it changes: first the
    vocabulary (``model.vocab_pieces``: where its matrix is larger than a block, the fewest pieces
    no larger than one; the cross-entropy then sums by rounding otherwise), then the decoder
    layers (``model.layer_pieces``: 2, 3 or 4 sub-layer units, or a mixture of experts' attention
    and ranges of experts; exact but for the clip's norm over expert ranges), with the vocabulary
    cut to the pieces' size where it is larger. ``agree``: with ranks, takes rank 0's choice (all ranks
    must cut alike). The returned config names the cut (a checkpoint of the run resumes with it)."""
    if cfg.memory.host_mib is not None:
        warn_above_available(cfg.memory.host_mib * MIB)  # once: the budget is resolved several times
    options = _cuts(cfg, rt)
    hint = _ranges_off(cfg, rt) if options else ""  # on the whole model, before any cut is tried
    if not options:
        return resolve_budget(cfg, rt, rates_fn, act_fn)  # refused here, named, where nothing can be cut
    why, resolved = _short(cfg, rt, rates_fn, act_fn)
    tried: list[str] = []
    choice = None if not why else len(options)  # len: none fits (the last cut refuses, named)
    for k, option in enumerate(options if why else []):
        cut_cfg = _recut(cfg, rt, *option)
        short, _ = _short(cut_cfg, rt, rates_fn, act_fn, measure=False)
        tried.append(short)
        if not short:
            choice = k
            break
    if agree is not None:
        choice = agree(choice)
    if choice is None:
        if resolved is not None and not tried:
            return resolved
        if tried:  # rank 0 did not cut: back to the model as configured
            _recut(cfg, rt, cfg.model.layer_pieces, cfg.model.vocab_pieces)
        return resolve_budget(cfg, rt, rates_fn, act_fn)
    try:
        cut_cfg, plan = _resolve_cut(cfg, rt, rates_fn, act_fn, options, choice, agree)
    except ConfigError as exc:  # refused here where even the last cut is short
        if not hint or choice != len(options):
            raise
        raise ConfigError(f"{exc}; {hint}") from None
    m = cut_cfg.model
    plan.notes.append(f"the model's units as configured do not fit ({why or 'on rank 0'}): cut")
    if m.vocab_pieces != cfg.model.vocab_pieces and m.vocab_pieces:
        plan.notes.append(
            f"vocabulary cut into {m.vocab_pieces} pieces (model.vocab_pieces = {m.vocab_pieces}): "
            f"{PIECES_TOLERANCE}. Raise memory.host_mib to hold whole vocabulary units and keep the math exact"
        )
    ranges = any(rt.model.cut_params) and cut_cfg.optim.grad_clip > 0
    clip_note = f"; {CLIP_NORM_DEVIATION}" if ranges else ""
    if m.layer_pieces != cfg.model.layer_pieces and m.layer_pieces:
        plan.notes.append(
            f"decoder layers cut into {m.layer_pieces} sub-layer units each (model.layer_pieces = {m.layer_pieces}: "
            f"{describe_cut(rt.model, m.layer_pieces)}): exact (the whole layer's losses and gradients bit for bit"
            f"{clip_note}); the tensors handed between the MLP's pieces are stashed too"
        )
    return cut_cfg, plan


def _resolve_cut(cfg: Config, rt, rates_fn, act_fn, options: list, choice: int, agree) -> tuple[Config, Any]:
    """The budget of cut ``options[choice]``; where its measured activations make it short (the
    choice was made without them), of the next deeper cut that fits, measured in turn (ranks:
    rank 0's). The last cut's refusal is raised."""
    while True:
        layers, vocab = options[min(choice, len(options) - 1)]
        cut_cfg = _recut(cfg, rt, layers, vocab)
        try:
            out, short = resolve_budget(cut_cfg, rt, rates_fn, act_fn), None
        except PoolsOverBudget as exc:
            out, short = None, exc
        deeper = short is not None and choice + 1 < len(options)
        if agree is not None:  # every rank asks, every round: rank 0's answer
            deeper = agree(deeper)
        if not deeper:
            if out is None:
                raise short  # type: ignore[misc]
            return out
        choice += 1


def _ranges_off(cfg: Config, rt) -> str:
    """Why the planner could not cut a mixture of experts' experts into ranges, where another
    setting would let it ('' where nothing would): the compute dtype, or adapters on them."""
    if cfg.model.layer_pieces is not None or not any(is_moe_layer(getattr(b, "layer", b)) for b in rt.model.blocks):
        return ""
    if rt.adapters is not None and rt.adapters.on_experts:
        return "adapters on the experts (adapter.target_parameters) need them whole, so they were not cut into ranges"
    if rt.dtype != torch.float32 and max(cut_options(rt.model, dtype=torch.float32), default=0) > 2:
        return (
            f"its experts cut into ranges would fit more, but not in {rt.dtype} (ranges carry its routing weights, "
            "float32 in this model, as compute-dtype values): train in float32 (train.param_dtype = 'float32') to let "
            "the planner cut them"
        )
    return ""


def _cuts(cfg: Config, rt) -> list[tuple[int | None, int | None]]:
    """The cuts to try, in order, after the model as configured: ``(layer_pieces, vocab_pieces)``
    (a vocabulary unset: cut as ``_recut`` finds it needs)."""
    m = cfg.model
    out: list[tuple[int | None, int | None]] = []
    vocab = _auto_vocab(cfg, rt) if m.vocab_pieces is None else None
    if vocab is not None:
        out.append((m.layer_pieces, vocab))
    if m.layer_pieces is None and rt.model.layer_parts == 1:
        # adapters on the experts need them whole: ranges of experts are not an option then
        whole_experts = rt.adapters is not None and rt.adapters.on_experts
        out += [(p, m.vocab_pieces) for p in cut_options(rt.model, ranges=not whole_experts, dtype=rt.dtype)]
    return out


def _recut(cfg: Config, rt, layers: int | None, vocab: int | None) -> Config:
    """``cfg`` with the model cut into ``layers`` sub-layer units and ``vocab`` pieces (unset:
    the fewest pieces no larger than the largest unit, where the matrix is larger), ``rt``'s
    model rebuilt for it."""
    cut = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layer_pieces=layers, vocab_pieces=vocab))
    rt.recut(cut)
    if layers and vocab is None:
        pieces = _auto_vocab(cut, rt)
        if pieces is not None:
            cut = dataclasses.replace(cut, model=dataclasses.replace(cut.model, vocab_pieces=pieces))
            rt.recut(cut)
    return cut


def _auto_vocab(cfg: Config, rt) -> int | None:
    """The pieces the planner cuts ``rt``'s (uncut) vocabulary into (``auto_pieces``); with
    8-bit optimizer states on it, the fewest from there whose pieces start on bitsandbytes'
    blocks (an even count off the blocks was refused by the runtime, which the planner's own
    choice must not be)."""
    from ..models import auto_pieces
    from ..models.pieces import aligned_count

    pieces = auto_pieces(rt.model)
    if pieces is None or cfg.optim.name != "adamw8bit" or cfg.adapter.on:
        return pieces
    vocab, dim = getattr(rt.model.embed, rt.model.embed.TOKENS).weight.shape
    return aligned_count(vocab, dim, pieces, BLOCK) or pieces  # none: the runtime's refusal names the cut


def _short(cfg: Config, rt, rates_fn, act_fn, *, measure: bool = True) -> tuple[str, Any]:
    """Why the budget cannot hold ``cfg``'s units ('' where it can) and, where it can and
    ``measure``, the resolved budget."""
    why = _device_short(cfg, rt)
    if why:
        return why, None
    try:
        if not measure:
            pools_fit_unmeasured(cfg, rt)
            return "", None
        return "", resolve_budget(cfg, rt, rates_fn, act_fn)
    except PoolsOverBudget as exc:
        return one_line(exc), None


def _device_short(cfg: Config, rt) -> str:
    """Why the GPU cannot hold the run's fixed device buffers (slots, gradient buffers and
    accumulators, by the largest unit), or ''."""
    if not rt.dev.cuda:
        return ""
    m, unit = cfg.memory, rt.layout.max_unit_numel * rt.dtype.itemsize
    need = (m.device_slots + GradStore.buffers_for(rt.layout)) * unit + GradStore.accum_bytes_for(
        rt.layout, accum_dtype_of(cfg, rt.dtype)
    )
    budget = m.device_mib * MIB if m.device_mib is not None else int(0.9 * torch.cuda.mem_get_info(rt.dev.device)[0])
    if need <= budget:
        return ""
    return (
        f"the device's slots and gradient buffers need {need / GIB:.2f} GiB by the largest unit, "
        f"{budget / GIB:.2f} GiB are there"
    )
