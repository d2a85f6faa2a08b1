"""Predicted step time: the bytes per step per link (``traffic``) over measured bandwidths,
the compute of each phase from measured unit times (``probe``), and the schedule's overlap.

A phase takes ``max(compute', I/O)``: the parameter store and the stash prefetch while the
device computes, so a phase is bound by the slower of the two (plus the first unit's read of
the forward, which nothing hides). On a CPU device ``compute'`` is the compute slowed, for
the share of the phase the disk is busy, by the factor measured with the disk reading in the
background (``io_slowdown``), plus the checksums' CPU over the cores.
The baseline update streams states through three buffer sets: bound by its I/O or its
kernel. The overlapped update (a thread) runs the same under the next forward (eager: under
the backward), adding its bytes and CPU to that phase. With the update engines the update runs during the next forward and backward on
the same disk: the step is bound by the slower of the trainer's phases and the disk's total
work of the step. The bound says which term set each phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Config
from .probe import Rates
from .traffic import Traffic

__all__ = ["Phase", "Prediction", "predict"]


@dataclass
class Phase:
    name: str
    compute_s: float
    io_s: float
    crc_s: float  # CPU seconds of CRC32C (one core)
    time_s: float
    bound: str


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


def _phase(name: str, compute: float, read: int, write: int, r: Rates, checksum: bool, *, cpu_compute: bool,
           extra_io: float = 0.0, extra_cpu: float = 0.0) -> Phase:
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


def predict(cfg: Config, traffic: Traffic, rates: Rates, *, blocks: int, kept: int, n_params: int,
            first_read: int, cpu_compute: bool, pcie_gbps: float | None = None, offloaded: int = 0) -> Prediction:
    """The predicted step of a run of ``cfg`` (see the module docstring). ``first_read``:
    bytes of the forward's first unit read from the file (0 when in memory); ``offloaded``:
    pairs read back instead of recomputed (their bytes are in ``traffic``)."""
    M, r, ck = cfg.data.micro_batches, rates, cfg.io.checksum
    recomputed = blocks * M - kept - offloaded
    # phases as the executor times them: the forward ends with the head's forward and backward
    fwd_c = M * (r.embed_fwd_s + blocks * r.block_fwd_s + r.head_s)
    bwd_c = M * (blocks * r.block_bwd_s + r.embed_bwd_s) + recomputed * r.block_fwd_s
    upd_c = n_params * r.update_elem_s
    pcie = lambda n: n / (pcie_gbps * 1e9) if pcie_gbps else 0.0  # noqa: E731
    fwd = _phase("forward", fwd_c, traffic.forward_read, traffic.forward_write, r, ck, cpu_compute=cpu_compute)
    fwd.time_s += first_read / (r.read_gbps * 1e9)
    bwd = _phase("backward", bwd_c, traffic.backward_read, traffic.backward_write, r, ck, cpu_compute=cpu_compute,
                 extra_io=pcie(traffic.up + traffic.down) / 2)
    upd = _phase("update", upd_c, traffic.update_read, traffic.update_write, r, ck, cpu_compute=True)
    notes = []
    u_bytes = traffic.update_read + traffic.update_write
    # CPU seconds of the update off the trainer's thread: its kernel, checksums, I/O threads
    eng_cpu = upd_c + u_bytes / 1e9 * r.io_cpu_s_per_gb + (u_bytes / (r.crc_gbps * 1e9) if ck else 0.0)
    if cfg.update.mode == "engines":
        # The update runs in the engines during the next forward and backward, on the same disk
        # and (on a CPU device) the same cores: their kernel, checksums and I/O threads' CPU.
        share = eng_cpu * fwd.compute_s / max(fwd.compute_s + bwd.compute_s, 1e-9)
        fwd = _phase("forward", fwd_c, traffic.forward_read, traffic.forward_write, r, ck, cpu_compute=cpu_compute,
                     extra_cpu=share if cpu_compute else 0.0)
        fwd.time_s += first_read / (r.read_gbps * 1e9)
        bwd = _phase("backward", bwd_c, traffic.backward_read, traffic.backward_write, r, ck, cpu_compute=cpu_compute,
                     extra_io=pcie(traffic.up + traffic.down) / 2, extra_cpu=eng_cpu - share if cpu_compute else 0.0)
        disk = traffic.read / (r.read_gbps * 1e9) + traffic.write / (r.write_gbps * 1e9)
        trainer = fwd.time_s + bwd.time_s
        step = max(trainer, disk, upd_c)
        bound = "trainer's forward+backward" if step == trainer else ("disk (whole step)" if step == disk else "update kernel")
        upd = Phase("update (engines, overlapped)", upd_c, upd.io_s, upd.crc_s, 0.0, "hidden")
        notes.append(f"engines: the update's bytes move during the next forward and backward; their CPU "
                     f"({eng_cpu:.2f} s a step) shares the cores with the trainer" if cpu_compute else
                     "engines: the update's bytes move during the next forward and backward")
    elif cfg.update.mode == "overlap":
        fwd, bwd, upd, note = _overlapped(cfg, traffic, r, fwd, bwd, upd, fwd_c, bwd_c, upd_c, eng_cpu, first_read,
                                          cpu_compute, pcie(traffic.up + traffic.down) / 2)
        notes.append(note)
        step = fwd.time_s + bwd.time_s + upd.time_s
        bound = max((fwd, bwd), key=lambda p: p.time_s).bound
    else:
        step = fwd.time_s + bwd.time_s + upd.time_s
        bound = max((fwd, bwd, upd), key=lambda p: p.time_s).bound
    return Prediction([fwd, bwd, upd], step, bound, traffic, rates, notes)


def _overlapped(cfg: Config, t: Traffic, r: Rates, fwd: Phase, bwd: Phase, upd: Phase, fwd_c: float, bwd_c: float,
                upd_c: float, upd_cpu: float, first_read: int, cpu_compute: bool, pcie_s: float):
    """``update.mode = "overlap"``: the update thread streams under the next forward (or, eager,
    under the backward). The phase it runs in takes at least the update's own time (its I/O,
    or its one thread's CPU on a CPU device), plus its bytes on the same disk and its CPU on
    the same cores. Upper bound on bytes: units the forward asks for before the update reaches
    them are handed over instead of read back (fewer reads than counted here)."""
    ck = cfg.io.checksum
    one = upd_c * (r.cores if cpu_compute else 1)  # the kernel in one thread (CPU device) or all
    thread_cpu = upd_cpu - upd_c + one
    own = max(upd.io_s, thread_cpu)  # the update thread alone: its I/O or its CPU
    extra_cpu = upd_cpu if cpu_compute else 0.0
    if cfg.update.eager:  # under the backward, in its order: the embedding's update is left for the next forward
        b = _phase("backward", bwd_c, t.backward_read, t.backward_write, r, ck, cpu_compute=cpu_compute,
                   extra_io=pcie_s + upd.io_s, extra_cpu=extra_cpu)
        b.time_s = max(b.time_s, own)
        f = fwd
        note = "overlap (eager): the update streams under the backward as each unit's gradient is home"
        return f, b, Phase("update (thread, under the backward)", upd_c, upd.io_s, upd.crc_s, 0.0, "hidden"), note
    f = _phase("forward", fwd_c, t.forward_read, t.forward_write, r, ck, cpu_compute=cpu_compute,
               extra_io=upd.io_s, extra_cpu=extra_cpu)
    f.time_s = max(f.time_s, own) + first_read / (r.read_gbps * 1e9)
    note = (f"overlap: the update ({own:.2f} s on its own) streams under the next forward, which waits for "
            "each unit's new parameters")
    return f, bwd, Phase("update (thread, under the next forward)", upd_c, upd.io_s, upd.crc_s, 0.0, "hidden"), note
