"""The layer-major executor (SpeedLoader's schedule): one training step, as unit steps.

``step`` walks the model's units (``LayeredModel.plan``, execution order) and runs one unit
step at a time, each over all ``M`` micro-batches while the unit's parameters are resident:

- ``embed_forward``: token embeddings of every micro-batch;
- ``block_forward``: one block; its graph is kept for the backward, sent to the storage
  tier (``activations/offload.py``) or dropped (the activation policy's choice,
  ``activations/policy.py``), and the block's input is stashed unless the graph is kept;
- ``head_step``: the head's forward and backward per micro-batch (its loss is divided by
  ``M``, as gradient accumulation in plain PyTorch does), producing ``dh`` per micro-batch;
- ``block_backward``: one block in reverse order, through the kept graph, the offloaded one
  read back (ahead, in this order), or a recompute from the stashed input with the RNG state
  of its forward restored;
- ``embed_backward``.

With the vocabulary cut into pieces (``models/pieces.py``) the embedding and the head are
walked piece by piece (``vocab.py``): the pieces the step's tokens use, then the rest of the
embed unit; the head's norm, its pieces twice (the cross-entropy's log-sum-exp, then the
gradients, in reverse so the last pieces are still in their slots) and the norm's backward.

``visits`` lists every unit a step acquires, in order: the prefetch follows it, and the cost
model (``cost/traffic.py``) replays it against the store's slots.

Parameter gradients accumulate in the unit's gradient buffer in micro-batch order. ``M = 1``
is ordinary training. Every ``(unit, micro-batch)`` is its own small autograd graph: input
detached with ``requires_grad``, output gradient fed in by the executor. The forward runs
with grad enabled (and drops the graph) so that it takes exactly the kernels that the
recompute, and plain PyTorch, take.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import faults
from ..activations.keep import KeptGraphs
from ..activations.offload import OffloadedGraphs
from ..activations.policy import ActivationPolicy, KeepLast
from ..activations.stash import HiddenStash
from ..device.core import Device
from ..models.base import LayeredModel, UnitRef
from ..state.grads import GradStore
from ..state.store import ParamStore
from .loss import LossScale
from .rng import UnitRng as _Rng
from .tied import TiedRows, tied_rows
from .vocab import VocabSteps, used_pieces
from .walk import UnitWalk

__all__ = ["LayerMajorExecutor", "StepOutput", "MicroBatch", "visits"]


def visits(
    plan: list[UnitRef], used: list[UnitRef] | None = None, *, forward_only: bool = False, embed_backward: bool = True
) -> list[UnitRef]:
    """The units one step acquires, in order; ``used``: the embedding's pieces the step's
    tokens use (None: all). Embedding pieces are not acquired in the backward (a gather's
    gradient needs no weights). ``forward_only``: an evaluation's (``evaluate``);
    ``embed_backward`` False: the embedding is frozen, the backward ends at the first block."""
    role = {}
    for r in plan:
        role.setdefault(r.role, []).append(r)
    embed, head, blocks = role["embed"][0], role["head"][0], role.get("block", [])
    pieces = role.get("head_piece", [])
    if not pieces:
        backward = [*reversed(blocks), *([embed] if embed_backward else [])]
        return [embed, *blocks, head] + ([] if forward_only else backward)
    used = role.get("embed_piece", []) if used is None else used
    forward = [*used, embed, *blocks, head, *pieces]
    backward = [*reversed(pieces), head, *reversed(blocks), *([embed] if embed_backward else [])]
    return forward if forward_only else [*forward, *backward]


@dataclass
class StepOutput:
    loss: float  # mean of the micro-batch losses (with a divisor: their sum, the mean over the step's scored tokens)
    losses: list[float]
    tokens: int
    forward_s: float
    backward_s: float


@dataclass
class MicroBatch:
    ids: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    # padded rows: the rows' own tokens (True), not their pads: what a mixture's auxiliary loss counts
    attention: torch.Tensor | None = None


class LayerMajorExecutor(VocabSteps):
    def __init__(
        self,
        model: LayeredModel,
        params: ParamStore,
        grads: GradStore,
        stash: HiddenStash,
        dev: Device,
        keep_bytes: int = 0,
        policy: ActivationPolicy | None = None,
        offloaded: OffloadedGraphs | None = None,
        after_unit: Callable[[], object] | None = None,
    ) -> None:
        """``after_unit``: called after every unit step releases its units (the trainer gives the
        freed heap back to the system there, ``memory.trim_heap``)."""
        self.model, self.params, self.grads, self.stash, self.dev = model, params, grads, stash, dev
        self.plan = model.plan
        self.embed = next(r for r in self.plan if r.role == "embed")
        self.head = next(r for r in self.plan if r.role == "head")
        self.blocks = [r for r in self.plan if r.role == "block"]
        self.embed_pieces = [r for r in self.plan if r.role == "embed_piece"]
        self.head_pieces = [r for r in self.plan if r.role == "head_piece"]
        self.pieces_used: list[UnitRef] = []  # the embedding pieces the last step's tokens use
        # train.freeze, adapters: a frozen embedding (its unit and its vocabulary pieces) forms no
        # gradient, and nothing before it needs one
        self.embed_trains = any(
            p.requires_grad for r in (self.embed, *self.embed_pieces) for p in r.module.parameters()
        )
        self.walk = UnitWalk(params, visits(self.plan, embed_backward=self.embed_trains))  # acquisitions, in order
        self.kept = KeptGraphs(keep_bytes, lambda u: self.walk.flats[u])
        self.policy = policy or KeepLast()
        self.offloaded = offloaded
        if offloaded is not None:
            offloaded.bind(lambda u: self.walk.flats[u])
        self.recomputed = 0  # (block, micro-batch) pairs recomputed in the last step
        self.kept_pairs = 0  # pairs whose graph was kept in the last step
        self._rng: dict[tuple[int, int], _Rng] = {}
        self.after_unit = after_unit
        self.scale = LossScale(1)  # the step's: how its micro-batches' losses make its loss (``step``)
        self.aux_weight = 1.0  # an evaluation's share of the auxiliary loss per micro-batch (``evaluate``)
        self.eval_aux: list = []  # an evaluation's auxiliary parts of its losses, per micro-batch
        self.tied_rows = tied_rows(model, grads)
        self._tied: TiedRows | None = None  # the step's, with several micro-batches

    # -- parameter residency ------------------------------------------------------------------------
    def _units(self, ref: UnitRef) -> tuple[int, ...]:
        """The units whose parameters ``ref`` uses: those it borrows (tied), then its own."""
        return self.walk.units(ref)

    def _acquire(self, ref: UnitRef) -> None:
        """Bind ``ref``'s units (the next visit of the step's order), then prefetch the next ones."""
        self.walk.enter(ref)

    def _release(self, ref: UnitRef) -> None:
        self.walk.leave(ref)
        if self.after_unit is not None:
            self.after_unit()

    def _routed(self, b: int, m: int, block, x: torch.Tensor, positions, *, record: bool = True) -> torch.Tensor:
        """Block ``b``'s forward for micro-batch ``m``; a mixture of experts' router logits kept
        for the auxiliary loss (``record``) and their gradient hook placed (``models/routers.py``)."""
        routers = self.model.routers
        layer = self.model.layer_of(b)  # layers cut into sub-layer units: the router's layer
        with routers.at(layer, m, record=record) if routers is not None else contextlib.nullcontext():
            return block(x, positions)

    def _with_aux(self, loss: torch.Tensor, m: int, mb: MicroBatch, *, backward: bool) -> torch.Tensor:
        """A micro-batch's loss with the routers' auxiliary loss added where the model has one
        (in an evaluation, ``aux_weight`` times it), over its rows' own tokens (padded rows)."""
        routers = self.model.routers
        weight = 1.0 if backward else self.aux_weight
        if routers is None:
            return loss
        total = routers.add(loss, m, backward=backward, weight=weight, attention=mb.attention)
        if not backward:  # an evaluation: its auxiliary part, reported apart from the cross-entropy
            self.eval_aux.append(routers.last)
        return total

    # -- unit steps ------------------------------------------------------------------------------------
    def embed_forward(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        if self.head_pieces:
            return self._cut_embed_forward(mbs)
        ref = self.embed
        self._acquire(ref)
        out = []
        for m, mb in enumerate(mbs):
            self._rng[ref.index, m] = _Rng(self.dev)
            with torch.enable_grad():
                out.append(self.model.embed(mb.ids, mb.positions).detach())
        self._release(ref)
        return out

    def block_forward(self, ref: UnitRef, h: list[torch.Tensor], mbs: list[MicroBatch]) -> list[torch.Tensor]:
        self._acquire(ref)
        units, block = self._units(ref), ref.module
        out = []
        for m, (x, mb) in enumerate(zip(h, mbs)):
            faults.point("forward")
            self._rng[ref.index, m] = _Rng(self.dev)
            fn = lambda t, mb=mb, m=m: self._routed(ref.block, m, block, t, mb.positions)  # noqa: E731
            if self.policy.offload(ref.block, m):
                if self.offloaded is None:
                    raise RuntimeError("the activation policy offloads a pair but no record file was planned")
                self.stash.put((ref.block, m), x)  # the record refers to its input in the stash
                out.append(self.offloaded.forward((ref.block, m), self.policy.slot(ref.block, m), units, fn, x))
                continue
            if self.policy.wants_graphs:
                keep = lambda nbytes, kept, b=ref.block, m=m: self.policy.keep(b, m, nbytes, kept)  # noqa: E731
                y, kept = self.kept.forward((ref.block, m), units, fn, x, keep)
            else:
                with torch.enable_grad():
                    y, kept = fn(x).detach(), False
            if not kept:  # recomputed in the backward from its stashed input
                self.stash.put((ref.block, m), x)
            self.kept_pairs += kept
            out.append(y)
        self._release(ref)
        return out

    def head_step(self, h: list[torch.Tensor], mbs: list[MicroBatch]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of the head per micro-batch: (dh, losses)."""
        if self.head_pieces:
            return self._cut_head_step(h, mbs)
        ref = self.head
        self._acquire(ref)
        self.grads.begin(ref.index)
        dh, losses = [], []
        for m, (x, mb) in enumerate(zip(h, mbs)):
            x = x.requires_grad_()
            head = self.model.head
            loss = self._with_aux(head.loss(head.logits(x), mb.targets, self.scale.divisor), m, mb, backward=True)
            if self._tied is not None:
                self._tied.head_before()
            self.scale.share(loss).backward()
            if self._tied is not None:
                self._tied.head_after()
            if self.model.routers is not None:
                self.model.routers.collect()
            self.grads.fold(self._units(ref))
            dh.append(x.grad)
            losses.append(loss.detach())
        self.grads.end(ref.index)
        self._release(ref)
        return dh, losses

    def block_backward(self, ref: UnitRef, dh: list[torch.Tensor], mbs: list[MicroBatch]) -> list[torch.Tensor]:
        self._acquire(ref)
        self.grads.begin(ref.index)
        b, prev = ref.block, self.walk.upcoming  # the unit the backward reaches next
        off = self.offloaded
        for m, mb in enumerate(mbs):
            if prev is not None and prev.role == "block" and (prev.block, m) not in self.kept:
                self.stash.prefetch((prev.block, m))
            if off is not None:
                off.pump()
            faults.point("backward")
            if (b, m) in self.kept:
                dh[m] = self.kept.backward((b, m), dh[m])
                self.grads.fold(self._units(ref))
                continue
            if off is not None and (b, m) in off:
                dh[m] = off.backward((b, m), dh[m])  # its input from the stash
                self.grads.fold(self._units(ref))
                self.stash.free((b, m))
                continue
            self.recomputed += 1
            x = self.stash.get((b, m)).detach().requires_grad_()
            self._rng[ref.index, m].restore()
            out = self._routed(b, m, ref.module, x, mb.positions, record=False)
            torch.autograd.backward(out, dh[m])
            self.grads.fold(self._units(ref))
            dh[m] = x.grad
            self.stash.free((b, m))
        self.grads.end(ref.index)
        self._release(ref)
        return dh

    def embed_backward(self, dh: list[torch.Tensor], mbs: list[MicroBatch]) -> None:
        if not self.embed_trains:  # frozen (train.freeze, adapters): no gradient, nothing before it
            return
        if self.head_pieces:
            return self._cut_embed_backward(dh, mbs)
        ref = self.embed
        self._acquire(ref)
        self.grads.begin(ref.index)
        for m, mb in enumerate(mbs):
            self._rng[ref.index, m].restore()
            out = self.model.embed(mb.ids, mb.positions)
            if self._tied is not None:
                self._tied.embed_before(m)
            torch.autograd.backward(out, dh[m])
            if self._tied is not None:
                self._tied.embed_after(m)
            self.grads.fold(self._units(ref))
        if self._tied is not None:
            self._tied.finish()
        self.grads.end(ref.index)
        self._release(ref)

    # -- evaluation ------------------------------------------------------------------------------------
    def evaluate(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        step_tokens: list[torch.Tensor] | None = None,
        scored: int | None = None,
        positions: list[torch.Tensor] | None = None,
        aux_weight: float = 1.0,
        attention: list[torch.Tensor] | None = None,
    ) -> list[float]:
        """The loss of every micro-batch of ``batches`` with the current parameters: a step's
        forward alone, layer-major, with its kernels (the losses equal a training step's on the
        same batches, without dropout); nothing kept, stashed or sent home. ``step_tokens``,
        ``scored``, ``positions``, ``attention``: as ``step``'s; ``aux_weight``: what a mixture of
        experts' auxiliary loss is multiplied by in each micro-batch's loss (``validation_loss``);
        that part of each loss is left in ``eval_aux`` (empty without routers)."""
        self.aux_weight, self.eval_aux = aux_weight, []
        mbs = self._micro_batches(batches, positions, attention)
        self.scale = LossScale(len(batches), scored=scored)
        self.pieces_used = used_pieces(self.embed_pieces, step_tokens or [x for x, _ in batches])
        self.walk.restart(visits(self.plan, self.pieces_used, forward_only=True))
        was = self.model.training
        self.model.eval()  # no dropout
        try:
            h = self.embed_forward(mbs)
            for ref in self.blocks:
                self._acquire(ref)
                with torch.enable_grad():  # the training forward's kernels (its graph dropped at once)
                    h = [
                        self._routed(ref.block, m, ref.module, x, mb.positions).detach()
                        for m, (x, mb) in enumerate(zip(h, mbs))
                    ]
                self._release(ref)
            losses = self._cut_head_loss(h, mbs) if self.head_pieces else self._head_loss(h, mbs)
        finally:
            self.model.train(was)
        self.eval_aux = [float(a) for a in self.eval_aux]
        return [float(v) for v in losses]  # sync point: losses to the host

    def _head_loss(self, h: list[torch.Tensor], mbs: list[MicroBatch]) -> list[torch.Tensor]:
        self._acquire(self.head)
        head, losses = self.model.head, []
        for m, (x, mb) in enumerate(zip(h, mbs)):
            x = x.detach().requires_grad_()  # as head_step: the same kernels
            with torch.enable_grad():
                loss = head.loss(head.logits(x), mb.targets, self.scale.divisor)
                losses.append(self._with_aux(loss, m, mb, backward=False).detach())
        self._release(self.head)
        return losses

    def _micro_batches(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        positions: list[torch.Tensor] | None = None,
        attention: list[torch.Tensor] | None = None,
    ) -> list[MicroBatch]:
        """On the device; ``positions``: packed rows' ``[B, T]`` positions (attention within
        each document), else ``0 .. T-1``; ``attention``: padded rows' ``[B, T]`` masks of their
        own tokens (a padding collator's attention_mask), else None."""
        mbs = []
        for m, (x, y) in enumerate(batches):
            ids = x.to(self.dev.device, non_blocking=True)
            pos = (
                torch.arange(ids.shape[1], device=self.dev.device)
                if positions is None
                else positions[m].to(self.dev.device, non_blocking=True)
            )
            own = None if attention is None else attention[m].to(self.dev.device, non_blocking=True)
            mbs.append(MicroBatch(ids, y.to(self.dev.device, non_blocking=True), pos, own))
        return mbs

    # -- one step --------------------------------------------------------------------------------------
    def step(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        scale: LossScale | None = None,
        step_tokens: list[torch.Tensor] | None = None,
        positions: list[torch.Tensor] | None = None,
        attention: list[torch.Tensor] | None = None,
    ) -> StepOutput:
        """One step over ``batches`` (this rank's micro-batches); ``scale``: how their losses make
        the step's (default: the mean of these micro-batches'); ``step_tokens``: every rank's
        inputs (ranks: the embedding pieces gathered are those any rank's tokens use, the same
        on every rank); ``positions``: packed rows' positions, restarting at each document;
        ``attention``: padded rows' masks of their own tokens (``_micro_batches``). The output's
        ``loss`` is this rank's part of the step's."""
        M = len(batches)
        self.scale = scale or LossScale(M)
        self.model.train()
        mbs = self._micro_batches(batches, positions, attention)
        self._rng = {}
        self.pieces_used = used_pieces(self.embed_pieces, step_tokens or [x for x, _ in batches])
        self.walk.restart(visits(self.plan, self.pieces_used, embed_backward=self.embed_trains))
        self.kept.clear()  # nothing survives a step that failed half-way
        if self.model.routers is not None:
            self.model.routers.clear()
        if self.offloaded is not None:
            self.offloaded.clear()
        self.stash.clear()  # (a prefetch left by a failed step read back its hidden state for this one)
        self.kept_pairs = 0
        self._tied = self.tied_rows if M > 1 else None
        if self._tied is not None:
            self._tied.begin([mb.ids for mb in mbs])
        self.policy.begin_step(len(self.blocks), M, self.kept.budget)
        t0 = time.perf_counter()

        h = self.embed_forward(mbs)
        for ref in self.blocks:
            h = self.block_forward(ref, h, mbs)
        if self.offloaded is not None:
            self.offloaded.end_forward()
            self.offloaded.pump()  # the first records read back under the head
        dh, losses = self.head_step(h, mbs)
        h = None
        after_forward = _Rng(self.dev)
        t1 = time.perf_counter()

        self.recomputed = 0
        for ref in reversed(self.blocks):
            dh = self.block_backward(ref, dh, mbs)
        self.embed_backward(dh, mbs)
        after_forward.restore()  # the replays rewound the RNG; plain training only draws in the forward
        t2 = time.perf_counter()

        values = [float(v) for v in losses]  # sync point: losses to the host
        tokens = sum(int(mb.ids.numel()) for mb in mbs)
        return StepOutput(self.scale.mean(sum(values)), values, tokens, t1 - t0, t2 - t1)
