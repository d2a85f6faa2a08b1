"""The validation loss (``train.eval_every``, ``data.eval_corpus``): the held-out windows
(``data.EvalSet``) through the executor's forward alone (``LayerMajorExecutor.evaluate``),
layer-major, ``data.micro_batches`` micro-batches per pass, with the parameters of the step
just taken (a load waits for a unit's update where it still runs).

The loss is the mean over the micro-batches of their mean cross-entropy (every micro-batch has
``micro_batch_size x seq_len`` targets: the mean over tokens); for examples (masked targets) the
sum of every micro-batch's summed cross-entropy over all their scored targets: the mean over
the scored tokens. A mixture of experts' auxiliary loss (where the config asks for it) is each
micro-batch's, as the model's forward adds it; with masked targets, whose micro-batch losses are
summed, each adds its share of the mean over the micro-batches (else the figure would grow with
the evaluation set). With ranks every rank takes its
share of the micro-batches (``EvalSet``) and the sum is taken in rank order: the same value on
every rank.
"""

from __future__ import annotations

import torch

from ..data import EvalSet
from ..dist.group import SoloGroup
from ..execute.loss import LossScale

__all__ = ["validation_loss"]


def validation_loss(
    evalset: EvalSet, executor, micro_batches: int, group=None, aux: list | None = None, stop=None
) -> float | None:
    """The mean loss over ``evalset`` (see the module docstring); ``group``: the ranks (one
    process: a group of one). ``aux``: where given, the auxiliary loss's part of that mean is
    appended to it (0.0 without routers): the cross-entropy is the loss less that. ``stop()``:
    asked between passes (by every rank alike), True to cut the validation short: None returned."""
    group = group or SoloGroup()
    rank, world = group.rank, group.world
    mine = evalset.micro_batches(rank, world)
    every = [evalset.micro_batches(r, world) for r in range(world)] if executor.embed_pieces and world > 1 else None
    scored, positions, own = evalset.total_scored(world), evalset.positions(rank, world), evalset.attention(rank, world)
    total, aux_total = 0.0, 0.0
    aux_weight = 1.0 / (len(mine) * world) if scored else 1.0  # summed losses: the auxiliary loss's mean
    for i in range(0, len(mine), micro_batches):
        if i and stop is not None and stop():
            return None
        # the embedding pieces any rank's tokens use, on every rank (as a training step's)
        tokens = [x for part in every for x, _ in part[i : i + micro_batches]] if every else None
        pos = positions[i : i + micro_batches] if positions is not None else None
        att = own[i : i + micro_batches] if own is not None else None
        total += sum(executor.evaluate(mine[i : i + micro_batches], tokens, scored, pos, aux_weight, att))
        aux_total += sum(executor.eval_aux)
    sums = group.sum_in_rank_order(torch.tensor([total, aux_total], dtype=torch.float64))  # sync point (ranks)
    scale = LossScale(len(mine), world, scored)
    if aux is not None:
        aux.append(scale.mean(float(sums[1])))
    return scale.mean(float(sums[0]))
