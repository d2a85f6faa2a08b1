"""A fresh run's initial weights (``Trainer.initialize``): read from the weight source unit by
unit (memory of one unit), checked against the model's shapes, handed to the update path, which
writes the parameters, the master copy and zeroed moments; a progress bar, or a line every
30 s in a log file (an 8 B start passed 150 s on the GPU unexplained)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..io import aligned_empty

__all__ = ["write_initial_weights"]

log = logging.getLogger("tiertrain")


def write_initial_weights(tr: Any, progress: bool) -> None:
    """Every unit's initial weights into ``tr``'s update path (``tr``: the trainer; not imported,
    which imports this); ``finish_init`` is the caller's."""
    from tqdm import tqdm

    dtype = tr.update.init_dtype  # fp32, or a frozen base's own: converted as it is copied in
    flat = aligned_empty(tr.layout.max_unit_numel * dtype.itemsize).view(dtype)
    t0 = said = time.perf_counter()
    for unit in tqdm(tr.layout.units, desc="init weights", disable=None if progress else True, unit="unit"):
        if time.perf_counter() - said > 30 and tr.group.leader:  # a log file has no bar: a line now and then
            said = time.perf_counter()
            log.info("initial weights: %d of %d units, %.0f s", unit.index, len(tr.layout), said - t0)
        view = flat[: unit.numel]
        unit.fill(tr.source.load(unit.index, [r.name for r in unit.params]), view)
        whole = getattr(tr.update, "init_whole", False)  # a rank's quantized base: quantized whole
        tr.update.init_unit(unit.index, view if whole else tr.rt.state_layout.shard(unit.index, view))
