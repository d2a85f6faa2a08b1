"""A step's figures, for its record and the per-step line: wall time, the storage tier's bytes
and busy time, the compute thread's waits on I/O, peak host and device memory, model FLOPs
utilisation where the device's peak is known, and what the ranks add (their network bytes,
every rank's figures: the group's)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..device.host import host_peak_rss
from .metrics import StepRecord, peak_flops

__all__ = ["StepMeter"]


class StepMeter:
    """``begin()`` before a step, ``record(...)`` after it. ``waits()``: seconds the compute has
    waited for the storage tier so far; ``flops_per_token``: the model's (for MFU)."""

    def __init__(self, storage, dev, group, waits: Callable[[], float], flops_per_token: float) -> None:
        self.storage, self.dev, self.group, self.waits = storage, dev, group, waits
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(torch.cuda.get_device_name(dev.device) if dev.cuda else None)

    def begin(self) -> None:
        self.t0, self.io0, self.waits0 = time.perf_counter(), self.storage.stats(), self.waits()
        t = self.group.traffic
        self.net0 = (t.sent, t.received)
        self.dev.reset_peak()  # the record's device peak is this step's

    def record(
        self, *, step: int, out, lr: float, norm: float, update_s: float, update_wait_s: float, extra: dict
    ) -> StepRecord:
        step_s = time.perf_counter() - self.t0
        io1 = self.storage.stats()
        rb = sum(io1[k].read_bytes - self.io0[k].read_bytes for k in io1)
        wb = sum(io1[k].write_bytes - self.io0[k].write_bytes for k in io1)
        rbusy = max((io1[k].read_busy_s - self.io0[k].read_busy_s for k in io1), default=0.0)
        wbusy = max((io1[k].write_busy_s - self.io0[k].write_busy_s for k in io1), default=0.0)
        busy = max((io1[k].busy_s - self.io0[k].busy_s for k in io1), default=0.0)
        mfu = self.flops_per_token * out.tokens / step_s / self.peak if self.peak else None
        rec = StepRecord(
            step=step,
            loss=out.loss,
            lr=lr,
            grad_norm=norm,
            tokens=out.tokens,
            step_s=step_s,
            forward_s=out.forward_s,
            backward_s=out.backward_s,
            update_s=update_s,
            io_wait_s=self.waits() - self.waits0 + update_wait_s,
            ssd_read_bytes=rb,
            ssd_write_bytes=wb,
            ssd_read_gbps=rb / rbusy / 1e9 if rbusy > 0 else 0.0,
            ssd_write_gbps=wb / wbusy / 1e9 if wbusy > 0 else 0.0,
            peak_host_bytes=host_peak_rss(),
            peak_device_bytes=self.dev.peak_bytes(),
            mfu=mfu,
            extra=extra,
            ssd_busy_s=busy,
        )
        rec.extra.update(self.group.step_record(rec, self.net0))  # with ranks: theirs, gathered
        return rec
