"""8-bit optimizer states (``optim.name = "adamw8bit"``): bitsandbytes' ``AdamW8bit``, streamed.

bitsandbytes keeps AdamW's two moments of every parameter of at least ``MIN_8BIT`` (4096)
elements as one byte each, quantized blockwise: blocks of ``BLOCK`` (256) elements counted
from the parameter's start, each with its own fp32 scale (``absmax``), codes of a dynamic map
(signed for the first moment, unsigned for the second). Smaller parameters keep fp32 moments.
The update (``optimizer_update_8bit_blockwise``, ``optimizer_update_32bit``) dequantizes a
block, applies AdamW (decoupled weight decay) and quantizes it again: every block on its own.
So a chunk that cuts parameters only at multiples of 256 elements from their starts gives the
bits of bitsandbytes updating the whole parameter (tested against ``bnb.optim.AdamW8bit``).

Per parameter element the states take 2 bytes instead of 8; with the parameters and gradients
(fp32) a full fine-tune's update moves 18 bytes an element instead of 30 (30 - 12 = the
moments read and written at 8 bytes less each way; ``cost/budget.py``, ``cost/traffic.py``).

Where the states live, in the layout every state shares (``state/layout.py``):

- ``exp_avg`` and ``exp_avg_sq``: one ``uint8`` code per element, at the parameters' element
  offsets, chunked and placed (host memory or files) as the fp32 moments are. Each unit's
  record starts on a whole checksum block of these files (``regions.place``), the update's
  chunks start on whole blocks of them (``align_dtype``), and parameters start on multiples of
  256 elements (``param_align``), so every cut is at a block boundary of every parameter. Units
  are padded for the 4-byte files only: a unit's last chunk ends inside a block of the 1-byte
  files, which the storage tier's bounce buffer patches;
- ``exp_avg_scales``: per unit (of the layout the optimizer walks: the whole units, an
  engine's slices, a rank's shards) one fp32 record (``state/scales.py``): the scales of the
  first moment's blocks, then the second's, then the fp32 moments of the small parameters
  (first, then second). Read whole with the unit's first chunk, written whole after its last.

Bit-identity holds on CPU, where bitsandbytes' kernels are plain torch operations on each
block; on CUDA its kernels differ from its CPU ones (within their own rounding).
"""

from __future__ import annotations

import functools

import torch

from ..config import OptimConfig
from ..state.scales import MIN_8BIT, UnitScales, whole_numel

__all__ = [
    "same_optimizer",
    "EIGHT_BIT",
    "adamw8bit_segments",
    "align_dtype",
    "eight_bit",
    "plain_optimizer",
    "require_bnb_optim",
]

EIGHT_BIT = "adamw8bit"


def eight_bit(optim: OptimConfig) -> bool:
    return optim.name == EIGHT_BIT


def align_dtype(optim: OptimConfig, dtype: torch.dtype) -> torch.dtype:
    """The narrowest element of the optimizer's states and parameters (``dtype``): what its
    chunk starts keep whole checksum blocks of (``chunk_align``). 8-bit moments: one byte."""
    return torch.uint8 if eight_bit(optim) else dtype


def same_optimizer(ours: str, theirs: str, where: str, *, adapters: bool = False) -> None:
    """Refuse to continue a run whose optimizer keeps its states in another form (fp32 or 8-bit
    moments, SGD's momentum): its files would be read as the other's (found corrupt, or worse,
    parameters laid out on other offsets). Named before any state is read."""
    if ours == theirs:
        return
    from ..config import ConfigError

    fresh = (
        "its adapters (tiertrain export, then a new run with --adapter.init_from=EXPORT on the same base)"
        if adapters  # (an adapter run's export is its adapters, not a model)
        else "its weights (tiertrain export, then --model.hf_dir)"
    )
    raise ConfigError(
        f"{where} was made with optim.name = {theirs!r}; this run has {ours!r}, whose optimizer states (and "
        f"parameter layout) differ: resume with --optim.name={theirs}, or start a new run from {fresh}"
    )


def require_bnb_optim(what: str = f"optim.name = {EIGHT_BIT!r}"):
    """bitsandbytes' ``functional`` module (its optimizer kernels), or an error naming the fix."""
    from ..state.quant import require_bitsandbytes

    return require_bitsandbytes(what)


@functools.cache
def _qmaps(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' dynamic maps, as ``Optimizer8bit.fill_qmap`` makes them: (signed, unsigned)."""
    F = require_bnb_optim()
    return F.create_dynamic_map(signed=True).to(device), F.create_dynamic_map(signed=False).to(device)


def plain_optimizer(optim: OptimConfig, params) -> torch.optim.Optimizer:
    """The optimizer a plain PyTorch user builds for ``optim`` over ``params``: torch's fused
    AdamW or SGD, or bitsandbytes' AdamW8bit (the reference of the streamed one, and the
    adapters' optimizer, which lives in memory)."""
    if optim.name == "sgd":
        return torch.optim.SGD(
            params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay, fused=True
        )
    if eight_bit(optim):
        require_bnb_optim()
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(
            params, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay
        )
    return torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=True,
    )


def adamw8bit_segments(
    segs: list,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    codes1: list[torch.Tensor],
    codes2: list[torch.Tensor],
    unit: UnitScales,
    record: torch.Tensor,
    *,
    step: int,
    lr: float,
    cfg: OptimConfig,
) -> None:
    """One AdamW8bit step (number ``step``, 1-based) on a chunk's segments ``segs`` ((record, x,
    y) of ``layout.segments``) of one unit, in place: the codes, the unit's scales record and
    the parameters. bitsandbytes' kernels, each block (or small parameter) as it updates it."""
    F = require_bnb_optim()
    q1, q2 = _qmaps(params[0].device.type) if params else (None, None)
    for (rec, x, y), p, g, c1, c2 in zip(segs, params, grads, codes1, codes2):
        if whole_numel(rec) < MIN_8BIT:
            s1, s2 = unit.moments(record, rec.offset, x, y)
            F.optimizer_update_32bit(
                "adam", g, p, s1, cfg.beta1, cfg.eps, step, lr, s2, cfg.beta2, 0.0, 0.0, cfg.weight_decay, 1.0
            )
        else:
            a1, a2 = unit.scales(record, rec.offset, x, y)
            F.optimizer_update_8bit_blockwise(
                "adam", g, p, c1, c2, cfg.beta1, cfg.beta2, 0.0, 0.0, cfg.eps, step, lr, q1, q2, a1, a2,
                cfg.weight_decay, 1.0,
            )  # fmt: skip
