"""The layer-major executor (SpeedLoader's schedule): one training step.

Forward: for each unit in order, its parameters are fetched once and all ``M``
micro-batches go through it; each block's input is stashed for the backward. The head
runs forward and backward per micro-batch right away (its loss is divided by ``M``, as
gradient accumulation in plain PyTorch does), producing ``dh`` for every micro-batch.
Backward: for each unit in reverse, its parameters are fetched once more; each
``(unit, micro-batch)`` whose autograd graph was kept from the forward (within
``memory.keep_act_mib``, see ``activations/keep.py``) is back-propagated through it; the
others are recomputed from their stashed input, with the RNG state of their forward
restored. Parameter gradients accumulate in the unit's gradient buffer in micro-batch
order. ``M = 1`` is ordinary training.

Every ``(unit, micro-batch)`` is its own small autograd graph: input detached with
``requires_grad``, output gradient fed in by the executor. The forward runs with grad
enabled (and drops the graph) so that it takes exactly the kernels that the recompute,
and plain PyTorch, take.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import faults
from ..activations.keep import KeptGraphs
from ..activations.stash import HiddenStash
from ..models.base import LayeredModel
from ..state.device import Device
from ..state.grads import GradStore
from ..state.store import ParamStore

__all__ = ["LayerMajorExecutor", "StepOutput"]


@dataclass
class StepOutput:
    loss: float  # mean of the micro-batch losses
    losses: list[float]
    tokens: int
    forward_s: float
    backward_s: float


class _Rng:
    """The RNG state(s) before a unit's forward, to replay dropout in the recompute."""

    def __init__(self, cuda: bool) -> None:
        self.cpu = torch.get_rng_state()
        self.gpu = torch.cuda.get_rng_state() if cuda else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.gpu is not None:
            torch.cuda.set_rng_state(self.gpu)


class LayerMajorExecutor:
    def __init__(
        self,
        model: LayeredModel,
        params: ParamStore,
        grads: GradStore,
        stash: HiddenStash,
        dev: Device,
        keep_bytes: int = 0,
    ) -> None:
        self.model, self.params, self.grads, self.stash, self.dev = model, params, grads, stash, dev
        self.n = model.n_units
        self.lookahead = len(params.slots) - 1
        self._flats: dict[int, torch.Tensor] = {}  # bound units' flat parameter buffers
        self.kept = KeptGraphs(keep_bytes, self._flats.__getitem__)
        self.recomputed = 0  # (block, micro-batch) pairs recomputed in the last step

    # -- parameter residency ------------------------------------------------------------------------
    def _acquire(self, u: int, upcoming: list[int]) -> None:
        for x in (*self.params.layout.units[u].borrows, u):
            self._flats[x] = self.params.acquire(x)
        self.params.prefetch(upcoming[: self.lookahead])

    def _release(self, u: int) -> None:
        for x in (u, *self.params.layout.units[u].borrows):
            self.params.release(x)
            self._flats.pop(x, None)

    # -- one step --------------------------------------------------------------------------------------
    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOutput:
        M, L = len(batches), self.n - 2
        self.model.train()
        ids = [x.to(self.dev.device, non_blocking=True) for x, _ in batches]
        tgt = [y.to(self.dev.device, non_blocking=True) for _, y in batches]
        rng: dict[tuple[int, int], _Rng] = {}
        self.kept.clear()  # nothing survives a step that failed half-way
        t0 = time.perf_counter()
        order = list(range(self.n))

        # forward: embed, then blocks, each fetched once for all micro-batches
        self._acquire(0, order[1:])
        cur = []
        for m in range(M):
            rng[0, m] = _Rng(self.dev.cuda)
            with torch.enable_grad():
                cur.append(self.model.embed(ids[m]).detach())
        self._release(0)
        for b in range(L):
            u = b + 1
            self._acquire(u, order[u + 1 :])
            nxt = []
            units = (*self.params.layout.units[u].borrows, u)
            for m in range(M):
                faults.point("forward")
                rng[u, m] = _Rng(self.dev.cuda)
                if self.kept.budget > 0:
                    out, kept = self.kept.forward((b, m), units, self.model.blocks[b], cur[m])
                else:
                    with torch.enable_grad():
                        out, kept = self.model.blocks[b](cur[m]).detach(), False
                if not kept:  # recomputed in the backward from its stashed input
                    self.stash.put(b * M + m, cur[m])
                nxt.append(out)
            self._release(u)
            cur = nxt

        # head: forward and backward per micro-batch
        head = self.n - 1
        self._acquire(head, list(range(L, -1, -1)))
        self.grads.begin(head)
        dh, losses = [], []
        for m in range(M):
            x = cur[m].requires_grad_()
            loss = self.model.head(x, tgt[m])
            (loss / M).backward()
            dh.append(x.grad)
            losses.append(loss.detach())
        cur = None
        self.grads.end(head)
        self._release(head)
        after_forward = _Rng(self.dev.cuda)
        t1 = time.perf_counter()

        # backward: blocks in reverse, then the embedding, each fetched once more
        self.recomputed = 0
        for b in range(L - 1, -1, -1):
            u = b + 1
            self._acquire(u, list(range(u - 1, -1, -1)))
            self.grads.begin(u)
            for m in range(M):
                if b > 0 and (b - 1, m) not in self.kept:
                    self.stash.prefetch((b - 1) * M + m)
                faults.point("backward")
                if (b, m) in self.kept:
                    dh[m] = self.kept.backward((b, m), dh[m])
                    continue
                self.recomputed += 1
                x = self.stash.get(b * M + m).detach().requires_grad_()
                rng[u, m].restore()
                out = self.model.blocks[b](x)
                torch.autograd.backward(out, dh[m])
                dh[m] = x.grad
                self.stash.free(b * M + m)
            self.grads.end(u)
            self._release(u)
        self._acquire(0, [])
        self.grads.begin(0)
        for m in range(M):
            rng[0, m].restore()
            out = self.model.embed(ids[m])
            torch.autograd.backward(out, dh[m])
        self.grads.end(0)
        self._release(0)
        after_forward.restore()  # the replays rewound the RNG; plain training only draws in the forward
        t2 = time.perf_counter()

        values = [float(v) for v in losses]  # sync point: losses to the host
        tokens = sum(int(x.numel()) for x in ids)
        return StepOutput(sum(values) / M, values, tokens, t1 - t0, t2 - t1)
