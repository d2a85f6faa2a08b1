"""What ``tiertrain plan`` prints: placement, bytes per step, rates, the predicted step
per phase with its bound, and what would make the step faster."""

from __future__ import annotations

import dataclasses
import statistics

from ..models import model_name
from ..state.quant import base_storage, quant_spec
from .model import Prediction

__all__ = ["plan_report", "advice", "knee"]

GB, MIB, GIB = 1e9, 1 << 20, 1 << 30


def _placement(states) -> list[str]:
    rows = ["| state | owner | in host memory | on the storage tier |", "|---|---|---|---|"]
    for d in states:
        rows.append(f"| {d.name} | {d.owner} | {d.host_bytes / MIB:,.1f} MiB | {d.file_bytes / MIB:,.1f} MiB |")
    return rows


def advice(cfg, rt, pred: Prediction) -> list[str]:
    """The micro-batches at which the forward and backward hide their I/O, and the faster
    update path, both predicted with the same rates."""
    out = []
    r = pred.rates

    def at(c) -> Prediction:
        from . import predict_with

        return predict_with(c, rt, r)

    def with_(section: str, **kw):
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})

    M = cfg.data.micro_batches
    for m in (1, 2, 4, 8, 16, 32, 64):
        p = at(with_("data", micro_batches=m))
        if all(ph.bound != "I/O" for ph in p.phases[:2]):
            tok = m * cfg.data.micro_batch_size * cfg.data.seq_len
            same = " (this run's)" if m == M else ""
            out.append(
                f"micro-batches: {m}{same} is the fewest at which the forward and backward hide their "
                f"I/O ({tok:,} tokens per step, {p.step_s:.2f} s predicted)"
            )
            break
    else:
        out.append(
            "micro-batches: the forward and backward stay I/O-bound up to 64; more host memory for "
            "parameters (memory.host_param_mib) or more storage paths would help"
        )
    # every update path with the same rates (eager ones only where clipping is off, as they need)
    from ..update import UPDATES

    if cfg.adapter.on:
        out.append("update path: frozen (adapters on a frozen model: nothing of it is updated)")
        return out
    paths = [(m, False) for m in UPDATES if m not in ("auto", "frozen")]
    if cfg.optim.grad_clip == 0:
        paths += [(m, True) for m, cls in UPDATES.items() if m != "auto" and cls.supports_eager]
    if cfg.update.topk:  # top-k compression: only the paths that take it (the others would be another math)
        paths = [(m, e) for m, e in paths if UPDATES[m].compresses]
    # a speculating run's paths are compared speculating where they can (a path that cannot
    # is refused by the config with update.speculate = 'on')
    spec = lambda mode: cfg.update.speculate == "on" and UPDATES[mode].speculates  # noqa: E731
    name = lambda mode, eager: path_name(mode, eager, spec(mode))  # noqa: E731
    this = name(cfg.update.mode, cfg.update.eager)
    times = {
        name(m, e): (
            pred.step_s
            if name(m, e) == this
            else at(with_("update", mode=m, eager=e, speculate="on" if spec(m) else "off")).step_s
        )
        for m, e in paths
    }
    times.setdefault(this, pred.step_s)  # eager with clipping, which only speculation allows
    best = min(times, key=times.get)
    listed = ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
    if times[this] <= 1.02 * times[best]:
        verdict = f"{this} (this run's) is the fastest within 2%"
    else:
        verdict = f"{best} is predicted {times[this] / times[best]:.2f}x faster than {this} (update.mode)"
    out.append(f"update path: {listed} per step: {verdict}")
    return out


def _terms(p: Prediction) -> dict[str, float]:
    """A predicted step's seconds of each resource, as if each ran alone: the device's forward
    and backward (recomputes included), the drive's reads and writes, the host <-> device link,
    the optimizer's kernel on the host."""
    from .model import link_s

    t, r = p.traffic, p.rates
    return {
        "the device's compute": sum(ph.compute_s for ph in p.phases[:2]),
        "the drive": t.read / (r.read_gbps * GB) + t.write / (r.write_gbps * GB),
        "the link": link_s(t, r),
        "the host's update": p.phases[2].compute_s if len(p.phases) > 2 else 0.0,
    }


COMPUTE_BOUND = 0.9  # the device computes at least this share of the predicted step


def knee(cfg, rt, pred: Prediction, most: int = 4096) -> str:
    """The fewest tokens a step (powers of two of micro-batches, up to ``most``) at which the
    step is compute-bound: the device's forward and backward take at least 90% of it, predicted
    with the same rates; and what bounds this run's step where it is not."""
    from . import predict_with

    d = cfg.data
    rows = d.micro_batch_size * d.seq_len

    def at(m: int) -> Prediction:
        return (
            pred
            if m == d.micro_batches
            else predict_with(dataclasses.replace(cfg, data=dataclasses.replace(d, micro_batches=m)), rt, pred.rates)
        )

    def bound(p: Prediction) -> bool:
        return _terms(p)["the device's compute"] >= COMPUTE_BOUND * p.step_s

    terms = _terms(pred)
    said = ", ".join(f"{k} {v:.2f} s" for k, v in terms.items() if v > 0)
    here = f"this run's {d.micro_batches * rows:,} tokens a step: {pred.step_s:.2f} s predicted ({said})"
    if bound(pred):
        return f"compute-bound: {here}"
    worst = max((k for k in terms if k != "the device's compute"), key=terms.get)
    m = 1
    while m <= most and not bound(p := at(m)):
        m *= 2
    hint = _on_device_hint(cfg, rt, pred) if worst == "the host's update" else ""
    if m > most:
        return f"not compute-bound up to {most * rows:,} tokens a step; {here}: bound by {worst}{hint}"
    return (
        f"compute-bound from {m * rows:,} tokens a step ({m} micro-batches; {p.step_s:.2f} s predicted, "
        f"{m * rows / p.step_s:,.0f} tokens/s); below that bound by {worst}: {here}{hint}"
    )


def _on_device_hint(cfg, rt, pred: Prediction) -> str:
    """Where the host's update bounds a step and the optimizer's states could live in device
    memory instead (``memory.optim_device_mib``): what the step would be with all of them
    there, and what they take against what the device has free."""
    from . import predict_with
    from .device_states import all_state_bytes, why_not_on_device

    if cfg.memory.optim_device_mib or why_not_on_device(cfg, rt):
        return ""
    states = all_state_bytes(cfg, rt)
    there = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, optim_device_mib=-(-states // MIB)))
    alt = predict_with(there, rt, pred.rates)
    import torch

    free = f"; the device has {torch.cuda.mem_get_info(rt.dev.device)[0] / GIB:.1f} GiB free" if rt.dev.cuda else ""
    return (
        f" (with the optimizer's {states / GIB:.1f} GiB of states in device memory, memory.optim_device_mib=none: "
        f"{alt.step_s:.2f} s predicted{free})"
    )


def _activations(cfg, rt, r) -> str:
    from . import kept_pairs, offloaded_pairs

    L, M = len(rt.model.blocks), cfg.data.micro_batches
    kept = kept_pairs(cfg, L, r.act_bytes)
    off = offloaded_pairs(cfg, L, kept)
    rec = f" (records of {r.record_bytes / MIB:.1f} MiB)" if off else ""
    return (
        f"activations (memory.activations = {cfg.memory.activations!r}): of {L * M} (block, micro-batch) pairs "
        f"{kept} kept, {off} on the storage tier{rec}, {L * M - kept - off} recomputed"
    )


def _optim_name(cfg) -> str:
    return {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "sgd": "SGD"}[cfg.optim.name]


def _states_line(cfg, rt) -> list[str]:
    """What 8-bit optimizer states save, where they are chosen."""
    if cfg.optim.name != "adamw8bit" or cfg.adapter.on:
        return []
    from ..update.streamed import optimizer_sizes

    sizes = optimizer_sizes(cfg.optim, rt.state_layout, rt.dtype)
    moments = sum(v for k, v in sizes.items() if k != "master")
    return [
        f"optimizer states: AdamW8bit (bitsandbytes' blockwise 8-bit moments), {moments / GB:.2f} GB instead of fp32 "
        f"AdamW's {rt.state_layout.total_numel * 8 / GB:.2f} GB, read and written each step"
    ]


def path_name(mode: str, eager: bool, speculative: bool) -> str:
    """An update path as the plan names it: ``overlap (eager), speculative``."""
    return mode + (" (eager)" if eager else "") + (", speculative" if speculative else "")


def _made(cfg) -> str:
    """How a frozen base's fetched unit is made in the compute dtype."""
    return "dequantized" if quant_spec(cfg.model) is not None else "widened"


def _base_line(cfg, rt) -> list[str]:
    """A quantized base's format and bytes, where it is one."""
    if quant_spec(cfg.model) is None or not cfg.adapter.on:
        return []
    return [base_storage(cfg, rt.layout, rt.dtype, rt.align)[0].describe()]


def plan_report(cfg, rt, states, pred: Prediction, budget=None) -> str:
    t, r = pred.traffic, pred.rates
    lines = [
        f"model: {model_name(rt.model, cfg.model)}, {rt.dtype}, {rt.layout.describe()}",
        *_base_line(cfg, rt),
        *_states_line(cfg, rt),
        f"step: {cfg.data.micro_batches} micro-batches of {cfg.data.micro_batch_size} x {cfg.data.seq_len} tokens,"
        f" update path {path_name(cfg.update.mode, cfg.update.eager, cfg.update.speculate == 'on')}, checksums {'on' if cfg.io.checksum else 'off'}, device {rt.dev.device}",
        "",
        *(budget.lines() if budget is not None else []),
        "",
        "placement:",
        *_placement(states),
        "",
        f"bytes per step on the storage tier: read {t.read / GB:.3f} GB (forward {t.forward_read / GB:.3f},"
        f" backward {t.backward_read / GB:.3f}, update {t.update_read / GB:.3f}), write {t.write / GB:.3f} GB"
        f" (forward {t.forward_write / GB:.3f}, backward {t.backward_write / GB:.3f}, update {t.update_write / GB:.3f})",
        "  by state (read / write GB): "
        + ", ".join(f"{k} {v[0] / GB:.3f}/{v[1] / GB:.3f}" for k, v in t.by_state.items()),
    ]
    if rt.dev.separate:
        lines.append(f"host <-> device per step: up {t.up / GB:.3f} GB, down {t.down / GB:.3f} GB")
    lines += [
        "",
        f"measured here: storage read {r.read_gbps:.2f} GB/s, write {r.write_gbps:.2f} GB/s; CRC32C {r.crc_gbps:.2f}"
        f" GB/s per core, {r.cores} cores; per micro-batch: block forward {r.block_fwd_s * 1e3:.1f} ms, backward"
        f" {r.block_bwd_s * 1e3:.1f} ms, head {r.head_s * 1e3:.1f} ms; activations {r.act_bytes / MIB:.1f} MiB per"
        f" block and micro-batch; {_optim_name(cfg)} {1 / max(r.update_elem_s, 1e-15) / 1e6:.0f} M elements/s"
        + (f"; the base {_made(cfg)} at {r.widen_gbps:.1f} GB/s" if r.widen_gbps > 0 else "")
        + (f"; host -> device {r.up_gbps:.1f} GB/s, device -> host {r.down_gbps:.1f} GB/s" if r.up_gbps > 0 else ""),
        _activations(cfg, rt, r),
        "",
        "predicted step:",
        pred.table(),
        *pred.notes,
        "",
        knee(cfg, rt, pred),
        *advice(cfg, rt, pred),
    ]
    return "\n".join(lines)


def against_measured(cfg, rt, pred: Prediction, records: list) -> str:
    """The prediction against the median of ``records`` (step records past the warm-up), and
    again with the disk as fast as those steps found it: the probed rates scaled by the time
    their bytes would take at the probed rates over the time a request was in flight
    (``ssd_busy_s``; reads and writes overlapping share it). That parts the disk's drift since
    the probe from the model's own error."""
    from . import predict_with

    measured = statistics.median(r.step_s for r in records)
    line = (
        f"step time: predicted {pred.step_s:.2f} s, measured {measured:.2f} s (median of the last "
        f"{len(records)} steps; {measured / pred.step_s:.2f}x)"
    )
    r = pred.rates
    pace = [
        (x.ssd_read_bytes / r.read_gbps + x.ssd_write_bytes / r.write_gbps) / 1e9 / x.ssd_busy_s
        for x in records
        if x.ssd_busy_s > 0
    ]
    if not pace:
        return line  # nothing on the storage tier: the disk's rate is not in it
    k = statistics.median(pace)  # the disk's speed in these steps over the probe's
    again = predict_with(cfg, rt, dataclasses.replace(r, read_gbps=r.read_gbps * k, write_gbps=r.write_gbps * k))
    return (
        f"{line}; with the disk {k:.2f}x as fast as probed, as these steps found it (read "
        f"{r.read_gbps * k:.2f}, write {r.write_gbps * k:.2f} GB/s): predicted {again.step_s:.2f} s "
        f"({measured / again.step_s:.2f}x)"
    )
