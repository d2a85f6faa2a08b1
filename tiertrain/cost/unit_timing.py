"""The compute probe's clock on the executor's own unit steps.

``time_unit_steps`` runs ``LayerMajorExecutor.embed_forward``, ``block_forward``,
``head_step``, ``block_backward`` and ``embed_backward`` (the methods a training step calls,
the cut vocabulary's pieces and the activation policy included) on one micro-batch of the
run's shape, through stand-ins for the stores: random parameters made on first use, gradient
buffers that are zeroed and normed as the gradient store does, a stash in memory. What the
cost model predicts from is then the time of the code that runs, not of a copy of it.

Units alike in size share one parameter buffer and one gradient buffer (the blocks timed,
the vocabulary's pieces): the probe holds one unit of each kind, never a whole model or a
whole vocabulary matrix.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from ..activations.policy import ActivationPolicy
from ..execute.executor import LayerMajorExecutor, MicroBatch, used_pieces, visits
from ..execute.loss import LossScale

__all__ = ["time_unit_steps", "LONG_PASS_S"]

log = logging.getLogger("tiertrain")

# A warm-up pass longer than this (large units computed by a CPU: a 70 B layer's pieces at 4,096
# tokens, a Llama 4 Scout layer's every expert on every token take minutes) is followed by one
# timed pass, not ``repeats``: a plan's wait is two passes, not three. The warm-up is still not a
# measurement: a first pass ran 20-30% slower than the next on a 2 x 4096 Llama block at 1,024
# tokens (first touches of the activations' memory), its units' buffers drawn before it.
LONG_PASS_S = 10.0


class _Params:
    """The calls the unit walker makes on a parameter store, over random parameters."""

    def __init__(self, layout, dev, dtype: torch.dtype) -> None:
        self.layout, self.dev, self.dtype = layout, dev, dtype
        self.slots = (None, None)  # the walker looks one visit ahead; nothing is fetched here
        self._buf: dict[int, torch.Tensor] = {}
        self._saved: dict[int, list[torch.Tensor]] = {}

    def acquire(self, u: int) -> torch.Tensor:
        rec = self.layout.units[u]
        if u not in self._saved:
            self._saved[u] = [p.param.data for p in rec.params]
        n = rec.numel
        if n not in self._buf:  # drawn in place in its dtype: no unit-sized temporaries
            self._buf[n] = torch.randn(n, device=self.dev.device, dtype=self.dtype).mul_(0.02)
        self.layout.bind(u, self._buf[n])
        return self._buf[n]

    def prefetch(self, units: list[int]) -> None:
        pass

    def release(self, u: int) -> None:
        pass

    def close(self) -> None:
        """Put the model's placeholders back (no parameter memory, no gradient)."""
        for u, data in self._saved.items():
            self.layout.bind_grads(u, None)
            for rec, d in zip(self.layout.units[u].params, data):
                rec.param.data = d
        self._saved.clear()
        self._buf.clear()


class _Grads:
    """The gradient store's calls: buffers bound zeroed at ``begin``, normed at ``end``; none
    for a frozen unit (as ``GradStore``: its parameters form no gradient, and a frozen base's
    probe holds no unit-sized buffers it never uses)."""

    def __init__(self, layout, dev, dtype: torch.dtype) -> None:
        self.layout, self.dev, self.dtype = layout, dev, dtype
        # as GradStore's default (train.grad_accum_dtype): float32 sums under narrower gradients
        self.accum_dtype = None if dtype == torch.float32 else torch.float32
        self._buf: dict[int, torch.Tensor] = {}

    def begin(self, u: int, bind: bool = True) -> None:
        for x in (u, *self.layout.units[u].borrows):
            if self.layout.units[x].frozen:
                continue
            n = self.layout.units[x].numel
            buf = self._buf.get(n)
            if buf is None:
                buf = self._buf[n] = torch.zeros(n, device=self.dev.device, dtype=self.dtype)
            buf.zero_()
            if bind:
                self.layout.bind_grads(x, buf)

    def views(self, u: int) -> list[torch.Tensor] | None:
        if self.layout.units[u].frozen:
            return None
        buf = self._buf[self.layout.units[u].numel]
        return [rec.view(buf) for rec in self.layout.units[u].params]

    def fold(self, units: tuple[int, ...]) -> None:
        pass

    def end(self, u: int) -> None:
        if self.layout.units[u].frozen:
            return
        buf = self._buf[self.layout.units[u].numel]
        views = [rec.view(buf) for rec in self.layout.units[u].params]
        if views:
            torch._foreach_norm(views, 2, dtype=None if self.dtype == torch.float32 else torch.float32)
        self.layout.bind_grads(u, None)


class _Stash:
    """Block inputs kept for the recompute, in memory."""

    def __init__(self) -> None:
        self._d: dict = {}

    def put(self, key, x: torch.Tensor) -> None:
        self._d[key] = x

    def get(self, key) -> torch.Tensor:
        return self._d[key]

    def free(self, key) -> None:
        self._d.pop(key, None)

    def prefetch(self, key) -> None:
        pass


class _KeepFirst(ActivationPolicy):
    """The first ``n`` blocks keep their graphs (their backward is timed); the rest recompute."""

    def __init__(self, n: int) -> None:
        self.n = n

    @property
    def wants_graphs(self) -> bool:
        return self.n > 0

    def keep(self, block: int, micro_batch: int, nbytes: int, kept_bytes: int) -> bool:
        return block < self.n


def time_unit_steps(
    cfg,
    model,
    layout,
    dev,
    dtype: torch.dtype,
    hidden: int,
    *,
    blocks: int,
    keep: int,
    blocks_only: bool = False,
    repeats: int = 2,
) -> dict[str, float]:
    """Seconds per micro-batch of the embedding's forward and backward, one block's forward and
    (graph kept) backward, and the head's forward + backward, as the executor runs them: the
    medians of ``repeats`` passes after one warm-up (one pass where the warm-up took more than
    ``LONG_PASS_S``). ``blocks``: how many blocks a pass runs
    (a few time one as well as all do); ``keep``: how many of them keep their graph (at least
    one). ``blocks_only``: the blocks alone (no embedding or head times)."""
    d = cfg.data
    refs = [r for r in model.plan if r.role == "block"][:blocks]
    timed_blocks = {r.index for r in refs}
    sub = [r for r in model.plan if r.role != "block" or r.index in timed_blocks]
    params, grads = _Params(layout, dev, dtype), _Grads(layout, dev, dtype)
    ex = LayerMajorExecutor(model, params, grads, _Stash(), dev, keep_bytes=1 << 62, policy=_KeepFirst(max(keep, 1)))
    vocab = (
        ex.embed_pieces[0].module.num_embeddings
        if ex.embed_pieces
        else getattr(model.embed, model.embed.TOKENS).num_embeddings
    )
    ids = torch.randint(0, vocab, (d.micro_batch_size, d.seq_len))  # in the first piece if cut
    mb = MicroBatch(ids.to(dev.device), ids.to(dev.device), torch.arange(d.seq_len, device=dev.device))
    ex.scale = LossScale(1)
    ex.pieces_used = used_pieces(ex.embed_pieces, [ids])
    order = visits(sub, ex.pieces_used)
    if blocks_only:  # the blocks forward, then backward (the embedding's visit only ends the walk)
        order = [*refs, *reversed(refs), ex.embed]
    ex.policy.begin_step(len(refs), 1, ex.kept.budget)

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        dev.synchronize()
        return out, time.perf_counter() - t0

    def one_pass() -> dict[str, float]:
        ex.walk.restart(order)
        ex.kept.clear()
        t: dict[str, float] = {"block_fwd_s": 0.0, "block_bwd_s": 0.0}
        if blocks_only:
            h = [torch.randn(d.micro_batch_size, d.seq_len, hidden, device=dev.device).to(dtype)]
        else:
            h, t["embed_fwd_s"] = timed(lambda: ex.embed_forward([mb]))
        for ref in refs:
            h, s = timed(lambda ref=ref, h=h: ex.block_forward(ref, h, [mb]))
            t["block_fwd_s"] += s / len(refs)
        if blocks_only:
            dh = [torch.randn_like(h[0]) * 1e-3]
        else:
            (dh, _), t["head_s"] = timed(lambda: ex.head_step(h, [mb]))
        kept = 0
        for ref in reversed(refs):
            was_kept = (ref.block, 0) in ex.kept
            dh, s = timed(lambda ref=ref, dh=dh: ex.block_backward(ref, dh, [mb]))
            if was_kept:  # a recomputed block's backward holds its forward again: not timed here
                t["block_bwd_s"] += s
                kept += 1
        t["block_bwd_s"] /= max(kept, 1)
        if not blocks_only:
            _, t["embed_bwd_s"] = timed(lambda: ex.embed_backward(dh, [mb]))
        return t

    was, routers = model.training, model.routers
    model.train()  # dropout as in training
    # a pass runs a few of the blocks: a mixture of experts' auxiliary loss, a function of every
    # block's router logits, is left out of the head's time (it is small: tokens x experts a block)
    model.routers = None
    try:
        for ref in order:  # every unit's buffers drawn before the clock runs
            params.acquire(ref.index)
            grads.begin(ref.index, bind=False)
        t0 = time.perf_counter()
        one_pass()  # warm-up (allocator, kernels, first touches)
        took = time.perf_counter() - t0
        if took > LONG_PASS_S:
            log.info("compute probe: a pass took %.0f s; one more timed, not %d", took, repeats)
            repeats = 1
        runs = [one_pass() for _ in range(repeats)]
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    finally:
        model.train(was)
        model.routers = routers
        ex.kept.clear()
        params.close()
