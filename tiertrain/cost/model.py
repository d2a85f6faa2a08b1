"""Predicted step time: the bytes per step per link (``traffic``) over measured bandwidths,
the compute of each phase from measured unit times (``probe``), and the schedule's overlap.

A phase takes ``max(compute', I/O)``: the parameter store and the stash prefetch while the
device computes, so a phase is bound by the slower of the two (plus the first unit's read of
the forward, which nothing hides). On a CPU device ``compute'`` is the compute slowed, for
the share of the phase the disk is busy, by the factor measured with the disk reading in the
background (``io_slowdown``), plus the checksums' CPU over the cores.
How the update's phase meets the forward's and the backward's is its path's own: each update
path's ``predict_step`` (after the backward, under the next forward, or beside both in other
processes). The bound says which term set each phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Config
from ..update.base import Phase
from .probe import Rates
from .traffic import Traffic

__all__ = ["Phase", "Prediction", "StepCosts", "link_s", "predict"]


@dataclass
class Prediction:
    phases: list[Phase]
    step_s: float
    bound: str
    traffic: Traffic
    rates: Rates
    notes: list[str] = field(default_factory=list)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def table(self) -> str:
        rows = ["| phase | compute s | I/O s | CRC CPU s | predicted s | bound |", "|---|---|---|---|---|---|"]
        for p in self.phases:
            rows.append(f"| {p.name} | {p.compute_s:.2f} | {p.io_s:.2f} | {p.crc_s:.2f} | {p.time_s:.2f} | {p.bound} |")
        rows.append(f"| step | | | | {self.step_s:.2f} | {self.bound} |")
        return "\n".join(rows)


def _phase(
    name: str,
    compute: float,
    read: int,
    write: int,
    r: Rates,
    checksum: bool,
    *,
    cpu_compute: bool,
    extra_io: float = 0.0,
    extra_cpu: float = 0.0,
) -> Phase:
    io = read / (r.read_gbps * 1e9) + write / (r.write_gbps * 1e9) + extra_io
    crc = (read + write) / (r.crc_gbps * 1e9) if checksum else 0.0
    if cpu_compute:
        # while the storage tier works, compute runs slower (measured: ``io_slowdown``, the
        # I/O threads' CPU and what the machine spends on the transfers); for the part of the
        # phase the disk is busy. Checksums and other processes' CPU (engines) take cores too.
        busy = compute * (1 + (r.io_slowdown - 1) * min(1.0, io / compute if compute else 1.0))
        busy += (crc + extra_cpu) / r.cores
    else:
        busy = max(compute, (crc + extra_cpu) / r.cores)
    t = max(busy, io)
    bound = "compute" if busy >= io else "I/O"
    if bound == "compute" and cpu_compute and busy > 1.25 * compute:
        bound = "compute slowed by I/O"
    return Phase(name, compute, io, crc, t, bound)


@dataclass
class StepCosts:
    """What an update path's cost terms are made from (``Update.predict_step``): the step's
    traffic and the machine's rates, the forward's and backward's phases as if the update ran
    after them, the update's own phase, and their compute seconds."""

    cfg: Config
    traffic: Traffic
    rates: Rates
    fwd: Phase
    bwd: Phase
    upd: Phase
    fwd_c: float  # compute seconds of the forward (the head's forward and backward included)
    bwd_c: float
    upd_c: float  # the update's kernel, all cores
    upd_cpu: float  # CPU seconds of the update: its kernel, checksums, I/O threads
    first_read: int  # bytes of the forward's first unit read from a file (nothing hides it)
    cpu_compute: bool  # the device is this CPU: the update takes its cores
    pcie_s: float  # seconds of host <-> device copies in each of the forward and the backward (``phase`` adds them)

    def phase(
        self, name: str, compute: float, read: int, write: int, *, extra_io: float = 0.0, extra_cpu: float = 0.0
    ) -> Phase:
        """A forward's or backward's phase of ``compute`` seconds moving ``read`` / ``write`` bytes
        on the storage tier, and its share of the host <-> device copies."""
        return _phase(
            name,
            compute,
            read,
            write,
            self.rates,
            self.cfg.io.checksum,
            cpu_compute=self.cpu_compute,
            extra_io=extra_io + self.pcie_s,
            extra_cpu=extra_cpu,
        )

    def first_read_s(self) -> float:
        return self.first_read / (self.rates.read_gbps * 1e9)


def link_s(traffic: Traffic, r: Rates) -> float:
    """Seconds of a step's host <-> device copies at the measured rates (0 without a link)."""
    up = traffic.up / (r.up_gbps * 1e9) if r.up_gbps > 0 else 0.0
    return up + (traffic.down / (r.down_gbps * 1e9) if r.down_gbps > 0 else 0.0)


def predict(
    cfg: Config,
    traffic: Traffic,
    rates: Rates,
    *,
    blocks: int,
    kept: int,
    n_trained: int,
    first_read: int,
    cpu_compute: bool,
    offloaded: int = 0,
) -> Prediction:
    """The predicted step of a run of ``cfg`` (see the module docstring). ``n_trained``: the
    parameters the optimizer steps (``cost.trained_elements``); ``first_read``:
    bytes of the forward's first unit read from the file (0 when in memory); ``offloaded``:
    pairs read back instead of recomputed (their bytes are in ``traffic``). How the update's
    phase meets the others is its path's (``Update.predict_step``)."""
    from ..update import UPDATES

    M, r, ck = cfg.data.micro_batches, rates, cfg.io.checksum
    recomputed = blocks * M - kept - offloaded
    # phases as the executor times them: the forward ends with the head's forward and backward
    fwd_c = M * (r.embed_fwd_s + blocks * r.block_fwd_s + r.head_s)
    bwd_c = M * (blocks * r.block_bwd_s + r.embed_bwd_s) + recomputed * r.block_fwd_s
    upd_c = n_trained * r.update_elem_s  # the optimizer steps the trained parameters only
    if cpu_compute and r.widen_gbps > 0:  # a narrower base widened on the compute's thread, per fetch
        fwd_c += traffic.widen.get("forward", 0) / (r.widen_gbps * 1e9)
        bwd_c += traffic.widen.get("backward", 0) / (r.widen_gbps * 1e9)
    pcie_s = link_s(traffic, r) / 2  # half of it in each phase, added to the disk's (in series: an upper bound)
    fwd = _phase(
        "forward", fwd_c, traffic.forward_read, traffic.forward_write, r, ck, cpu_compute=cpu_compute, extra_io=pcie_s
    )
    fwd.time_s += first_read / (r.read_gbps * 1e9)
    bwd = _phase(
        "backward",
        bwd_c,
        traffic.backward_read,
        traffic.backward_write,
        r,
        ck,
        cpu_compute=cpu_compute,
        extra_io=pcie_s,
    )
    upd = _phase("update", upd_c, traffic.update_read, traffic.update_write, r, ck, cpu_compute=True)
    u_bytes = traffic.update_read + traffic.update_write
    # CPU seconds of the update off the trainer's thread: its kernel, checksums, I/O threads
    upd_cpu = upd_c + u_bytes / 1e9 * r.io_cpu_s_per_gb + (u_bytes / (r.crc_gbps * 1e9) if ck else 0.0)
    c = StepCosts(cfg, traffic, rates, fwd, bwd, upd, fwd_c, bwd_c, upd_c, upd_cpu, first_read, cpu_compute, pcie_s)
    phases, step, bound, notes = UPDATES[cfg.update.mode].predict_step(c)
    return Prediction(phases, step, bound, traffic, rates, notes)
