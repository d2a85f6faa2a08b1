"""The cost model: bytes per step per link, measured rates, and the predicted step.

``estimate(cfg, rt)`` probes this machine (storage bandwidth, CRC32C, one unit of each
kind) and predicts a run of ``cfg`` on the runtime ``rt`` (model, layout, device) before
its first step; ``tiertrain plan`` prints it, ``tiertrain train`` prints it and, after a
few steps, predicted against measured.
"""

from __future__ import annotations

import os

from ..execute.executor import visits
from .device_states import device_units_of as _device_units_of
from .model import Phase, Prediction, predict
from .probe import DiskProbe, Rates, probe_base, probe_compute, probe_crc, probe_link, probe_update
from .traffic import Traffic, kept_pairs, offloaded_pairs, run_traffic, step_traffic

__all__ = [
    "Phase",
    "Prediction",
    "Rates",
    "Traffic",
    "estimate",
    "measure_rates",
    "predict",
    "predict_with",
    "kept_pairs",
    "offloaded_pairs",
    "step_traffic",
    "run_traffic",
]

MIB = 1 << 20


def measure_rates(cfg, rt, *, probe_mib: int = 256) -> Rates:
    """Probe this machine for a run of ``cfg`` on ``rt`` (a few seconds). The unit timings run
    the blocks forward and backward, and with them the adapters' hooks: their gradients are
    dropped after, or the first step would add them to its own."""
    try:
        return _measure_rates(cfg, rt, probe_mib)
    finally:
        for p in rt.adapters.params() if rt.adapters is not None else []:
            p.grad = None


def _measure_rates(cfg, rt, probe_mib: int) -> Rates:
    args = (cfg, rt.model, rt.layout, rt.dev, rt.dtype, rt.hidden_size)
    with DiskProbe(cfg.io, probe_mib) as d:
        write = d.write()
        read = d.read()
        io_cpu = d.cpu_s / (2 * d.size / 1e9)
        comp = probe_compute(*args)
        with d.reading():  # the same blocks while the storage tier reads: what the overlap costs
            busy = probe_compute(*args, blocks_only=True, acts=(comp["act_bytes"], comp["record_bytes"]))
    up, down = probe_link(rt.dev)
    quiet = comp["block_fwd_s"] + comp["block_bwd_s"]
    slow = max(1.0, (busy["block_fwd_s"] + busy["block_bwd_s"]) / quiet) if quiet > 0 else 1.0
    return Rates(
        read_gbps=read,
        write_gbps=write,
        crc_gbps=probe_crc(),
        io_cpu_s_per_gb=io_cpu,
        io_slowdown=slow,
        update_elem_s=probe_update(rt.dtype, rt.layout.max_unit_numel, cfg),
        widen_gbps=probe_base(cfg, rt),
        cores=len(os.sched_getaffinity(0)),
        up_gbps=up,
        down_gbps=down,
        **comp,
    )


def estimate(cfg, rt, rates: Rates | None = None, *, probe_mib: int = 256) -> Prediction:
    """The predicted step of ``cfg`` on ``rt`` (rates probed unless given)."""
    return predict_with(cfg, rt, rates or measure_rates(cfg, rt, probe_mib=probe_mib))


def trained_elements(rt) -> int:
    """Parameters the optimizer steps: the adapters under adapters (the base is frozen whole),
    else the units ``train.freeze`` leaves trained."""
    if rt.adapters is not None:
        return sum(p.numel() for p in rt.adapters.params())
    return sum(u.used for u in rt.layout.units if not u.frozen)


def on_device_elements(cfg, rt) -> int:
    """Trained elements whose states ``memory.optim_device_mib`` puts in device memory: updated
    there, in no time the host's update counts (their kernel is the GPU's, a few milliseconds)."""
    return sum(rt.state_layout.units[u].used for u in _device_units_of(cfg, rt))


def predict_with(cfg, rt, rates: Rates) -> Prediction:
    """The prediction of ``cfg`` on ``rt`` from given rates (no probe); pairs offloaded as
    ``memory.offload_pairs`` says (unset: none)."""
    blocks = len(rt.model.blocks)
    kept = kept_pairs(cfg, blocks, rates.act_bytes)
    offloaded = offloaded_pairs(cfg, blocks, kept)
    t = step_traffic(
        cfg,
        rt.model,
        rt.layout,
        rt.dtype,
        rt.align,
        hidden=rt.hidden_size,
        kept=kept,
        separate=rt.dev.separate,
        offloaded=offloaded,
        record=rates.record_bytes,
        on_device=_device_units_of(cfg, rt),
    )
    first_unit = visits(rt.model.plan)[0].index  # the read nothing hides
    first = rt.layout.units[first_unit].numel * rt.dtype.itemsize if t.forward_read else 0
    return predict(
        cfg,
        t,
        rates,
        blocks=blocks,
        kept=kept,
        n_trained=trained_elements(rt) - on_device_elements(cfg, rt),  # those the host's update steps
        first_read=first,
        cpu_compute=not rt.dev.cuda,
        offloaded=offloaded,
    )
