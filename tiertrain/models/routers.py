"""A mixture of experts' auxiliary load-balancing loss, across layers that run one at a time.

Where a model's config asks for it (``output_router_logits``), transformers adds to the loss
``router_aux_loss_coef x load_balancing_loss_func(router logits of every layer)``: one function
of all the layers' router logits together (its token counts and mean probabilities are taken
over every layer), per forward call, so per micro-batch. The layer-major schedule runs the
layers one at a time, so:

- in the forward, each block's router logits (its router's output, the one transformers
  records as ``router_logits``) are kept per (block, micro-batch), detached: ``N x experts``
  values, small beside the block's activations;
- at the head, the model's own ``load_balancing_loss_func`` runs on them (leaves with
  gradients) and is added to the micro-batch's loss as the model's forward adds it; its
  backward gives each layer's logits their share of the gradient;
- in each block's backward, a hook on the router logits of the block's graph (kept, offloaded
  or recomputed) adds that share to the gradient they get from the block's own output.

In plain PyTorch the router logits have exactly these two consumers (the routing and the
auxiliary loss), and autograd sums their two gradients; a sum of two is the same in either
order, so the gradients are plain PyTorch's bit for bit.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..errors import ConfigError

__all__ = ["RouterLoss", "router_loss", "describe_experts"]


class RouterLoss:
    """The auxiliary loss of a mixture-of-experts model whose config asks for it (``router_loss``).
    A layer may have several routers (JetMoE: its attention's and its MLP's): their logits are
    kept per (block, micro-batch, router), in the order the layer calls them, which is the order
    transformers records them in. A router is known by its module, not by how many routers the
    unit running has called: a layer cut into units calls them from different units (JetMoE's
    attention and its experts), and a recompute calls one unit's alone."""

    def __init__(
        self, hf: Any, layers: list[nn.Module], router_class: type, index: int, fn: Any, coef: tuple[str, float]
    ) -> None:
        self.coef_name, self.coef = coef  # the model's own name for it (JetMoE: aux_loss_coef)
        self.experts, self.top_k = hf.num_experts, hf.num_experts_per_tok
        self._fn, self._index = fn, index
        self._key: tuple[int, int] | None = None  # (block, micro-batch) of the forward running
        self.last: torch.Tensor | None = None  # the (weighted) auxiliary loss ``add`` added last
        self._record = False
        # per (block, micro-batch): (router's number in its layer, logits), in the order called
        self._logits: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
        self._grads: dict[tuple[int, int, int], torch.Tensor] = {}
        self._leaves: dict[tuple[int, int, int], torch.Tensor] = {}
        self.blocks = []
        self.count = 0  # routers in all: their logits are what a micro-batch keeps (JetMoE: two a block)
        for b, layer in enumerate(layers):
            routers = [m for m in layer.modules() if isinstance(m, router_class)]
            self.count += len(routers)
            for i, r in enumerate(routers):
                r.register_forward_hook(lambda mod, args, out, b=b, i=i: self._seen(b, i, out))
            if routers:
                self.blocks.append(b)

    @contextlib.contextmanager
    def at(self, block: int, micro_batch: int, *, record: bool = True) -> Iterator[None]:
        """Around a block's forward for a micro-batch: its router logits are kept (``record``;
        a recompute in the backward keeps none: the loss was made from the first) and their
        gradient hooks placed."""
        self._key, self._record = (block, micro_batch), record
        try:
            yield
        finally:
            self._key = None

    def _seen(self, block: int, router: int, out: Any) -> None:
        if self._key is None:  # generation, or a forward outside the schedule: no loss to feed
            return
        logits = out[self._index]
        key = (block, self._key[1], router)
        if self._record:  # a layer cut into units: only the one with the router records
            self._logits.setdefault((block, self._key[1]), []).append((router, logits.detach()))
        if logits.requires_grad:
            logits.register_hook(lambda g, key=key: self._add(key, g))

    def _add(self, key: tuple[int, int, int], grad: torch.Tensor) -> torch.Tensor:
        extra = self._grads.pop(key, None)
        return grad if extra is None else grad + extra

    def add(
        self,
        loss: torch.Tensor,
        micro_batch: int,
        *,
        backward: bool,
        weight: float = 1.0,
        attention: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``loss`` plus the auxiliary loss of ``micro_batch``'s router logits, as the model's
        forward adds it (``weight`` times that: an evaluation's share of a mean). ``backward``:
        their leaves take gradients (``collect`` after the backward); else the logits are
        dropped now (an evaluation). ``attention``: padded rows' ``[B, T]`` masks of their own
        tokens, the attention_mask the model's forward is given with a padding collator (its
        auxiliary loss counts no pad); None: every token (packed rows, text)."""
        missing = [b for b in self.blocks if not self._logits.get((b, micro_batch))]
        if missing:
            raise RuntimeError(f"router logits of blocks {missing} were not kept in the forward")
        keys, leaves = [], []
        for b in self.blocks:
            for i, t in self._logits.pop((b, micro_batch)):
                keys.append((b, micro_batch, i))
                leaves.append(t.requires_grad_(backward))
        if backward:
            self._leaves = dict(zip(keys, leaves))
        aux = self._fn(tuple(leaves), self.experts, self.top_k, attention)
        added = self.coef * aux.to(loss.device)  # as the model's forward: ``loss += coef * aux``
        if weight != 1.0:
            added = weight * added
        self.last = added.detach()  # what was added (an evaluation reports it apart)
        return loss + added

    def collect(self) -> None:
        """After the head's backward of a micro-batch: each router's share of the gradient,
        for its block's backward."""
        for key, leaf in self._leaves.items():
            if leaf.grad is not None:
                self._grads[key] = leaf.grad
        self._leaves = {}

    def clear(self) -> None:
        """Nothing of a step that failed half-way is fed to the next."""
        self._logits.clear()
        self._grads.clear()
        self._leaves = {}
        self._key = None


def router_loss(hf: Any, layers: list[nn.Module]) -> RouterLoss | None:
    """The auxiliary loss of ``hf`` where its config asks for it (``output_router_logits``) and
    its forward adds one (its modeling module's ``load_balancing_loss_func``), else None."""
    if not getattr(hf.config, "output_router_logits", False):
        return None
    fn = getattr(sys.modules[type(hf).__module__], "load_balancing_loss_func", None)
    recorders = getattr(type(hf.model), "_can_record_outputs", None) or {}
    rec = recorders.get("router_logits")
    # the coefficient as the model's forward reads it (JetMoE: aux_loss_coef)
    coef = next(((k, getattr(hf, k)) for k in ("router_aux_loss_coef", "aux_loss_coef") if hasattr(hf, k)), None)
    if fn is None or rec is None or coef is None:
        return None
    loss = RouterLoss(hf, layers, rec.target_class, rec.index, fn, coef)
    if not loss.count:  # (transformers' own forward fails inside its loss: an IndexError)
        raise ConfigError(
            "config.json asks for the routers' auxiliary loss (output_router_logits = true), but no layer of the "
            "model has a router (its mlp_only_layers / decoder_sparse_step leave every layer dense): set "
            "output_router_logits to false there"
        )
    return loss


def describe_experts(hf: Any, routers: RouterLoss | None) -> str:
    """A mixture of experts for the model line ('' for a dense model): experts, how many a token
    reaches, and whether the auxiliary loss is in the training loss, and why."""
    c = hf.config
    experts = next(
        (getattr(c, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(c, k, None)), 0
    )
    if not experts:
        return ""
    head = f"{experts} experts, {getattr(c, 'num_experts_per_tok', '?')} a token"
    if routers is not None:
        return f"{head}; the routers' auxiliary loss is in the loss ({routers.coef_name} {routers.coef:g})"
    if getattr(sys.modules[type(hf).__module__], "load_balancing_loss_func", None) is None:
        return f"{head}; this family's forward adds no auxiliary loss"
    if getattr(c, "output_router_logits", False):
        return f"{head}; no auxiliary loss: transformers records no router logits for it"
    return (
        f"{head}; no auxiliary loss: config.json's output_router_logits is false (as transformers computes it; "
        "set it true there to train with it)"
    )
