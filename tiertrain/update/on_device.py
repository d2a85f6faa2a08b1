"""The streamed optimizer's units whose states live in device memory (``memory.optim_device_mib``).

Where the compute device has memory of its own (CUDA), the fp32 master weights and moments of
the first trained units that fit the setting are allocated there (``StateDecl.device_units``)
and updated there, by the same fused AdamW (or SGD) call on the same segments, which on CUDA is
the kernel plain PyTorch's ``torch.optim.AdamW(fused=True)`` runs on its device-resident states.
Per element and step only the gradient goes up (2 bytes in bf16) and the new parameter comes
down (2 bytes) instead of 12 bytes of states being read and written by the host's cores: on an
H200 machine the host's update of a 3 B model took 4.5 s a step, longer than the GPU's whole
step in plain PyTorch (1.5 s).

Ordering: the chunk's copies and kernel run on a stream of their own (``Device.run_aside``), and
the update's thread waits for them (a sync point on that thread only, never the trainer's)
before the chunk's new parameters are handed over or the unit is reported updated, so the next
forward's load of the unit's host copy sees them. Gradients and parameters on the storage tier
go through the chunk's buffer set as on the host path. On the tests' simulated device (its
memory the host's) the same code runs with plain copies.
"""

from __future__ import annotations

import torch

from ..io import IOFuture

__all__ = ["DeviceStates"]

F32 = torch.float32


class DeviceStates:
    """The device part of a ``StreamedOptimizer`` (``opt``): which units it holds, the fp32
    scratch their gradients (and, without a master copy, parameters) are uploaded into, and one
    chunk's reads, update and writes."""

    def __init__(self, opt, dev, units: frozenset[int]) -> None:
        self.opt, self.dev, self.units = opt, dev, units
        n = max((opt.layout.units[u].numel if self.whole(u) else min(opt.chunk, opt.layout.units[u].numel)
                 for u in units), default=0)  # fmt: skip
        self.g = dev.empty(n, F32)
        self.p = dev.empty(n, F32) if not opt.has_master else None  # fp32 weights without a master: uploaded
        self.scratch_bytes = n * 4 * (1 if self.p is None else 2)
        # the regions' zeros were written on the compute stream; the update's copies and kernels
        # run on a stream of their own, not ordered after it: wait here, once (a sync point at start)
        dev.synchronize()

    def whole(self, u: int) -> bool:
        """Whether unit ``u`` is updated as one chunk: its states in device memory, its gradient
        and parameters in host memory (nothing passes through the buffer sets, which hold a
        chunk), so one wait a unit instead of one a chunk (about 1,900 chunks for a 3 B model)."""
        opt = self.opt
        return u in self.units and opt.grads.on_host(u) and opt._in_place(u)

    @staticmethod
    def build(opt, dev) -> DeviceStates | None:
        """The device part, where a state region holds units in device memory (else None)."""
        if dev is None:
            return None
        units = frozenset().union(*(r.device_units for r in opt.state_files if hasattr(r, "device_units")))
        return DeviceStates(opt, dev, units) if units else None

    @property
    def state_bytes(self) -> int:
        return sum(getattr(r, "device_bytes", 0) for r in self.opt.state_files)

    def reads(self, grads, bs, u: int, a: int, b: int) -> list[IOFuture]:
        """What the chunk needs from the storage tier: its gradient and (no master copy) its
        parameters where they are not in host memory."""
        futs = [] if grads.on_host(u) else [grads.read(u, bs.g, a, b)]
        if self.p is not None and not self.opt._in_place(u):
            futs.append(self.opt.params.read(u, bs.p, a, b))
        return futs

    def update(self, bs, grads, u: int, a: int, b: int, lr: float, coef: torch.Tensor | None) -> None:
        """The chunk's update on the device; returns once it has run and its new parameters
        are in host memory (the unit's host copy, or ``bs.p`` for the storage tier)."""
        opt, n = self.opt, b - a
        g_src = grads.host_view(u)[a:b] if grads.on_host(u) else bs.g[:n]
        p_host = opt._pview(bs, u, a, b)  # where the new parameters go (host memory)

        def work() -> None:
            g = self.g[:n]
            g.copy_(g_src, non_blocking=True)  # up, widened to fp32 on the way (exact)
            if self.p is None:
                w = opt.master.host_view(u)[a:b]  # device memory: the region's unit tensor
            else:
                w = self.p[:n]
                w.copy_(p_host, non_blocking=True)
            opt._apply(u, a, b, lr, coef, g, w, opt.m.host_view(u)[a:b], opt._view(opt.v, u, a, b))
            p_host.copy_(w if w.dtype == p_host.dtype else w.to(p_host.dtype), non_blocking=True)  # down

        self.dev.sync(self.dev.run_aside(work))  # sync point on the update's thread: the chunk has run

    def writes(self, bs, u: int, a: int, b: int) -> list[IOFuture]:
        """The chunk's new parameters to the storage tier where they are not in host memory."""
        opt = self.opt
        return [] if opt._in_place(u) else [opt.params.write(u, bs.p, a, b)]
