"""The overlapped update path (``update.mode = "overlap"``): the baseline's streamed
optimizer, same states and files, run by a background thread of the trainer's process so
that its I/O (12-16 bytes read and 12 written per parameter) runs under compute instead of
after it.

- With clipping (``optim.grad_clip > 0``) the global gradient norm is known only after the
  whole backward: ``step`` starts the update of every unit (layer 0 first, as the next
  forward needs them) and returns; the next forward's load of unit ``u`` waits for ``u``.
- Without (``update.eager = true``, ``grad_clip = 0``) each unit is updated as soon as its
  gradient is home, during the backward itself (units finish in the backward's order, the
  head first); the next forward waits only for the last few.

Where each unit's parameters stand (a checked state machine, ``UNIT``, one per unit, guarded
by one condition variable)::

    CURRENT --its update is queued--> QUEUED --a chunk is computed--> UPDATING
    QUEUED or UPDATING --every write of the unit is done--> CURRENT

A load of a unit not CURRENT (``ParamSource.load``) returns a future that completes when the
unit is CURRENT: asked for while it is QUEUED, the new parameters are copied into the load's
buffer as each chunk is computed (no read back from the file); while it is UPDATING, the read
starts when the unit is done. Host-resident parameters are used in place:
``settle(u)`` waits. A gradient for an UPDATING unit (the previous step's update still reads
the old one) waits too. The math is the baseline's, in the same order: bit-identical.

An error in the thread (an I/O error, a checksum mismatch) is raised, as it was raised, by
the next call that waits for the update.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
import time
from typing import Callable, Iterator

import torch

from ..config import Config
from ..io import IOFuture, Storage
from ..state.decl import Region
from ..state.layout import FlatLayout
from ..state.machine import Machine
from .base import UpdateStats
from .baseline import BaselineUpdate, RegionGrads, RegionParams

__all__ = ["OverlapUpdate", "UnitState", "update_threads"]


class UnitState(enum.Enum):
    CURRENT = "current"  # its parameters on storage (or in host memory) are the latest
    QUEUED = "queued"  # its update is queued or under way on earlier units: a load can be handed over
    UPDATING = "updating"  # chunks of it are computed: too late to hand the whole unit over
    SPECULATED = "speculated"  # its new state is in the other half; the step is not validated yet


UNIT = Machine(
    "overlapped update, unit",
    {
        UnitState.CURRENT: {UnitState.QUEUED},
        # a unit with no chunks goes straight back; a speculative one waits for the validation
        UnitState.QUEUED: {UnitState.UPDATING, UnitState.CURRENT, UnitState.SPECULATED},
        UnitState.UPDATING: {UnitState.CURRENT, UnitState.SPECULATED},
        # validated: kept (its halves flip) or redone (queued again, from the current half); or the
        # step was abandoned (an error before the validation): the current half stays
        UnitState.SPECULATED: {UnitState.CURRENT, UnitState.QUEUED},
    },
)


def update_threads(*, separate: bool) -> int:
    """torch's intra-op threads for the update's thread (set per thread: the trainer's keep
    theirs). On a CPU device one: the compute keeps the rest (measured on 2 cores: with the
    default, both threads' OpenMP teams fight for the cores and the forward slows more). Where
    device memory is separate (CUDA) all of the trainer's but one: the trainer's thread only
    launches kernels and copies, but it must get a core when it asks for one, or the GPU
    waits for its next kernel (the default, a new thread's OpenMP team of every core, would
    also ignore a CPU quota the trainer's threads were lowered to)."""
    return max(1, torch.get_num_threads() - 1) if separate else 1


class _Load:
    """A load of a unit that is still being updated (the parameter store's read future)."""

    def __init__(self, owner: "OverlapUpdate", u: int, out: torch.Tensor, handoff: bool) -> None:
        self.o, self.u, self.out, self.handoff = owner, u, out, handoff
        self.read: IOFuture | None = None  # set when the unit is done (no handoff)
        self.nbytes = out.numel() * out.element_size()

    def done(self) -> bool:
        return self.o.ready(self.u) and (self.handoff or (self.read is not None and self.read.done()))

    def get(self) -> int:
        self.o.wait_ready(self.u)  # sync point: the unit's update is complete
        if self.handoff:
            return self.nbytes
        return self.read.get()


class _Params(RegionParams):
    """The parameter region, with loads gated on the unit's update."""

    def __init__(self, owner: "OverlapUpdate", region) -> None:
        super().__init__(region)
        self.o = owner

    def load(self, u: int, out: torch.Tensor, slot: int | None = None):
        return self.o.load(u, out)

    def settle(self, u: int) -> float:
        return self.o.wait_ready(u)

    def settled(self, u: int) -> bool:
        return self.o.ready(u)


class _Grads(RegionGrads):
    """The gradient region: a gradient waits until the previous update of its unit is done
    with the old one; in eager mode, writing it queues the unit's update."""

    def __init__(self, owner: "OverlapUpdate", region) -> None:
        super().__init__(region)
        self.o = owner

    def claim(self, u: int) -> None:
        self.o.wait_ready(u)  # sync point, rare: only a unit the forward did not load (unused vocabulary)

    def write(self, u: int, src: torch.Tensor) -> IOFuture:
        self.o.wait_ready(u)  # as claim: the file's copy too is read by the update
        fut = self.region.write(u, src)
        if self.o.eager or self.o.spec.this_step:
            self.o.queue_unit(u, fut.watch())
        return fut

    def done_in_place(self, u: int) -> None:
        if self.o.eager or self.o.spec.this_step:
            self.o.queue_unit(u, IOFuture.completed())


class OverlapUpdate(BaselineUpdate):
    name = "overlap"
    beside_compute = supports_eager = speculates = True

    @classmethod
    def predict_step(cls, c):
        """The update thread streams under the next forward (eager: under the backward). That
        phase takes at least the update's own time (its I/O, or its one thread's CPU on a CPU
        device), plus its bytes on the same disk and its CPU on the same cores. Units the forward
        asks for before the update reaches them are handed over instead of read back: all of
        them where the update alone takes at least the forward's compute (the forward waits for
        it; 70-100% handed over in the runs measured), none where it runs ahead."""
        from .base import Phase

        t, r = c.traffic, c.rates
        one = c.upd_c * (r.cores if c.cpu_compute else 1)  # the kernel in one thread (CPU device) or all
        own = max(c.upd.io_s, c.upd_cpu - c.upd_c + one)  # the update thread alone: its I/O or its CPU
        extra_cpu = c.upd_cpu if c.cpu_compute else 0.0
        speculate = c.cfg.update.speculate == "on"
        if (
            c.cfg.update.eager or speculate
        ):  # under the backward, in its order: the embedding's is left for the next forward
            f = c.fwd
            b = c.phase(
                "backward",
                c.bwd_c,
                t.backward_read,
                t.backward_write,
                extra_io=c.upd.io_s,
                extra_cpu=extra_cpu,
            )
            b.time_s = max(b.time_s, own)
            u = Phase("update (thread, under the backward)", c.upd_c, c.upd.io_s, c.upd.crc_s, 0.0, "hidden")
            note = "overlap (eager): the update streams under the backward as each unit's gradient is home"
            if speculate:
                note = (
                    "overlap (speculative): the update streams under the backward as each unit's gradient is home, "
                    f"kept where the clip does not act; a step where it acts adds {own:.2f} s (the update redone)"
                )
        else:
            handed = t.forward_trained_read if own >= c.fwd_c else 0
            f = c.phase(
                "forward", c.fwd_c, t.forward_read - handed, t.forward_write, extra_io=c.upd.io_s, extra_cpu=extra_cpu
            )
            f.time_s = max(f.time_s, own) + c.first_read_s()
            b = c.bwd
            u = Phase("update (thread, under the next forward)", c.upd_c, c.upd.io_s, c.upd.crc_s, 0.0, "hidden")
            note = (
                f"overlap: the update ({own:.2f} s on its own) streams under the next forward, which waits for "
                "each unit's new parameters"
            )
        return [f, b, u], f.time_s + b.time_s + u.time_s, max((f, b), key=lambda p: p.time_s).bound, [note]

    def __init__(
        self, cfg: Config, layout: FlatLayout, storage: Storage, pdtype: torch.dtype, *, pin: bool, dev=None
    ) -> None:
        super().__init__(cfg, layout, storage, pdtype, pin=pin, dev=dev)
        # eager with clipping is speculation itself; once speculation stops for the run, the step's
        # update waits for the norm (queued unit by unit, it went unclipped from then on)
        self.eager = cfg.update.eager and not self.spec.on
        self.params, self.grads = _Params(self, self._params), _Grads(self, self._grads)
        n = len(layout.units)
        self._cv = threading.Condition()
        self._state = [UnitState.CURRENT] * n
        self._queued = [0] * n  # per unit: the step its last update was queued for
        self._loads: dict[int, list[_Load]] = {}
        self._error: BaseException | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # jobs queued or running
        self._busy = UpdateStats()  # the thread's time since the last record()
        self.handoff_bytes = 0
        self._threads = update_threads(separate=pin)
        self._callers_threads = torch.get_num_threads()  # put back when the thread ends (see _run)
        self._thread = threading.Thread(target=self._run, name="tiertrain-update", daemon=True)
        self._thread.start()

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)  # this thread's team; but torch also keeps it as the count
            # every thread started later takes: put back at the end (a train() run in a worker thread
            # after an overlapped one computed on 1 thread, its losses a rounding away from the CLI's)
        while True:
            job = self._jobs.get()
            if job is None:
                if self._threads is not None:
                    torch.set_num_threads(self._callers_threads)
                return
            try:
                if self._error is None:
                    job()
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer's next wait
                with self._cv:
                    self._error = exc
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            self._pending += 1
        self._jobs.put(job)

    def _stream(
        self, lr: float, coef: torch.Tensor | None, step: int, units: list[int] | None, wait: IOFuture | None = None
    ) -> None:
        if wait is not None:
            wait.get()  # the gradient is home (its checksums too: committed by the write itself)
        st = self.optim.step(
            lr, coef, step=step, units=units, on_unit_done=lambda u: self._unit_done(u, step), on_chunk=self._chunk
        )
        with self._cv:
            self._busy.add(st)

    def _chunk(self, u: int, a: int, b: int, p: torch.Tensor) -> None:
        with self._cv:
            if self._state[u] is UnitState.QUEUED:
                self._state[u] = UNIT.move(UnitState.QUEUED, UnitState.UPDATING, str(u))
            takers = [ld for ld in self._loads.get(u, ()) if ld.handoff]
        for ld in takers:  # new parameters straight into the slot waiting for them
            ld.out[a:b].copy_(p)

    def _unit_done(self, u: int, step: int) -> None:
        with self._cv:
            if not self.spec.judged_at(step):  # speculative: its new state waits in the other half for the judgement
                self._state[u] = UNIT.move(self._state[u], UnitState.SPECULATED, str(u))
                self._cv.notify_all()
                return
            self._finish(u)

    def _finish(self, u: int, flip: bool = True) -> None:
        """Unit ``u``'s update of a judged step is written: current (held under ``_cv``).
        ``flip`` False: an abandoned speculation, whose current half stays."""
        if self.spec.on and flip:
            self.optim.flip(u)  # every write went to the other half: it becomes the current one
        for ld in self._loads.pop(u, []):
            if ld.handoff:
                self.handoff_bytes += ld.nbytes
            else:
                ld.read = self._params.read(u, ld.out)
        self._state[u] = UNIT.move(self._state[u], UnitState.CURRENT, str(u))
        self._cv.notify_all()

    def _mark_updating(self, units, step: int) -> None:
        with self._cv:
            for u in units:
                self._state[u] = UNIT.move(self._state[u], UnitState.QUEUED, str(u))
                self._queued[u] = step

    # -- what the trainer's parts call ------------------------------------------------------------
    def ready(self, u: int) -> bool:
        with self._cv:
            return self._state[u] is UnitState.CURRENT

    def wait_ready(self, u: int) -> float:
        """Wait until unit ``u`` is CURRENT; returns the seconds waited. Raises the thread's error."""
        t0 = time.perf_counter()
        with self._cv:
            while self._state[u] is not UnitState.CURRENT and self._error is None:
                self._cv.wait()
            self._raise()
        return time.perf_counter() - t0

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def load(self, u: int, out: torch.Tensor):
        with self._cv:
            self._raise()
            if self._state[u] is UnitState.CURRENT:
                return self._params.read(u, out)
            # a speculative step's new parameters are handed over only once it is kept
            ld = _Load(
                self, u, out, handoff=self._state[u] is UnitState.QUEUED and self.spec.judged_at(self._queued[u])
            )
            self._loads.setdefault(u, []).append(ld)
            return ld

    def queue_unit(self, u: int, grad_home: IOFuture) -> None:
        """Eager mode: update unit ``u`` once ``grad_home`` completes."""
        lr, step = self._lr, self._step  # this step's, whenever the job runs
        self._mark_updating([u], step)
        self._submit(lambda: self._stream(lr, None, step, [u], grad_home))

    def wait_all(self) -> None:
        with self._cv:
            while self._pending and self._error is None:
                self._cv.wait()
            self._raise()

    # -- Update -----------------------------------------------------------------------------------
    def begin_step(self, step: int, lr: float) -> None:
        self._raise_now()
        if self.spec.this_step and not self.spec.judged_at(self._step):  # abandoned before its judgement (an error)
            self.wait_all()
            with self._cv:
                for u, st in enumerate(self._state):
                    if st is UnitState.SPECULATED:
                        self._finish(u, flip=False)  # the current half is untouched
        super().begin_step(step, lr)

    def _raise_now(self) -> None:
        with self._cv:
            self._raise()

    def step(self, step: int, lr: float, clip_coef: torch.Tensor | None) -> UpdateStats:
        """Start optimizer step ``step`` (eager: already under way, unit by unit); returns at
        once. The next forward waits per unit."""
        self._raise_now()
        if self.spec.this_step:
            self._judge(step, lr, clip_coef)
        elif not self.eager:
            self.wait_all()  # the previous step's is long done (the forward loaded every unit): no wait
            self._mark_updating([u.index for u in self.optim.trainable], step)  # a frozen unit is never updated
            self._submit(lambda: self._stream(lr, clip_coef, step, None))
        return UpdateStats()

    def _judge(self, step: int, lr: float, coef: torch.Tensor | None) -> None:
        """A speculative step's judgement, once the norm is known: kept (each unit flips as its
        update completes) or redone from the current half with ``coef``."""
        kept = self.spec.keeps(coef)  # sync point on CUDA: one scalar
        if kept:
            with self._cv:
                self.spec.judged(step, True)
                for u, st in enumerate(self._state):
                    if st is UnitState.SPECULATED:
                        self._finish(u)
                self._cv.notify_all()
            return
        self.wait_all()  # sync point: the speculation drained (every unit SPECULATED, its other half written)
        with self._cv:
            self.spec.judged(step, False)
            for unit in self.optim.trainable:
                u = unit.index
                self._state[u] = UNIT.move(self._state[u], UnitState.QUEUED, str(u))
                self._queued[u] = step
        self.redone += 1
        self._submit(lambda: self._stream(lr, coef, step, None))  # over the other half again

    @contextlib.contextmanager
    def regions(self) -> Iterator[dict[str, Region]]:
        self.wait_all()  # sync point: a checkpoint or export sees the finished step
        with super().regions() as r:
            yield r

    def record(self) -> dict:
        with self._cv:
            b, self._busy = self._busy, UpdateStats()
            handed, self.handoff_bytes = self.handoff_bytes, 0
        out = {"update_thread_s": b.seconds, "update_thread_wait_s": b.wait_s, "handoff_bytes": handed}
        if self.spec.on:  # the last step's judgement (None: it did not speculate) and the run's tally
            out.update(speculation_kept=self.spec.last, speculation=self.spec.summary())
        return out

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(BaseException):
                self.wait_all()  # an error here was (or will never be) reported by the step that hit it
            self._jobs.put(None)
            self._thread.join()
        super().close()
