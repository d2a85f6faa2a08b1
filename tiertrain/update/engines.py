"""The trainer's side of the update engines (``update.mode = "engines"``).

Starts one engine process per storage path (or ``update.engines``), hands them gradient
slices through fixed shared-memory slots (two per engine: back-pressure, nothing grows),
tells them to step, and lets the next forward load unit ``u`` as soon as every engine has
written it: the update runs under the next forward. Parameters are read straight from the
engines' files; each engine's "done" message carries the checksums of the blocks it wrote,
so reads are verified as on any other file. A dead engine is noticed at once (process
sentinel), a silent one after ``update.engine_timeout_s``; either stops the trainer with an
error naming the engine and its path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener
from multiprocessing.connection import wait as mp_wait
from typing import Callable, Iterator

import torch

from ..config import Config
from ..io import FileHandle, IOFuture, Storage, round_up
from ..state.layout import UNIT_ALIGN, FlatLayout
from ..state.regions import TieredRegions
from ..errors import TiertrainError
from .engine import engine_file
from .shm import SharedSegment
from .slices import SliceLayout, partition, unit_records

__all__ = ["EngineGroup", "EngineError"]

log = logging.getLogger("tiertrain")
MIB = 1 << 20
SLOTS = 2


class EngineError(TiertrainError, RuntimeError):
    """An update engine died, hung or failed."""


class EngineGroup:
    def __init__(self, layout: FlatLayout, storage: Storage, cfg: Config, param_dtype: torch.dtype) -> None:
        self.layout, self.storage, self.cfg, self.pdtype = layout, storage, cfg, param_dtype
        self.n = cfg.update.engines or len(storage.paths)
        self.path_of = [i % len(storage.paths) for i in range(self.n)]
        self.paths = [storage.paths[j] for j in self.path_of]
        align = max(UNIT_ALIGN, storage.record_align // min(param_dtype.itemsize, 4))
        self.slices = partition(layout, self.n, align)
        records = unit_records(layout)
        self.views = [SliceLayout(records, s) for s in self.slices]
        self.slot_bytes = max(4096, round_up(max(v.max_unit_numel for v in self.views) * 4, 4096))
        self.timeout = cfg.update.engine_timeout_s
        self.eager = cfg.update.eager
        self.procs: list = []
        self.conns: list = []
        self.shms: list[SharedSegment] = []
        self._free = [list(range(SLOTS)) for _ in range(self.n)]
        self._done: dict[int, set[int]] = {u.index: set(range(self.n)) for u in layout.units}
        self._served: dict[int, list[int]] = {u.index: [-1] * self.n for u in layout.units}
        self._slot_shm: SharedSegment | None = None  # the parameter slots, when shared (CPU)
        self._want: torch.Tensor | None = None
        self.handoff_bytes = 0  # new parameters the engines wrote straight into the trainer's slots
        self._seen = [time.time()] * self.n
        self._progress = [0] * self.n
        self._moved = time.time()  # last time any engine made progress
        self._state = [""] * self.n
        self._readers: list[FileHandle] = []
        self._place = [TieredRegions.place(v, param_dtype, 0, storage.record_align) for v in self.views]
        self.sent_bytes = 0  # gradient bytes handed to engines (trainer -> engine)
        self.dense_bytes = 0  # what they would have been uncompressed
        self.topk = cfg.update.topk
        self.residual = (
            TieredRegions(layout, storage, "residual.bin", torch.float32, host_bytes=cfg.memory.residual_host_mib * MIB)
            if cfg.update.error_feedback
            else None
        )
        self._rbuf = torch.empty(layout.max_unit_numel, dtype=torch.float32) if self.residual is not None else None
        self.stepped: list[dict] = []
        self.slot_wait_s = 0.0  # time the trainer waited for a free gradient slot (back-pressure)
        self._steps_sent = 0  # "step" messages sent to every engine (each answers with one report)
        self.peak_host = [0] * self.n  # each engine's peak RSS, as of its last step report
        self._step, self._lr = 0, 0.0
        try:
            self._start(cfg)
            self._open_readers()
        except BaseException:
            self.close()
            raise

    # -- processes ----------------------------------------------------------------------------------
    def _start(self, cfg: Config) -> None:
        # Fresh interpreters (`python -m tiertrain.update.engine`), connected back over an
        # authenticated Unix socket: unlike multiprocessing's spawn, nothing of the trainer's
        # own script is re-run in them, and unlike fork, no thread or lock is copied.
        key = secrets.token_bytes(16)
        self._sockdir = tempfile.mkdtemp(prefix="tiertrain-engines-")
        address = os.path.join(self._sockdir, "socket")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        env = dict(os.environ, TIERTRAIN_ENGINE_KEY=key.hex())
        m = cfg.memory
        specs = []
        for i in range(self.n):
            shm = SharedSegment(SLOTS * self.slot_bytes)
            self.shms.append(shm)
            spec = dict(
                records=unit_records(self.layout),
                slices=[(s.unit, s.start, s.end) for s in self.slices[i]],
                param_dtype=str(self.pdtype).removeprefix("torch."),
                io={**dataclasses.asdict(cfg.io), "paths": [self.paths[i]]},
                optim=dataclasses.asdict(cfg.optim),
                shm=shm.name,
                shm_bytes=shm.size,
                slot_bytes=self.slot_bytes,
                threads=1,
                eager=self.eager,
                topk=cfg.update.topk > 0,
                grad_host_bytes=m.grad_host_mib * MIB // self.n,
                optim_host_bytes=0,  # engines keep optimizer state in their files (checkpoints read them there)
                buffer_bytes=m.update_buffer_kib << 10,
                ahead_bytes=m.engine_read_ahead_mib * MIB // self.n,
            )
            specs.append(spec)
            # A session of its own: Ctrl-C at the terminal reaches the trainer only, which stops
            # at a step boundary and then stops the engines itself.
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tiertrain.update.engine", address, str(i)], env=env,
                                               start_new_session=True))
        self.conns = [None] * self.n
        accepted: list = []

        def accept_all() -> None:
            for _ in range(self.n):
                accepted.append(listener.accept())

        t = threading.Thread(target=accept_all, daemon=True, name="tiertrain-engine-accept")
        t.start()
        deadline = time.time() + max(120.0, self.timeout)
        try:
            while t.is_alive() and time.time() < deadline and all(p.poll() is None for p in self.procs):
                t.join(0.2)  # a start that never connects must not hang us
        finally:  # connected, failed or interrupted: nothing left in the temp dir
            listener.close()  # unlinks the socket
            os.rmdir(self._sockdir)
            self._sockdir = None
        if t.is_alive():
            dead = {i: p.returncode for i, p in enumerate(self.procs) if p.poll() is not None}
            raise EngineError(f"update engines did not start: {len(accepted)} of {self.n} connected; exit codes {dead}")
        for conn in accepted:
            _, i = conn.recv()
            conn.send((self.paths[i], specs[i]))
            self.conns[i] = conn
        self._pump(lambda: all(s == "ready" for s in self._state), "starting", timeout=max(120.0, self.timeout))
        for shm in self.shms:  # every engine has mapped its slots
            shm.unlink()

    def _open(self, i: int, kind: str, mode: str, dtype: torch.dtype) -> FileHandle | None:
        """Engine ``i``'s file of ``kind`` (None when its slices are all empty: no file)."""
        st = self.storage
        if not TieredRegions.plan_file_bytes(self.views[i], dtype, 0, st.record_align):
            return None
        return FileHandle(os.path.join(self.paths[i], engine_file(i, kind)), mode, direct=st.direct,
                          checksum=st.checksum, checksum_block=st.checksum_block, workers=st.workers[self.path_of[i]])

    def _open_readers(self) -> None:
        self._readers = [self._open(i, "params", "r", self.pdtype) for i in range(self.n)]

    def _send(self, i: int, *msg) -> None:
        try:
            self.conns[i].send(msg)
        except (BrokenPipeError, OSError):
            self._check(i, "receiving a command")
            raise

    def _handle(self, i: int, msg: tuple) -> None:
        now = self._seen[i] = time.time()
        op = msg[0]
        if op != "alive" or msg[1] != self._progress[i]:
            self._moved = now
        if op == "alive":
            self._progress[i] = msg[1]
        elif op == "free":
            self._free[i].append(msg[1])
        elif op == "done":
            u, first, crcs, served = msg[1:]
            if crcs and self._readers and self._readers[i] is not None:
                self._readers[i].set_checksums(first, crcs)
            self._served[u][i] = served
            self._done[u].add(i)
        elif op == "stepped":
            self.stepped.append(dict(msg[1], engine=i))
            self.peak_host[i] = msg[1]["peak_host"]  # the engine's VmHWM: already its peak so far
        elif op == "error":
            log.debug("update engine %d failed:\n%s", i, msg[2] if len(msg) > 2 else "")
            raise EngineError(f"update engine {i} ({self.paths[i]}) failed: {msg[1]}; resume from the last checkpoint")
        elif op in ("ready", "released", "reopened", "attached"):
            self._state[i] = op

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
            raise EngineError(
                f"update engine {i} ({self.paths[i]}) died (exit code {p.returncode}) while {what}; "
                "resume from the last checkpoint"
            )
        if time.time() - self._seen[i] > self.timeout:
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

    # -- weights ---------------------------------------------------------------------------------------
    def init_unit(self, u: int, flat32: torch.Tensor) -> list[IOFuture]:
        """Give each engine its slice of unit ``u``'s initial fp32 weights."""
        self._done[u] = set()
        for i in range(self.n):
            s = self.slices[i][u]
            k = self._take(i, "initialising weights")
            self._slot(i, k, torch.float32, s.numel).copy_(flat32[s.start : s.end])
            self._send(i, "init", u, k)
        return []

    def wait_all(self, what: str = "updating") -> None:
        """Until every engine has finished every unit and reported its last step."""
        self._pump(lambda: all(len(d) == self.n for d in self._done.values())
                   and len(self.stepped) == self._steps_sent * self.n, what)

    # -- the parameter store's gate and backing ------------------------------------------------------------
    def ready(self, u: int) -> bool:
        self._drain()
        return len(self._done[u]) == self.n

    def wait_ready(self, u: int) -> None:
        self._pump(lambda: len(self._done[u]) == self.n, f"updating unit {u}")

    def slice_io(self, files: list, place: list[dict], esize: int, write: bool, u: int, buf: torch.Tensor,
                 start: int, end: int | None, engines: list[int] | None = None) -> IOFuture:
        """Elements ``[start, end)`` of unit ``u``, split by owner: each engine's part (of
        ``engines``, default all) read from (or written to) its file ``files[i]`` at the
        unit's place there."""
        end = self.layout.units[u].numel if end is None else end
        futs = []
        for i in range(self.n) if engines is None else engines:
            s = self.slices[i][u]
            a, b = max(start, s.start), min(end, s.end)
            if a < b:
                off = (place[i][u] + a - s.start) * esize
                op = files[i].pwrite if write else files[i].pread
                futs.append(op(buf[a - start : b - start], (b - a) * esize, off))
        return IOFuture.gather(futs)

    def read_params(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.slice_io(self._readers, self._place, self.pdtype.itemsize, False, u, out, start, end)

    # -- new parameters straight into the trainer's slots (CPU) ------------------------------------------
    def share_slots(self, count: int, numel: int) -> list[torch.Tensor]:
        """``count`` parameter slots of ``numel`` elements in shared memory, mapped by every
        engine too: a unit the trainer is waiting for gets its new parameters copied into
        its slot by the engines as they update it, instead of read back from their files.
        Same memory as private slots; the mapping is torch's own (no buffer exports)."""
        stride = round_up(numel * self.pdtype.itemsize, 4096)
        nu = len(self.layout.units)
        want_at = count * stride
        self._slot_shm = SharedSegment(want_at + round_up(4 * nu, 4096))
        name = self._slot_shm.name
        mem = self._slot_shm.tensor
        self._want = mem[want_at : want_at + 4 * nu].view(torch.int32)
        self._want.zero_()
        for i in range(self.n):
            self._send(i, "slots", name, stride, count, want_at)
        self._pump(lambda: all(s == "attached" for s in self._state), "mapping the parameter slots")
        self._slot_shm.unlink()
        return [mem[k * stride : k * stride + numel * self.pdtype.itemsize].view(self.pdtype) for k in range(count)]

    def handoff(self, u: int, slot: int, out: torch.Tensor) -> "_Handoff | None":
        """Ask the engines to write unit ``u``'s new parameters into shared slot ``slot``
        (``out``, its view) as they update it. None when ``u`` is already updated (read it
        from the files) or the slots are not shared."""
        if self._want is None or self.ready(u):
            return None
        self._want[u] = slot + 1  # seen by an engine when it starts the unit, or not at all
        return _Handoff(self, u, slot, out)

    # -- gradients -----------------------------------------------------------------------------------------
    def begin_step(self, step: int, lr: float) -> None:
        """Before the backward of optimizer step ``step``: engines that update as gradients
        arrive need the step and learning rate with the first gradient."""
        self._step, self._lr = step, lr

    def send_grads(self, u: int, g: torch.Tensor) -> IOFuture:
        """Hand unit ``u``'s complete gradient to the engines (copied into their slots)."""
        if self.eager:
            self._done[u] = set()  # updated as soon as it arrives: the next forward waits for it
        if self.topk:
            return self._send_topk(u, g)
        for i in range(self.n):
            s = self.slices[i][u]
            k = self._take(i, f"receiving gradients of unit {u}")
            self._slot(i, k, self.pdtype, s.numel).copy_(g[s.start : s.end])  # sync point on CUDA
            self.sent_bytes += s.numel * self.pdtype.itemsize
            self.dense_bytes += s.numel * self.pdtype.itemsize
            self._send(i, "grad", u, k, self._step, self._lr, None)
        return IOFuture.completed(g.numel() * g.element_size())

    def _send_topk(self, u: int, g: torch.Tensor) -> IOFuture:
        """Top-k per engine slice; with error feedback, the residual is added before and
        what was dropped is kept for the next step."""
        from ..compress.topk import pack, topk_encode

        n = g.numel()
        src = g
        if self.residual is not None:
            r = self._rbuf[:n]
            self.residual.read(u, r).get()
            src = g.float() + r.to(g.device)
        for i in range(self.n):
            s = self.slices[i][u]
            k = self._take(i, f"receiving gradients of unit {u}")
            idx, vals = topk_encode(src[s.start : s.end], self.topk)
            raw = self._slot(i, k, torch.uint8, self.slot_bytes)
            self.sent_bytes += pack(idx, vals.to(self.pdtype), raw)  # sync point on CUDA
            self.dense_bytes += s.numel * self.pdtype.itemsize
            self._send(i, "grad", u, k, self._step, self._lr, None, idx.numel())
            if self.residual is not None:
                src[s.start : s.end][idx.long()] = 0  # sent: what is left is the residual
        if self.residual is not None:
            self._rbuf[:n].copy_(src)
            self.residual.write(u, self._rbuf[:n]).get()
        return IOFuture.completed(n * g.element_size())

    def step(self, lr: float, coef: torch.Tensor | None) -> None:
        """Start optimizer step ``self._step`` on every engine; returns at once. The next
        forward waits per unit (``wait_ready``)."""
        if self.eager:
            self._steps_sent += 1  # already applied as gradients arrived; each engine reports the step
            return
        for u in self._done:
            self._done[u] = set()
        if self._want is not None:
            self._want.zero_()  # no engine reads it until it gets "step"
        c = None if coef is None else float(coef.to("cpu"))  # exact: a float32 widened to double
        for i in range(self.n):
            self._send(i, "step", self._step, lr, c)
        self._steps_sent += 1

    # -- checkpoints -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def handover(self) -> Iterator[dict[str, "_EngineRegion"]]:
        """Pause the engines and open their state files here (for saving or restoring)."""
        self.wait_all("finishing the update before a checkpoint")
        for i in range(self.n):
            self._send(i, "release")
        self._pump(lambda: all(s == "released" for s in self._state), "releasing files")
        for r in self._readers:
            if r is not None:
                r.close()
        from .streamed import StreamedOptimizer

        kinds = ["params"] + StreamedOptimizer.state_kinds(self.cfg.optim, self.pdtype != torch.float32)
        regions = {}
        try:
            for kind in kinds:
                dtype = self.pdtype if kind == "params" else torch.float32
                regions[kind] = _EngineRegion(self, kind, dtype)
            yield regions
        finally:
            for r in regions.values():
                r.close()
            for i in range(self.n):
                self._send(i, "reopen")
            self._pump(lambda: all(s == "reopened" for s in self._state), "reopening files")
            self._open_readers()

    @property
    def pool_bytes(self) -> int:
        extra = (self._rbuf.numel() * 4 + self.residual.host_bytes) if self.residual is not None else 0
        return sum(s.size for s in self.shms) + extra

    def close(self) -> None:
        """Stop the engines (killed after 10 s) and free everything, whatever state they are
        in: a dead or failed engine does not keep the others or the files from closing."""
        for i, p in enumerate(self.procs):
            if p.poll() is None and i < len(self.conns) and self.conns[i] is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.conns[i].send(("stop",))
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in self.conns:
            if c is not None:
                with contextlib.suppress(OSError):
                    c.close()
        if getattr(self, "_sockdir", None):
            import shutil

            shutil.rmtree(self._sockdir, ignore_errors=True)
        for r in self._readers:
            if r is not None:
                with contextlib.suppress(Exception):
                    r.close()
        if getattr(self, "residual", None) is not None:
            with contextlib.suppress(Exception):
                self.residual.close()
        for shm in self.shms + ([self._slot_shm] if getattr(self, "_slot_shm", None) else []):
            shm.unlink()
        self.procs, self.shms, self._readers, self.conns = [], [], [], []


class _Handoff:
    """A unit's load into a shared slot: ``get`` waits until every engine has updated it,
    then reads from the files the slices of the engines that did not write the slot (they
    had started the unit before the request). Used as the slot's read future."""

    def __init__(self, group: EngineGroup, u: int, slot: int, out: torch.Tensor) -> None:
        self.g, self.u, self.slot, self.out = group, u, slot, out
        self._result: int | None = None

    def done(self) -> bool:
        return self._result is not None or self.g.ready(self.u)

    def get(self) -> int:
        if self._result is not None:
            return self._result
        g, u = self.g, self.u
        g.wait_ready(u)  # sync point: every engine has finished unit u
        g._want[u] = 0
        late = [i for i in range(g.n) if g._served[u][i] != self.slot]
        served = sum(g.slices[i][u].numel for i in range(g.n) if i not in late) * g.pdtype.itemsize
        g.handoff_bytes += served
        read = g.slice_io(g._readers, g._place, g.pdtype.itemsize, False, u, self.out, 0, None, late) if late else None
        self._result = served + (read.get() if read is not None else 0)
        return self._result


class ParamBacking:
    """The engines' parameter files, as the parameter store's backing copy."""

    host_bytes = 0

    def __init__(self, group: EngineGroup) -> None:
        self.g = group
        self.file = True  # on the storage tier (for CUDA staging decisions)

    def on_host(self, u: int) -> bool:
        return False

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.g.read_params(u, out, start, end)

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        raise RuntimeError("with update engines, parameters are written by the engines (init_unit, step)")

    def close(self) -> None:
        pass


class GradHome:
    """The engines, as where gradients go after the backward."""

    host_bytes = 0
    file = None
    direct = True  # takes device tensors; copies into shared memory itself

    def __init__(self, group: EngineGroup) -> None:
        self.g = group

    def on_host(self, u: int) -> bool:
        return False

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.g.send_grads(u, src)

    def close(self) -> None:
        pass


class _EngineRegion:
    """One kind of state across all engines' files, read and written by the trainer while
    the engines are paused (checkpoints). Same calls as ``TieredRegions``."""

    def __init__(self, group: EngineGroup, kind: str, dtype: torch.dtype) -> None:
        self.g, self.dtype, self.esize = group, dtype, dtype.itemsize
        st = group.storage
        self.place = [TieredRegions.place(v, dtype, 0, st.record_align) for v in group.views]
        self.files = [group._open(i, kind, "r+", dtype) for i in range(group.n)]

    def read(self, u: int, out: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.g.slice_io(self.files, self.place, self.esize, False, u, out, start, end)

    def write(self, u: int, src: torch.Tensor, start: int = 0, end: int | None = None) -> IOFuture:
        return self.g.slice_io(self.files, self.place, self.esize, True, u, src, start, end)

    def close(self) -> None:
        for f in self.files:
            if f is not None:
                f.close()
