"""The optimizer arithmetic on one chunk of flat state: torch's own fused kernels.

A chunk is given as per-parameter segments (see ``FlatLayout.segments``), cut only at
multiples of 64 elements from each parameter's start, so that the fused kernel treats
every element exactly as ``torch.optim.AdamW(fused=True)`` does when it updates the
whole parameter: the results are bit-identical.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as _adamw

from ..config import OptimConfig

__all__ = ["adamw_segments", "sgd_segments"]


def adamw_segments(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    cfg: OptimConfig,
) -> None:
    """One AdamW step (number ``step``, 1-based) on matching lists of segments, in place."""
    if not params:
        return
    # The functional API increments each step tensor before the kernel reads it, as the
    # optimizer does with its per-parameter state["step"] (a float32 tensor when fused).
    # (a fill, not ``torch.tensor``: on a CUDA device that would be a blocking copy per segment)
    steps = [torch.full((), float(step - 1), dtype=torch.float32, device=params[0].device) for _ in params]
    _adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=False,
        fused=True,
        capturable=False,
        differentiable=False,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        amsgrad=False,
        beta1=cfg.beta1,
        beta2=cfg.beta2,
        lr=lr,
        weight_decay=cfg.weight_decay,
        eps=cfg.eps,
        maximize=False,
    )


def sgd_segments(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    cfg: OptimConfig,
) -> None:
    """One SGD step with momentum on matching segments, in place: the kernel that
    ``torch.optim.SGD(fused=True)`` runs. On step 1 the buffers are set from the gradient
    (torch's first-step rule), so they may hold anything before."""
    if not params:
        return
    torch._fused_sgd_(
        params,
        grads,
        momentum_buffers if cfg.momentum else [],
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        lr=lr,
        dampening=0.0,
        nesterov=False,
        maximize=False,
        is_first_step=step == 1 and cfg.momentum != 0,
        grad_scale=None,
        found_inf=None,
    )
