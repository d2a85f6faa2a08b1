"""What the cost model chooses for a run: the update path, where ``update.mode = "auto"``.

The baseline and the overlapped path hold the same states in the same memory and run the
same math in the same order (bit-identical), so choosing between them changes only the time:
the faster by the prediction. The engines are never chosen (other processes, other memory);
they are asked for by name.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import Config
from .probe import Rates

__all__ = ["resolve_update"]

AUTO_PATHS = ("baseline", "overlap")


def _with_mode(cfg: Config, mode: str) -> Config:
    return dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, mode=mode))


def resolve_update(cfg: Config, rt, rates_fn: Callable[[], Rates] | None) -> tuple[Config, str | None]:
    """``cfg`` with ``update.mode = "auto"`` resolved, and why (None where it was not auto).

    Where the update moves nothing on the storage tier (every state it reads in memory) there
    is no I/O to hide: it runs beside the compute only on CUDA (its CPU kernels beside the
    device's); on a CPU device it would take cores from it. Otherwise the prediction decides,
    from ``rates_fn()`` (the machine's measured rates; called only then), or, where nothing is
    to be measured (``rates_fn`` None), the overlap, which hides the update's I/O."""
    if cfg.update.mode != "auto":
        return cfg, None
    if cfg.update.eager:
        return _with_mode(cfg, "overlap"), "overlap (update.eager = true: each unit as its gradient arrives)"
    from . import predict_with, step_traffic

    base_cfg = _with_mode(cfg, "baseline")
    t = step_traffic(base_cfg, rt.model, rt.layout, rt.dtype, rt.align, hidden=rt.hidden_size, kept=0,
                     separate=rt.dev.separate)
    if t.update_read + t.update_write == 0:
        mode = "overlap" if rt.dev.cuda else "baseline"
        why = ("the update moves nothing on the storage tier: its CPU work runs beside the device's" if rt.dev.cuda else
               "the update moves nothing on the storage tier and the compute is on this CPU: nothing to hide")
        return _with_mode(cfg, mode), f"{mode} ({why})"
    if rates_fn is None:
        moved = (t.update_read + t.update_write) / 1e9
        return _with_mode(cfg, "overlap"), (f"overlap (the update moves {moved:.2f} GB a step on the storage tier; "
                                            "not measured here: hidden under the next forward)")
    rates = rates_fn()
    times = {"baseline": predict_with(base_cfg, rt, rates).step_s,
             "overlap": predict_with(_with_mode(cfg, "overlap"), rt, rates).step_s}
    mode = "overlap" if times["overlap"] < 0.98 * times["baseline"] else "baseline"  # a tie keeps the simpler path
    return _with_mode(cfg, mode), (f"{mode} (predicted {times['baseline']:.2f} s/step for baseline, "
                                   f"{times['overlap']:.2f} s for overlap)")
