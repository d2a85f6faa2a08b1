"""Plain PyTorch training: the reference tiertrain's numerics are measured against (parity
tests) and its speed is compared with (benchmarks). The whole model in memory, micro-batch-
major gradient accumulation, ``clip_grad_norm_`` and torch's fused AdamW (or SGD)."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

from .config import Config
from .data import open_corpus
from .models import hf_config_from
from .models.gpt import build_gpt
from .update.adamw8bit import plain_optimizer
from .update.lr import lr_at

__all__ = ["HFWrapper", "reference_model", "weights_of", "reference_train", "optimizer_step"]


class HFWrapper(nn.Module):
    """An HF causal LM called the way tiertrain's head computes the loss."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x, y, divisor=None, positions=None, attention=None):
        """``attention``: padded rows' masks of their own tokens, counted where the model's
        auxiliary loss counts a padding collator's attention_mask (a mixture of experts: its
        pads left out); its attention is computed as without one (right-padded causal rows: the
        rows' own tokens never see a pad), so that the kernels are tiertrain's."""
        with _aux_counts(self.hf, attention):
            return self.hf(
                input_ids=x, position_ids=positions, labels=y, shift_labels=y, num_items_in_batch=divisor
            ).loss


@contextlib.contextmanager
def _aux_counts(hf: nn.Module, attention):
    """Within: ``hf``'s auxiliary loss (its modeling module's ``load_balancing_loss_func``, which
    its forward calls) given ``attention`` as its attention_mask, where both are there."""
    import sys

    module = sys.modules[type(hf).__module__]
    fn = getattr(module, "load_balancing_loss_func", None)
    if attention is None or fn is None or not getattr(hf.config, "output_router_logits", False):
        yield
        return
    setattr(module, "load_balancing_loss_func", lambda logits, n, k, mask=None: fn(logits, n, k, attention))
    try:
        yield
    finally:
        setattr(module, "load_balancing_loss_func", fn)


def _loss(model: nn.Module, x, y, scored, positions, attention):
    """A micro-batch's loss; padded rows' ``attention`` for a transformers model (the built-in
    GPT has no auxiliary loss to count it in)."""
    if isinstance(model, HFWrapper):
        return model(x, y, scored, positions, attention)
    return model(x, y, scored, positions)


def reference_model(cfg: Config, seed: int = 0) -> nn.Module:
    """A real (in-memory) model of the configured kind, with PyTorch's/HF's own init."""
    torch.manual_seed(seed)
    m = cfg.model
    if m.kind == "gpt":
        return build_gpt(
            vocab_size=m.vocab_size,
            d_model=m.d_model,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            d_ff=m.d_ff,
            max_seq_len=m.max_seq_len,
            tie_embeddings=m.tie_embeddings,
            dropout=m.dropout,
        )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config_from(m))
    return HFWrapper(hf)


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Initial weights to hand to tiertrain: our names for the built-in GPT, HF names otherwise."""
    inner = model.hf if isinstance(model, HFWrapper) else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def reference_train(cfg: Config, model: nn.Module, *, mixed: bool = False, accum_fp32: bool = False, ranks: int = 1):
    """Train ``model`` plainly: micro-batch-major accumulation, clip_grad_norm_, fused AdamW.

    ``mixed``: bf16 model with fp32 master weights (the reference for bf16 runs);
    ``accum_fp32``: its gradients summed over micro-batches in fp32, rounded once;
    ``ranks``: data parallelism done in one process, in the grouping sharded training sums in:
    each rank's micro-batches (``Corpus.batches(step, rank=r, world=ranks)``, losses divided
    by ``ranks x M``) accumulated on their own, then the ranks' sums added in rank order.
    Returns (per-micro-batch losses per step, every rank's in rank order; final fp32 weights
    by name).
    """
    if ranks > 1:
        return _reference_ranks(cfg, model, ranks)
    corpus = open_corpus(cfg.data)
    o, M = cfg.optim, cfg.data.micro_batches
    model = copy.deepcopy(model)
    _freeze(model, cfg.train.freeze)
    trained = [p for p in model.parameters() if p.requires_grad]  # train.freeze: the rest stays
    if mixed:
        master = [p.detach().clone().float() for p in trained]
        model.to(torch.bfloat16)
        opt_params = [nn.Parameter(w) for w in master]
    else:
        opt_params = trained
    opt = plain_optimizer(o, opt_params)
    losses = []
    torch.manual_seed(cfg.train.seed)  # dropout's draws, as the trainer seeds them after initialising
    for step in range(cfg.train.steps):
        step_losses = []
        acc = None
        scored = corpus.scored(step)  # masked data: each micro-batch's summed loss over the step's scored tokens
        positions = corpus.positions(step) or [None] * M  # packed rows: attention within each document
        own = corpus.attention(step) or [None] * M  # padded rows: their own tokens
        for (x, y), pos, att in zip(corpus.batches(step), positions, own):
            loss = _loss(model, x, y, scored, pos, att)
            (loss if scored else loss / M).backward()
            step_losses.append(loss.item())
            if accum_fp32:
                grads = [p.grad.float() for p in trained]
                acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
                model.zero_grad(set_to_none=True)
        losses.append(step_losses)
        if accum_fp32:
            for p, a in zip(trained, acc):
                p.grad = a.to(p.dtype)
        optimizer_step(opt, trained, opt_params, o, step, cfg.train.steps, mixed=mixed)
        model.zero_grad(set_to_none=True)
    inner = model.hf if isinstance(model, HFWrapper) else model
    if mixed:
        master_of = {id(p): w for p, w in zip(trained, opt_params)}  # frozen: their own, upcast
        return losses, {n: master_of.get(id(p), p).detach().float() for n, p in inner.named_parameters()}
    return losses, {k: v.detach().float() for k, v in inner.state_dict().items()}


def optimizer_step(opt, trained: list, opt_params: list, o, step: int, total_steps: int, *, mixed: bool) -> None:
    """Plain PyTorch's update of step ``step`` (0-based) after its backward: ``clip_grad_norm_``
    over the ``trained`` parameters' gradients, (``mixed``) their fp32 copies given to the fp32
    master weights ``opt_params``, the schedule's learning rate, the optimizer's step, then the
    master weights copied back into the (bf16) model; every gradient set to None."""
    if o.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(trained, o.grad_clip)
    if mixed:
        for p, w in zip(trained, opt_params):
            w.grad = p.grad.float()
    for g in opt.param_groups:
        g["lr"] = lr_at(step + 1, o, total_steps)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for p in trained:
        p.grad = None
    if mixed:
        with torch.no_grad():
            for p, w in zip(trained, opt_params):
                p.copy_(w)


def _freeze(model: nn.Module, selectors: list[str]) -> None:
    """``train.freeze`` on the reference: its units' parameters stop requiring gradients, found
    through the same unit view of the model tiertrain takes."""
    if not selectors:
        return
    from .models.freeze import apply_freeze
    from .models.hf import layer_hf

    if isinstance(model, HFWrapper):
        hf = model.hf
        layered = layer_hf(hf)
        apply_freeze(layered, selectors)
    else:
        apply_freeze(model, selectors)  # the built-in GPT: a LayeredModel already


def _reference_ranks(cfg: Config, model: nn.Module, ranks: int):
    """``reference_train`` with ``ranks`` ranks (fp32, no accumulators)."""
    corpus = open_corpus(cfg.data)
    o, M = cfg.optim, cfg.data.micro_batches
    model = copy.deepcopy(model)
    _freeze(model, cfg.train.freeze)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = plain_optimizer(o, params)
    losses = []
    torch.manual_seed(cfg.train.seed)
    for step in range(cfg.train.steps):
        step_losses, total = [], None
        for r in range(ranks):
            scored = corpus.scored(step, ranks)
            positions = corpus.positions(step, rank=r, world=ranks) or [None] * M
            own = corpus.attention(step, rank=r, world=ranks) or [None] * M
            for (x, y), pos, att in zip(corpus.batches(step, rank=r, world=ranks), positions, own):
                loss = _loss(model, x, y, scored, pos, att)
                (loss if scored else loss / (ranks * M)).backward()
                step_losses.append(loss.item())
            sums = [p.grad.clone() for p in params]
            model.zero_grad(set_to_none=True)
            if total is None:
                total = sums
            else:
                for t, g in zip(total, sums):
                    t += g  # rank order, as the ranks' reduce-scatter adds them
        losses.append(step_losses)
        for p, g in zip(params, total):
            p.grad = g
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step + 1, o, cfg.train.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
    inner = model.hf if isinstance(model, HFWrapper) else model
    return losses, {k: v.detach().float() for k, v in inner.state_dict().items()}
