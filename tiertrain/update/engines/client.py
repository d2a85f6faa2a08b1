"""The trainer's side of the update engines (``update.mode = "engines"``): ``EngineUpdate``.

Starts one engine process (``worker.py``) per storage path (or ``update.engines``), hands
them gradient slices through fixed shared-memory slots (two per engine: back-pressure,
nothing grows), tells them to step, and lets the next forward load unit ``u`` as soon as
every engine has written it: the update runs under the next forward. Parameters are read
straight from the engines' files; each engine's ``Done`` carries the checksums of the blocks
it wrote, so reads are verified as on any other file. On CPU the parameter slots are shared
too: a unit the forward waits for gets its new parameters from the engines directly.

A dead engine is noticed at once (its connection closes), a silent one after
``update.engine_timeout_s``; either stops the trainer with an ``EngineError`` naming the
engine and its path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import time
from multiprocessing.connection import wait as mp_wait
from typing import Callable, Iterator

import torch

from ...compress.feedback import ErrorFeedback
from ...config import Config
from ...io import FileHandle, IOFuture, Storage, round_up
from ...io.align import pin_in_place
from ...state.decl import Region, StateDecl
from ...state.double import second_file
from ...state.layout import FlatLayout, chunk_align
from ...state.regions import place
from ...state.slices import unit_records
from ..base import Update, UpdateStats
from ..shm import SharedSegment
from ..speculate import Speculation
from . import protocol as P
from .decl import MIB, SLOTS, declare_states, engine_file, engine_states, frozen_of, slice_views, slot_bytes_of
from .protocol import ENGINE, EngineError, EngineState
from .seams import EngineGrads, EngineParams, EngineRegion, EngineScales, Handoff
from .sockets import launch

__all__ = ["EngineUpdate", "EngineError", "engine_file"]

log = logging.getLogger("tiertrain")


def engine_timeout(cfg: Config) -> float:
    """``update.engine_timeout_s``; with ranks, at most half of ``ranks.timeout_s``: an engine that
    stopped answering is named by its own rank (which kills it, closing) before another rank's
    collective times out waiting for that rank, blames it, and the launcher kills the rank, leaving
    its stopped engine behind."""
    from ...dist.group import env_world

    t = cfg.update.engine_timeout_s
    if env_world()[1] > 1 and t > cfg.ranks.timeout_s / 2:
        t = cfg.ranks.timeout_s / 2
        if env_world()[0] == 0:
            log.info(
                "update.engine_timeout_s = %g is taken as %g s: half of ranks.timeout_s = %g, so that a hung "
                "engine is named before its rank is",
                cfg.update.engine_timeout_s,
                t,
                cfg.ranks.timeout_s,
            )
    return t


class EngineUpdate(Update):
    name = "engines"
    beside_compute = supports_eager = speculates = compresses = True
    states_in_trainer = False  # the engines keep parameters and optimizer state in their own files

    @classmethod
    def fixed_pools(cls, cfg: Config, rt) -> dict[str, int]:
        from .costs import engine_pools

        return engine_pools(cfg, rt)

    @classmethod
    def predict_step(cls, c):
        from .costs import predict_engines

        return predict_engines(c)

    # -- declarations (decl.py) ---------------------------------------------------------------------
    engine_states = staticmethod(engine_states)

    @classmethod
    def declare(
        cls, cfg: Config, layout: FlatLayout, pdtype: torch.dtype, align: int, paths: list[str]
    ) -> list[StateDecl]:
        return declare_states(cfg, layout, pdtype, align, paths)

    # -- construction ------------------------------------------------------------------------------------
    def __init__(
        self, cfg: Config, layout: FlatLayout, storage: Storage, pdtype: torch.dtype, *, pin: bool, dev=None
    ) -> None:
        self.layout, self.storage, self.cfg, self.pdtype = layout, storage, cfg, pdtype
        self.n = cfg.update.engines or len(storage.paths)
        self.path_of = [i % len(storage.paths) for i in range(self.n)]
        self.paths = [storage.paths[j] for j in self.path_of]
        self.align = storage.record_align
        self.slices, self.views = slice_views(layout, self.n, chunk_align(self.align, pdtype))
        self.states = self.declare(cfg, layout, pdtype, self.align, storage.paths)
        self._engine_states = self.engine_states(cfg, layout, pdtype, self.align, storage.paths)
        self.slot_bytes = slot_bytes_of(self.views)
        self.timeout = engine_timeout(cfg)
        # speculating (``update/speculate.py``), each engine updates a unit as its gradient
        # arrives, into the other half of its states, and keeps the gradient for a redo; the
        # step's judgement comes with ``Step`` (eager with clipping means exactly that)
        self.spec = Speculation(on=cfg.update.speculate == "on")
        self.eager = cfg.update.eager and not self.spec.on
        self.redone = 0  # speculative steps redone with the clip (each one more update's I/O)
        self.wasted_numel = 0  # elements updated speculatively in steps then redone (every trained one)
        self.procs: list = []
        self.conns: list = []
        self.shms: list[SharedSegment] = []
        self.state = [EngineState.STARTING] * self.n
        self._acks: list[type] = [type(None)] * self.n  # the last acknowledgement of each engine
        self._free = [list(range(SLOTS)) for _ in range(self.n)]
        self._done: dict[int, set[int]] = {u.index: set(range(self.n)) for u in layout.units}
        self._served: dict[int, list[int]] = {u.index: [-1] * self.n for u in layout.units}
        self._slot_shm: SharedSegment | None = None  # the parameter slots, when shared (CPU)
        self._want: torch.Tensor | None = None
        self.handoff_bytes = 0  # new parameters the engines wrote straight into the trainer's slots
        self._seen = [time.time()] * self.n
        self._progress = [0] * self.n
        self._moved = time.time()  # last time any engine made progress
        self._hung: set[int] = set()  # engines reported silent or stuck: killed at close, not waited for
        self._readers: list[list[FileHandle | None]] = []  # per engine, its parameter file's halves
        # per engine and unit, the half of its states holding the committed step (each engine's
        # ``Done`` says; always 0 where states are held once)
        self._half = [[0] * len(layout.units) for _ in range(self.n)]
        self.halves = 2 if self.spec.on else 1
        self._place = [place(v, pdtype, 0, self.align) for v in self.views]
        self.sent_bytes = 0  # gradient bytes handed to engines (trainer -> engine)
        self.dense_bytes = 0  # what they would have been uncompressed
        self.topk = cfg.update.topk
        residual = next((d for d in self.states if d.name == "residual"), None)
        self.feedback = ErrorFeedback(layout, storage, residual) if residual is not None else None
        self.stepped: list[P.StepReport] = []
        self.slot_wait_s = 0.0  # time the trainer waited for a free gradient slot (back-pressure)
        self._steps_sent = 0  # steps each engine reports on (one report each)
        self.peak_host = [0] * self.n  # each engine's peak RSS, as of its last step report
        self._step, self._lr = 0, 0.0
        self._seen_counters: dict[str, float] = {}
        self.params, self.grads = EngineParams(self), EngineGrads(self)
        self._pin, self._pinned = pin, []
        try:
            self._start(cfg)
            self._open_readers()
        except BaseException:
            self.close()
            raise

    @property
    def engines(self) -> "EngineUpdate":  # the trainer's ``engines`` (tests and benchmarks look here)
        return self

    def _move(self, i: int, new: EngineState) -> None:
        self.state[i] = ENGINE.move(self.state[i], new, f"{i} ({self.paths[i]})")

    # -- processes ----------------------------------------------------------------------------------
    def _start(self, cfg: Config) -> None:
        specs = []
        for i in range(self.n):
            shm = SharedSegment(SLOTS * self.slot_bytes)
            self.shms.append(shm)
            specs.append(
                dict(
                    records=unit_records(self.layout),
                    slices=[(s.unit, s.start, s.end) for s in self.slices[i]],
                    frozen=sorted(frozen_of(self.layout)),
                    param_dtype=str(self.pdtype).removeprefix("torch."),
                    io={**dataclasses.asdict(cfg.io), "paths": [self.paths[i]]},
                    optim=dataclasses.asdict(cfg.optim),
                    states=self._engine_states[i],
                    shm=shm.name,
                    shm_bytes=shm.size,
                    slot_bytes=self.slot_bytes,
                    threads=1,
                    eager=self.eager,
                    topk=cfg.update.topk > 0,
                    buffer_bytes=cfg.memory.update_buffer_kib << 10,
                    ahead_bytes=cfg.memory.engine_read_ahead_mib * MIB // self.n,
                )
            )
        self.conns = launch(specs, self.paths, max(120.0, self.timeout), self.procs)
        self._pump(
            lambda: all(s == EngineState.READY for s in self.state), "starting", timeout=max(120.0, self.timeout)
        )
        for shm in self.shms:  # every engine has mapped its slots
            shm.unlink()
        if self._pin:  # gradients come from a CUDA device: page-lock the slots for asynchronous copies
            for shm in self.shms:  # one at a time: close() unpins what was pinned if one fails
                self._pinned.append(pin_in_place(shm.tensor))

    def open_file(self, i: int, kind: str, mode: str, dtype: torch.dtype, half: int = 0) -> FileHandle | None:
        """Engine ``i``'s file of ``kind`` (None when its slices are all empty: no file); of a
        state held twice, the file of ``half``."""
        st = self.storage
        if not next(d for d in self._engine_states[i] if d.name == kind).files:
            return None
        name = engine_file(i, kind)
        return FileHandle(
            os.path.join(self.paths[i], second_file(name) if half else name),
            mode,
            direct=st.direct,
            checksum=st.checksum,
            checksum_block=st.checksum_block,
            workers=st.workers[self.path_of[i]],
        )

    def _open_readers(self) -> None:
        self._readers = [
            [self.open_file(i, "params", "r", self.pdtype, h) for h in range(self.halves)] for i in range(self.n)
        ]

    def files_of(self, files: list[list], u: int) -> list:
        """Per engine, of its file's halves ``files[i]``, the one holding unit ``u``'s committed state."""
        return [f[self._half[i][u]] for i, f in enumerate(files)]

    def _send(self, i: int, msg) -> None:
        try:
            self.conns[i].send(msg)
        except OSError as exc:  # a broken pipe: the engine went
            # a killed engine's end of the pipe closes before its exit status is ready: wait for it
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[i].wait(timeout=5)
            self._check(i, "receiving a command")
            raise EngineError(
                f"update engine {i} ({self.paths[i]}) closed its connection while receiving a command ({exc})"
            ) from exc

    def _handle(self, i: int, msg) -> None:
        now = self._seen[i] = time.time()
        if not isinstance(msg, P.Alive) or msg.progress != self._progress[i]:
            self._moved = now
        if isinstance(msg, P.Alive):
            self._progress[i] = msg.progress
        elif isinstance(msg, P.Free):
            self._free[i].append(msg.slot)
        elif isinstance(msg, P.Done):
            self._half[i][msg.unit] = msg.half
            if msg.crcs and self._readers and self._readers[i][msg.half] is not None:
                self._readers[i][msg.half].set_checksums(msg.first_block, list(msg.crcs))
            self._served[msg.unit][i] = msg.served_slot
            self._done[msg.unit].add(i)
        elif isinstance(msg, P.Stepped):
            self.stepped.append(dataclasses.replace(msg.report, engine=i))
            self.peak_host[i] = msg.report.peak_host  # the engine's VmHWM: already its peak so far
        elif isinstance(msg, P.Failed):
            log.debug("update engine %d failed:\n%s", i, msg.traceback)
            raise EngineError(f"update engine {i} ({self.paths[i]}) failed: {msg.line}")
        elif isinstance(msg, P.Ready):
            self._move(i, EngineState.READY)
        elif isinstance(msg, P.Released):
            self._move(i, EngineState.RELEASED)
        elif isinstance(msg, P.Reopened):
            self._move(i, EngineState.READY)
        else:
            self._acks[i] = type(msg)

    def _drain(self) -> None:
        for i, c in enumerate(self.conns):
            try:
                while c.poll():
                    self._handle(i, c.recv())
            except (EOFError, OSError):
                self._check(i, "sending")

    def _check(self, i: int, what: str) -> None:
        p = self.procs[i]
        if p.poll() is not None:
            raise EngineError(f"update engine {i} ({self.paths[i]}) died (exit code {p.returncode}) while {what}")
        if time.time() - self._seen[i] > self.timeout:
            self._hung.add(i)
            raise EngineError(
                f"update engine {i} ({self.paths[i]}) has not answered for {self.timeout:.0f} s while {what}; "
                "it may be hung (see update.engine_timeout_s)"
            )

    def _pump(self, until: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Handle engine messages until ``until()``; raise if an engine dies or goes silent."""
        t_end = None if timeout is None else time.time() + timeout
        self._moved = max(self._moved, time.time() - 1.0)
        while True:
            self._drain()
            if until():
                return
            for i in range(self.n):
                self._check(i, what)
            if timeout is None and time.time() - self._moved > self.timeout:
                self._hung.update(range(self.n))
                raise EngineError(
                    f"waited {self.timeout:.0f} s for the update engines while {what} and none made progress "
                    f"(engines at {self._progress}); an engine may be hung (see update.engine_timeout_s)"
                )
            if t_end is not None and time.time() > t_end:
                raise EngineError(f"update engines did not finish {what} within {timeout:.0f} s")
            mp_wait(self.conns, timeout=0.2)  # a dead engine's connection becomes readable (EOF)

    # -- shared-memory slots ---------------------------------------------------------------------------
    def _slot(self, i: int, k: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.shms[i].tensor[k * self.slot_bytes : (k + 1) * self.slot_bytes].view(dtype)[:numel]

    def _take(self, i: int, what: str) -> int:
        t0 = time.perf_counter()
        self._pump(lambda: bool(self._free[i]), what)  # back-pressure: wait for a free slot
        self.slot_wait_s += time.perf_counter() - t0
        return self._free[i].pop()

    # -- the update interface --------------------------------------------------------------------------
    def init_unit(self, u: int, flat32: torch.Tensor) -> None:
        """Give each engine its slice of unit ``u``'s initial fp32 weights."""
        self._done[u] = set()
        for i in range(self.n):
            s = self.slices[i][u]
            k = self._take(i, "initialising weights")
            self._slot(i, k, torch.float32, s.numel).copy_(flat32[s.start : s.end])
            self._send(i, P.Init(u, k))

    def finish_init(self) -> None:
        self.wait_all("initialising weights")

    def wait_all(self, what: str = "updating") -> None:
        """Until every engine has finished every unit and reported its last step."""
        self._pump(
            lambda: (
                all(len(d) == self.n for d in self._done.values()) and len(self.stepped) == self._steps_sent * self.n
            ),
            what,
        )

    def ready(self, u: int) -> bool:
        self._drain()
        return len(self._done[u]) == self.n

    def wait_ready(self, u: int) -> None:
        self._pump(lambda: len(self._done[u]) == self.n, f"updating unit {u}")

    def slice_io(
        self,
        files: list,
        place_: list[dict],
        esize: int,
        write: bool,
        u: int,
        buf: torch.Tensor,
        start: int,
        end: int | None,
        engines: list[int] | None = None,
    ) -> IOFuture:
        """Elements ``[start, end)`` of unit ``u``, split by owner: each engine's part (of
        ``engines``, default all) read from (or written to) its file ``files[i]`` at the
        unit's place there."""
        end = self.layout.units[u].numel if end is None else end
        futs = []
        for i in range(self.n) if engines is None else engines:
            s = self.slices[i][u]
            a, b = max(start, s.start), min(end, s.end)
            if a < b:
                off = (place_[i][u] + a - s.start) * esize
                op = files[i].pwrite if write else files[i].pread
                futs.append(op(buf[a - start : b - start], (b - a) * esize, off))
        return IOFuture.gather(futs)

    def read_params(
        self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None, engines: list[int] | None = None
    ) -> IOFuture:
        files = self.files_of(self._readers, u)
        return self.slice_io(files, self._place, self.pdtype.itemsize, False, u, out, start, end, engines)

    def share_slots(self, count: int, numel: int) -> list[torch.Tensor] | None:
        """On CPU: ``count`` parameter slots of ``numel`` elements in shared memory, mapped by
        every engine too: a unit the trainer is waiting for gets its new parameters copied into
        its slot by the engines as they update it, instead of read back from their files. Same
        memory as private slots; the mapping is torch's own (no buffer exports)."""
        stride = round_up(numel * self.pdtype.itemsize, 4096)
        nu = len(self.layout.units)
        want_at = count * stride
        self._slot_shm = SharedSegment(want_at + round_up(4 * nu, 4096))
        mem = self._slot_shm.tensor
        self._want = mem[want_at : want_at + 4 * nu].view(torch.int32)
        self._want.zero_()
        self._acks = [type(None)] * self.n
        for i in range(self.n):
            self._send(i, P.Slots(self._slot_shm.name, stride, count, want_at))
        self._pump(lambda: all(a is P.Attached for a in self._acks), "mapping the parameter slots")
        self._slot_shm.unlink()
        return [mem[k * stride : k * stride + numel * self.pdtype.itemsize].view(self.pdtype) for k in range(count)]

    def handoff(self, u: int, slot: int, out: torch.Tensor) -> "Handoff | None":
        """Ask the engines to write unit ``u``'s new parameters into shared slot ``slot``
        (``out``, its view) as they update it. None when ``u`` is already updated (read it
        from the files) or the slots are not shared."""
        if self._want is None or self.ready(u):
            return None
        self._want[u] = slot + 1  # seen by an engine when it starts the unit, or not at all
        return Handoff(self, u, slot, out)

    def take_handoff(self, u: int, slot: int, out: torch.Tensor) -> int:
        """Bytes of unit ``u`` in shared slot ``slot`` once every engine has updated it: the
        engines that wrote the slot served theirs; the slices of those that had started the unit
        before the request are read from their files into ``out``."""
        self.wait_ready(u)  # sync point: every engine has finished unit u
        self._want[u] = 0
        late = [i for i in range(self.n) if self._served[u][i] != slot]
        served = sum(self.slices[i][u].numel for i in range(self.n) if i not in late) * self.pdtype.itemsize
        self.handoff_bytes += served
        read = self.read_params(u, out, engines=late) if late else None
        return served + (read.get() if read is not None else 0)

    @property
    def shares_slots(self) -> bool:
        """Whether the parameter slots are shared with the engines (``share_slots``)."""
        return self._want is not None

    def begin_step(self, step: int, lr: float) -> None:
        """Engines that update as gradients arrive need the step and learning rate with the
        first gradient. A step abandoned before its judgement (an error) wrote only other
        halves: begun again, the engines speculate over them."""
        self._step, self._lr = step, lr
        self.spec.begin(step)

    def send_grads(self, u: int, g: torch.Tensor) -> IOFuture:
        """Hand unit ``u``'s complete gradient to the engines (copied into their slots)."""
        if self.eager:
            self._done[u] = set()  # updated as soon as it arrives: the next forward waits for it
        if self.topk:
            return self._send_topk(u, g)
        taken = []
        for i in range(self.n):  # device -> the engines' page-locked slots, every copy in flight at once
            s = self.slices[i][u]
            k = self._take(i, f"receiving gradients of unit {u}")
            self._slot(i, k, self.pdtype, s.numel).copy_(g[s.start : s.end], non_blocking=g.is_cuda)
            taken.append((i, k, s.numel))
        if g.is_cuda:
            torch.cuda.current_stream(g.device).synchronize()  # sync point: one per unit, not per engine
        for i, k, n in taken:
            self.sent_bytes += n * self.pdtype.itemsize
            self.dense_bytes += n * self.pdtype.itemsize
            self._send(i, P.Grad(u, k, self._step, self._lr, spec=self.spec.this_step))
        return IOFuture.completed(g.numel() * g.element_size())

    def _send_topk(self, u: int, g: torch.Tensor) -> IOFuture:
        """Top-k per engine slice; with error feedback, the residual is added before and
        what was dropped is kept for the next step."""
        from ...compress.topk import pack, topk_encode

        src = self.feedback.add(u, g) if self.feedback is not None else g
        for i in range(self.n):
            s = self.slices[i][u]
            k = self._take(i, f"receiving gradients of unit {u}")
            idx, vals = topk_encode(src[s.start : s.end], self.topk)
            raw = self._slot(i, k, torch.uint8, self.slot_bytes)
            self.sent_bytes += pack(idx, vals.to(self.pdtype), raw)  # sync point on CUDA
            self.dense_bytes += s.numel * self.pdtype.itemsize
            self._send(i, P.Grad(u, k, self._step, self._lr, idx.numel(), spec=self.spec.this_step))
            if self.feedback is not None:
                src[s.start : s.end][idx.long()] = 0  # sent: what is left is the residual
        if self.feedback is not None:
            self.feedback.keep(u, src)
        return IOFuture.completed(g.numel() * g.element_size())

    def step(self, step: int, lr: float, clip_coef: torch.Tensor | None) -> UpdateStats:
        """Start optimizer step ``step`` on every engine; returns at once. The next forward
        waits per unit (``ParamSource.load``)."""
        self._steps_sent += 1  # each engine reports every step (eager ones as their last unit is done)
        if self.eager:
            return UpdateStats()  # already applied as gradients arrived
        kept = None  # the judgement the engines act on (None: nothing speculated)
        if self.spec.this_step:
            kept = self.spec.keeps(clip_coef)  # sync point on CUDA: one scalar
            self.spec.judged(step, kept)
            if not kept:
                self.redone += 1
                self.wasted_numel += sum(x.numel for x in self.layout.units if not x.frozen)
        for u in self._done:
            if not self.layout.units[u].frozen:  # a frozen unit is never updated: always current
                self._done[u] = set()
        if self._want is not None:
            self._want.zero_()  # no engine reads it until it gets Step
        c = None if clip_coef is None else float(clip_coef.to("cpu"))  # exact: a float32 widened to double
        for i in range(self.n):
            self._send(i, P.Step(step, lr, c, kept))
        return UpdateStats()

    @contextlib.contextmanager
    def regions(self) -> Iterator[dict[str, Region]]:
        """Pause the engines and open their state files here (for saving or restoring)."""
        self.wait_all("finishing the update before a checkpoint")
        for i in range(self.n):
            self._send(i, P.Release())
        self._pump(lambda: all(s == EngineState.RELEASED for s in self.state), "releasing files")
        for r in (h for hs in self._readers for h in hs):
            if r is not None:
                r.close()
        regions: dict = {}
        try:
            for d in self.states:
                if d.name == "residual":
                    regions[d.name] = self.feedback.region
                elif d.name == "exp_avg_scales":  # per slice records, joined into whole units'
                    regions[d.name] = EngineScales(self)
                elif d.checkpointed:
                    regions[d.name] = EngineRegion(self, d.name, d.dtype)
            yield regions
        finally:
            for r in regions.values():
                if isinstance(r, (EngineRegion, EngineScales)):
                    r.close()
            for i in range(self.n):
                self._send(i, P.Reopen())
            self._pump(lambda: all(s == EngineState.READY for s in self.state), "reopening files")
            self._open_readers()

    def pools(self) -> dict[str, int]:
        extra = self.feedback.pool_bytes if self.feedback is not None else 0
        return {"engine slots (shared memory)": sum(s.size for s in self.shms) + extra}

    @property
    def pool_bytes(self) -> int:
        return sum(self.pools().values())

    def record(self) -> dict:
        """Bytes handed to the engines, and what they moved on their storage, since the last
        record (an engine's update of step s is reported while step s + 1 runs)."""
        counters = {
            "engine_sent_bytes": self.sent_bytes,
            "engine_dense_bytes": self.dense_bytes,
            "engine_handoff_bytes": self.handoff_bytes,
            "engine_slot_wait_s": self.slot_wait_s,  # the backward blocked on engines taking gradients
            "reports": len(self.stepped),
        }
        seen, self._seen_counters = self._seen_counters, counters
        since = {k: v - seen.get(k, 0) for k, v in counters.items()}
        reports = self.stepped[len(self.stepped) - since.pop("reports") :]
        return {
            **since,
            "engine_read_bytes": sum(r.read for r in reports),
            "engine_write_bytes": sum(r.written for r in reports),
            "engine_update_s": max((r.seconds for r in reports), default=0.0),
            "engine_wait_s": max((r.wait_s for r in reports), default=0.0),
            "engine_compute_s": max((r.compute_s for r in reports), default=0.0),
            "engine_cpu_s": sum(r.cpu_s for r in reports),  # all engines, since their last report
            "engine_peak_host_bytes": sum(self.peak_host),  # the engines run side by side: their peaks add up
            # the last step's judgement (None: it did not speculate) and the run's tally
            **({"speculation_kept": self.spec.last, "speculation": self.spec.summary()} if self.spec.on else {}),
        }

    def restored(self, step: int) -> None:
        self.spec.judged_through = step  # the checkpoint's step was kept (a checkpoint never holds another)

    def close(self) -> None:
        """Stop the engines (killed after 10 s; one reported silent or stuck at once: it would
        not answer, and the run would end 10 s after its error said) and free everything,
        whatever state they are in: a dead or failed engine does not keep the others or the
        files from closing."""
        for i, p in enumerate(self.procs):
            if p.poll() is None and i in self._hung:
                p.kill()
            elif p.poll() is None and i < len(self.conns) and self.conns[i] is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.conns[i].send(P.Stop())
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.state = [EngineState.STOPPED] * self.n
        for c in self.conns:
            if c is not None:
                with contextlib.suppress(OSError):
                    c.close()
        for r in (h for hs in self._readers for h in hs):
            if r is not None:
                with contextlib.suppress(Exception):
                    r.close()
        if self.feedback is not None:
            with contextlib.suppress(Exception):
                self.feedback.close()
        for shm in self.shms + ([self._slot_shm] if self._slot_shm is not None else []):
            shm.unlink()
        for unpin in self._pinned:
            unpin()
        self.procs, self.shms, self._readers, self.conns, self._pinned = [], [], [], [], []
