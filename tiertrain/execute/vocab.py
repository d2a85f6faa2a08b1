"""The executor's unit steps for a vocabulary cut into pieces (``models/pieces.py``).

- Embedding forward: each piece the step's tokens use gathers its rows into the token
  embeddings of every micro-batch (pieces no token uses are not read); then the embed unit
  (positions, dropout) finishes them.
- Head: the norm of every micro-batch's hidden states; pass 1 over the pieces: each
  piece's logits (fp32) update an online log-sum-exp per token and give the target's
  logit where the target is in the piece; the loss is ``mean(lse - target logit)``, the
  mean cross-entropy. Pass 2 over the pieces in reverse: each piece's logits again, their
  gradient ``(softmax - onehot) / (tokens x M)`` (the loss divided by ``M`` as gradient
  accumulation does) backpropagated into the piece's weights and, summed in fp32 over the
  pieces, into the norm's output; then the norm's backward. Memory: one piece's logits of
  one micro-batch at a time, never the whole vocabulary's.
- Embedding backward: the embed unit's backward gives the tokens' gradient (``finish`` is
  affine in the token embeddings, so it is replayed on zeros: its gradient does not depend
  on them); each piece then adds its tokens' gradients into its rows. No piece is read:
  the gradient of a gather needs no weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .rng import UnitRng

IGNORE = -100  # masked targets (data/examples.py)

__all__ = ["VocabSteps", "used_pieces", "piece_logsumexp", "piece_backward"]


def _no_cap(logits: torch.Tensor) -> torch.Tensor:
    return logits


def piece_logsumexp(
    piece, x: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, picked: torch.Tensor, cap=_no_cap
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of one head piece on one micro-batch's normed hidden states ``x`` (``[N, d]``):
    the running log-sum-exp and target logits (``[N]``, fp32) with this piece's logits (after
    ``cap``, what the model does to its logits: ``head.cap_logits``)."""
    with torch.no_grad():
        logits = cap(piece(x)).float()
    inside, cols = _in_piece(piece, targets)
    return (
        torch.logaddexp(lse, torch.logsumexp(logits, dim=-1)),
        torch.where(inside, logits.gather(1, cols).squeeze(1), picked),
    )


def piece_backward(
    piece,
    x: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    divisor: int,
    scored: torch.Tensor | None = None,
    cap=_no_cap,
) -> torch.Tensor:
    """Pass 2 of one head piece on one micro-batch: the gradient of ``sum(cross-entropy) /
    divisor`` into the piece's weights (their ``.grad``), and the one into ``x`` returned;
    ``scored``: which tokens count (masked targets: the others' rows of the gradient zero);
    ``cap``: as pass 1's (its backward taken through)."""
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        logits = cap(piece(x))
    g = torch.exp(logits.detach().float() - lse.unsqueeze(1))
    inside, cols = _in_piece(piece, targets)
    g.scatter_add_(1, cols, -inside.unsqueeze(1).to(g.dtype))  # minus the one-hot target
    if scored is not None:
        g *= scored.unsqueeze(1)
    g /= divisor
    torch.autograd.backward(logits, g.to(logits.dtype))
    return x.grad


def used_pieces(pieces: list, ids: list[torch.Tensor]) -> list:
    """The embedding pieces (``UnitRef``s) some token of ``ids`` falls in, in order."""
    if not pieces:
        return []
    starts = torch.tensor([r.module.start for r in pieces])
    hit = torch.zeros(len(pieces), dtype=torch.bool)
    for x in ids:  # host tensors: no device sync
        hit[torch.bucketize(x.reshape(-1), starts, right=True) - 1] = True
    return [r for r, h in zip(pieces, hit.tolist()) if h]


class VocabSteps:
    """Mixed into ``LayerMajorExecutor``: its ``embed_forward``, ``head_step`` and
    ``embed_backward`` for a cut model."""

    if TYPE_CHECKING:  # what the executor it is mixed into provides (executor.py)
        model: Any
        dev: Any
        grads: Any
        embed: Any
        head: Any
        embed_pieces: list[Any]
        head_pieces: list[Any]
        pieces_used: list[Any]
        scale: Any
        _rng: dict[tuple[int, int], Any]

        def _units(self, ref: Any) -> tuple[int, ...]: ...
        def _acquire(self, ref: Any) -> None: ...
        def _release(self, ref: Any) -> None: ...
        def _with_aux(self, loss: Any, m: int, mb: Any, *, backward: bool) -> Any: ...

    @property
    def _cap(self):
        """What the model does to its logits after the projection (``head.cap_logits``)."""
        return self.model.head.cap_logits

    def _cut_embed_forward(self, mbs) -> list[torch.Tensor]:
        tokens: list[torch.Tensor] = []
        for ref in self.pieces_used:
            self._acquire(ref)
            piece = ref.module
            if not tokens:
                tokens = [
                    torch.empty(*mb.ids.shape, piece.embedding_dim, dtype=piece.weight.dtype, device=mb.ids.device)
                    for mb in mbs
                ]
            for t, mb in zip(tokens, mbs):
                piece.gather_into(t, mb.ids)
            self._release(ref)
        ref, out = self.embed, []
        self._acquire(ref)
        for m, (t, mb) in enumerate(zip(tokens, mbs)):
            self._rng[ref.index, m] = UnitRng(self.dev)
            with torch.enable_grad():
                out.append(self.model.embed.finish(t, mb.positions).detach())
        self._release(ref)
        self._tokens_shape = tokens[0].shape, tokens[0].dtype
        return out

    def _cut_head_pass1(self, h: list[torch.Tensor], mbs):
        """The norm, then pass 1 over the pieces: (normed hidden states, targets, log-sum-exps,
        losses) per micro-batch."""
        head = self.model.head
        self._acquire(self.head)
        with torch.no_grad():
            hn = [head.hidden(x).reshape(-1, x.shape[-1]) for x in h]
        self._release(self.head)
        targets = [mb.targets.reshape(-1) for mb in mbs]
        lse = [torch.full((t.numel(),), float("-inf"), device=t.device) for t in targets]
        picked = [torch.zeros(t.numel(), device=t.device) for t in targets]
        for ref in self.head_pieces:  # pass 1: log-sum-exp and the targets' logits
            self._acquire(ref)
            for m, (x, t) in enumerate(zip(hn, targets)):
                lse[m], picked[m] = piece_logsumexp(ref.module, x, t, lse[m], picked[m], self._cap)
            self._release(ref)
        if self.scale.divisor:  # masked targets (ignore index): the sum over the scored ones, over the step's count
            return (
                hn,
                targets,
                lse,
                [((a - b) * (t != IGNORE)).sum() / self.scale.divisor for a, b, t in zip(lse, picked, targets)],
            )
        return hn, targets, lse, [(a - b).mean() for a, b in zip(lse, picked)]

    def _cut_head_loss(self, h: list[torch.Tensor], mbs) -> list[torch.Tensor]:
        """An evaluation's head: pass 1 alone."""
        return [
            self._with_aux(v, m, mb, backward=False)
            for m, (v, mb) in enumerate(zip(self._cut_head_pass1(h, mbs)[3], mbs))
        ]

    def _cut_head_step(self, h: list[torch.Tensor], mbs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        head = self.model.head
        hn, targets, lse, losses = self._cut_head_pass1(h, mbs)
        if self.model.routers is not None:  # the routers' auxiliary loss: its own backward, to their logits
            for m in range(len(losses)):
                losses[m] = self._with_aux(losses[m].detach(), m, mbs[m], backward=True)
                self.scale.share(losses[m]).backward()
                self.model.routers.collect()
        dhn = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in hn]
        for ref in reversed(self.head_pieces):  # pass 2: gradients
            self._acquire(ref)
            self.grads.begin(ref.index)
            for m, (x, t) in enumerate(zip(hn, targets)):
                if self.scale.divisor:
                    scored = (t != IGNORE).float()
                    dhn[m] += piece_backward(ref.module, x, t, lse[m], self.scale.divisor, scored, self._cap)
                else:
                    divisor = self.scale.token_divisor(t.numel())
                    dhn[m] += piece_backward(ref.module, x, t, lse[m], divisor, cap=self._cap)
                self.grads.fold(self._units(ref))
            self.grads.end(ref.index)
            self._release(ref)
        ref, dh = self.head, []
        self._acquire(ref)
        self.grads.begin(ref.index)
        for x, g in zip(h, dhn):  # the norm's backward
            x = x.detach().requires_grad_()
            with torch.enable_grad():
                y = head.hidden(x)
            torch.autograd.backward(y, g.view(y.shape).to(y.dtype))
            self.grads.fold(self._units(ref))
            dh.append(x.grad)
        self.grads.end(ref.index)
        self._release(ref)
        return dh, [v.detach() for v in losses]

    def _cut_embed_backward(self, dh: list[torch.Tensor], mbs) -> None:
        ref, dtokens = self.embed, []
        shape, dtype = self._tokens_shape
        self._acquire(ref)
        self.grads.begin(ref.index)
        for m, mb in enumerate(mbs):
            self._rng[ref.index, m].restore()
            t = torch.zeros(shape, dtype=dtype, device=mb.ids.device, requires_grad=True)
            with torch.enable_grad():
                out = self.model.embed.finish(t, mb.positions)
            torch.autograd.backward(out, dh[m])
            self.grads.fold(self._units(ref))
            dtokens.append(t.grad)
        self.grads.end(ref.index)
        self._release(ref)
        for ref in self.embed_pieces:  # unused pieces too: their gradient (zero, or the tied head's) goes home
            # a piece's rows are never read here (not in a slot): its gradient is added into the
            # buffer itself, not through .grad (a host placeholder refuses a device gradient)
            self.grads.begin(ref.index, bind=False)
            views = self.grads.views(ref.index)  # None: frozen
            for mb, g in zip(mbs, dtokens):
                if views:
                    ref.module.add_grad(views[0], mb.ids, g)
                self.grads.fold((ref.index,))
            self.grads.end(ref.index)


def _in_piece(piece, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each token's target is in ``piece``, and its column there (``[N, 1]``; 0
    where it is not). Masks, not indices: no device sync."""
    inside = (targets >= piece.start) & (targets < piece.start + piece.out_features)
    return inside, torch.where(inside, targets - piece.start, 0).unsqueeze(1)
