"""An update engine: a worker process next to one storage path (Smart-Infinity's idea).

It owns an equal slice of every unit: the fp32 master (when parameters are lower
precision), the moments and the parameters of that slice live in its files on its path,
as declared by the trainer's side (``client.py``) and sent here. Gradients arrive through
fixed shared-memory slots; the engine applies the optimizer with the same streamed, fused
code as the baseline path and writes the new parameters itself, so the trainer only sends
gradients and only reads parameters. Messages: ``protocol.py``.

Started as a fresh interpreter (``python -m tiertrain.update.engines.worker ADDRESS
INDEX``), in a session of its own: the trainer decides when it stops. If the trainer goes
away (killed), the engine exits quietly at its next message.
"""

from __future__ import annotations

import dataclasses
import gc
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch

from ...compress.topk import topk_decode, unpack
from ...config import IOConfig, OptimConfig
from ...device.host import host_peak_rss, host_rss, reset_peak_rss
from ...errors import one_line
from ...io import IOFuture, Storage
from ...state.double import build_region
from ...state.regions import TieredRegions
from ...state.slices import Slice, SliceLayout
from ..base import UpdateStats
from ..shm import attach
from ..streamed import StreamedOptimizer
from . import protocol as P

__all__ = ["Engine", "run_engine", "TrainerGone"]

HEARTBEAT_S = 0.5
GRAD_THREADS = 2  # I/O threads of the gradient queue (one slot's write at a time, and the update's read)


class TrainerGone(Exception):
    """The connection to the trainer is closed: it stopped or was killed."""


class _SlotGrads:
    """Gradients read straight from a shared-memory slot (updates as gradients arrive)."""

    def __init__(self) -> None:
        self.view: torch.Tensor | None = None

    def read(self, u, out, a, b) -> IOFuture:
        out[: b - a].copy_(self.view[a:b])
        return IOFuture.completed((b - a) * out.element_size())


class Engine:
    def __init__(self, index: int, path: str, conn: Connection, spec: dict) -> None:
        torch.set_num_threads(spec["threads"])
        # The engine's memory is reported as its peak RSS, and as growth over what the
        # interpreter and torch held before any pool was made (what the pools must explain).
        self.base_rss = host_rss()
        reset_peak_rss()
        self.index, self.conn = index, conn
        self._send_lock = threading.Lock()
        self.progress = 0
        self.layout = SliceLayout(spec["records"], [Slice(*s) for s in spec["slices"]], set(spec["frozen"]))
        self.pdtype = getattr(torch, spec["param_dtype"])
        io = IOConfig(**spec["io"])
        self.storage = Storage.from_config(io, paths=[path])
        # Gradients get their own I/O queue: a slot goes back to the trainer only once its
        # gradient is written, and queued behind the read-ahead that write held up the backward.
        self.grad_storage = Storage.from_config(dataclasses.replace(io, threads=GRAD_THREADS), paths=[path])
        self.shm = attach(spec["shm"], spec["shm_bytes"])
        self.slot_bytes = spec["slot_bytes"]
        self.eager = spec["eager"]
        states = {d.name: d for d in spec["states"]}  # declared by the trainer's side, built here
        self.params = build_region(self.layout, self.storage, states.pop("params"))  # twice: speculating
        self.grads = TieredRegions(self.layout, self.grad_storage, states.pop("grads"))
        self.slot_grads = _SlotGrads()
        n_dense = max(1, self.layout.max_unit_numel) if spec["topk"] else 0
        self.dense = torch.empty(n_dense, dtype=self.pdtype)  # decoded top-k gradients
        self.optim = StreamedOptimizer(
            self.layout,
            self.storage,
            self.params,
            self.grads,
            OptimConfig(**spec["optim"]),
            list(states.values()),
            buffer_bytes=spec["buffer_bytes"],
            ahead_bytes=0 if self.eager else spec["ahead_bytes"],
        )
        self._cpu_mark = time.process_time()  # CPU seconds of all the engine's threads, reported per step
        self._io_mark = self.io_total()  # storage bytes are reported from one step's end to the next
        self.files = [self.params, self.grads, *self.optim.state_files]
        self.slotmem: list[torch.Tensor] = []  # the trainer's parameter slots (CPU), once shared
        self.want: torch.Tensor | None = None  # per unit: 1 + the slot the trainer awaits it in, or 0
        self.serving: dict[int, int] = {}  # unit -> slot this engine writes its new parameters into
        self._eager: list[tuple[float, UpdateStats]] = []  # eager mode: the units of the step updated so far
        # speculating: the step whose units were updated into their other halves, which (in
        # order), and the time those updates took (reported with the step's judgement)
        self._spec_step, self._speculated, self._spec_stats = 0, [], UpdateStats()
        self._handlers = {
            P.Init: self.init,
            P.Grad: self.grad,
            P.Step: self.step,
            P.Slots: self.attach_slots,
            P.Release: self.release,
            P.Reopen: self.reopen,
        }

    @property
    def pool_bytes(self) -> int:
        """Memory the engine holds by design: the update's buffer sets and read-ahead, host-
        resident gradients, the top-k decode buffer and the I/O bounce buffers (made on first use)."""
        dense = self.dense.numel() * self.dense.element_size()
        return (
            self.optim.pool_bytes
            + self.grads.host_bytes
            + self.params.host_bytes
            + dense
            + self.storage.pool_bytes
            + self.grad_storage.pool_bytes
        )

    def io_total(self):
        """Bytes this engine has moved on its storage, both queues."""
        return self.storage.total() + self.grad_storage.total()

    # -- messaging ---------------------------------------------------------------------------------
    def send(self, msg) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError) as exc:  # the trainer is gone
                raise TrainerGone from exc

    def recv(self):
        try:
            return self.conn.recv()
        except (OSError, EOFError) as exc:
            raise TrainerGone from exc

    def heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                self.send(P.Alive(self.progress))
            except TrainerGone:
                return

    def slot(self, k: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.shm[k * self.slot_bytes : (k + 1) * self.slot_bytes].view(dtype)[:numel]

    def done(self, u: int) -> None:
        self.progress += 1
        served = self.serving.pop(u, -1)
        # states held twice (speculation): the half now current, whose file the trainer reads
        r, half = self.params.half(u), self.params.current_half(u)
        f = r.file
        if f is None or self.layout.units[u].numel == 0:
            self.send(P.Done(u, 0, (), served, half))
            return
        off, n = r.region(u)
        first, crcs = f.handles[0].checksums(off, n) if f.handles[0].checksummed else (0, [])
        self.send(P.Done(u, first, tuple(crcs), served, half))

    def updated(self, u: int) -> None:
        """Unit ``u``'s update is complete on storage: its new state becomes current (states
        held twice flip), then the trainer is told."""
        self.optim.flip(u)  # no-op unless held twice
        self.done(u)

    # -- handing new parameters straight to the trainer ------------------------------------------------
    def attach_slots(self, msg: P.Slots) -> None:
        """Map the trainer's parameter slots (``/dev/shm/name``): ``count`` slots of ``stride``
        bytes, then one int32 per unit at ``want_at``."""
        n = len(self.layout.units)
        mem = attach(msg.name, msg.want_at + 4 * n)
        self.slotmem = [mem[k * msg.stride : (k + 1) * msg.stride].view(self.pdtype) for k in range(msg.count)]
        self.want = mem[msg.want_at : msg.want_at + 4 * n].view(torch.int32)
        self.send(P.Attached())

    def serve(self, u: int, a: int, b: int, p: torch.Tensor) -> None:
        """New parameters ``[a, b)`` of this engine's slice of ``u``: also into the trainer's
        slot when the trainer asked for ``u`` before the unit's first chunk (decided once per
        unit; ``Done`` says whether it was, so the trainer reads the rest from the file)."""
        if a == 0:
            self.serving[u] = int(self.want[u]) - 1 if self.want is not None else -1
        k = self.serving.get(u, -1)
        if k >= 0:
            s = self.layout.slices[u]
            self.slotmem[k][s.start + a : s.start + b].copy_(p)

    # -- commands ------------------------------------------------------------------------------------
    def init(self, msg: P.Init) -> None:
        u, k = msg.unit, msg.slot
        self.optim.init_unit(u, self.slot(k, torch.float32, self.layout.units[u].numel))
        self.send(P.Free(k))
        self.done(u)

    def grad(self, msg: P.Grad) -> None:
        u, k = msg.unit, msg.slot
        n = self.layout.units[u].numel
        if msg.nnz >= 0:  # top-k: decode indices and values into a dense gradient
            idx, vals = unpack(self.slot(k, torch.uint8, self.slot_bytes), msg.nnz, self.pdtype)
            g = topk_decode(idx, vals, self.dense[:n])
        else:
            g = self.slot(k, self.pdtype, n)
        if self.eager:  # no clipping: update this unit now, from the slot
            t0 = time.perf_counter()
            st = self._from_slot(g, msg, on_unit_done=self.updated, on_chunk=self.serve)
            self._eager.append((time.perf_counter() - t0, st))
        elif msg.spec:  # kept for a redo, and updated now into the other halves (not current yet)
            kept = self.grads.write(u, g)  # under the update (both only read g); done before the slot is freed
            if msg.step != self._spec_step or u in self._speculated:  # a new step, or one abandoned and begun again
                self._spec_step, self._speculated, self._spec_stats = msg.step, [], UpdateStats()
            # new parameters are handed over only once the step is kept: no serving
            try:
                self._spec_stats.add(self._from_slot(g, msg, on_unit_done=self._speculated.append))
            finally:
                kept.get()
        else:
            self.optim.read_ahead()  # the backward has begun: read the update's first state while the disk is idle
            self.grads.write(u, g).get()
        self.progress += 1
        self.send(P.Free(k))
        if self.eager and len(self._eager) == len(self.optim.trainable):  # every trained unit of the step is updated
            parts, self._eager = self._eager, []
            self.report(
                sum(t for t, _ in parts),
                UpdateStats(
                    wait_s=sum(st.wait_s for _, st in parts),
                    compute_s=sum(st.compute_s for _, st in parts),
                    chunks=sum(st.chunks for _, st in parts),
                ),
            )

    def _from_slot(self, g: torch.Tensor, msg: P.Grad, **hooks) -> UpdateStats:
        """Unit ``msg.unit``'s update with coefficient 1, its gradient read from the slot ``g``."""
        self.slot_grads.view = g
        try:
            return self.optim.step(msg.lr, None, step=msg.step, units=[msg.unit], grads=self.slot_grads, **hooks)
        finally:
            self.slot_grads.view = None

    def step(self, msg: P.Step) -> None:
        t0 = time.perf_counter()
        c = torch.tensor(msg.coef, dtype=torch.float32) if msg.coef is not None else None
        if msg.keep is not None:  # a speculative step: the trainer's judgement
            t0 -= self._spec_stats.seconds  # the report's time includes the updates made under the backward
            st = self._judge(msg, c)
        else:
            st = self.optim.step(msg.lr, c, step=msg.step, on_unit_done=self.updated, on_chunk=self.serve)
        self.report(time.perf_counter() - t0, st)

    def _judge(self, msg: P.Step, c: torch.Tensor | None) -> UpdateStats:
        """A speculative step, judged by the trainer: kept, each unit's halves flip; else redone
        from the current halves with ``c`` over the speculative writes. Returns the speculative
        updates' stats and the judgement's together."""
        spec, self._speculated, st = self._speculated, [], self._spec_stats
        self._spec_step, self._spec_stats = 0, UpdateStats()
        if msg.keep:
            missing = sorted({x.index for x in self.optim.trainable} - set(spec))
            if missing:  # every trained unit's gradient comes before Step (unused vocabulary pieces' too)
                raise RuntimeError(f"step {msg.step} kept with units {missing} not speculated: no gradient came")
            for u in spec:
                self.updated(u)
        else:
            st.add(self.optim.step(msg.lr, c, step=msg.step, on_unit_done=self.updated, on_chunk=self.serve))
        return st

    def report(self, seconds: float, st: UpdateStats) -> None:
        """The step's report: time, bytes moved on storage since the last one, CPU, memory."""
        now = self.io_total()
        io, self._io_mark = now - self._io_mark, now  # with this step's gradients and read-ahead
        cpu_now = time.process_time()
        cpu, self._cpu_mark = cpu_now - self._cpu_mark, cpu_now
        self.send(
            P.Stepped(
                P.StepReport(
                    seconds=seconds,
                    read=io.read_bytes,
                    written=io.write_bytes,
                    wait_s=st.wait_s,
                    compute_s=st.compute_s,
                    ahead=st.ahead,
                    chunks=st.chunks,
                    cpu_s=cpu,
                    peak_host=host_peak_rss(),
                    base_host=self.base_rss,
                    pool=self.pool_bytes,
                )
            )
        )

    def release(self, msg: P.Release) -> None:
        self.optim.drop_ahead()
        for f in self.files:
            f.release()
        self.send(P.Released())

    def reopen(self, msg: P.Reopen) -> None:
        for f in self.files:
            f.reopen()
        self.send(P.Reopened())

    def run(self) -> None:
        stop = threading.Event()
        threading.Thread(target=self.heartbeat, args=(stop,), daemon=True).start()
        for f in self.files:  # checksums on disk, so the trainer's readers can open them
            f.flush()
        self.send(P.Ready())
        try:
            while True:
                msg = self.recv()
                if isinstance(msg, P.Stop):
                    break
                self._handlers[type(msg)](msg)
        finally:
            stop.set()
            for f in self.files:
                f.close()
            self.storage.close()
            self.grad_storage.close()


def run_engine(index: int, path: str, conn: Connection, spec: dict) -> int:
    """Run engine ``index`` on ``conn`` until told to stop; the process's exit code."""
    try:
        Engine(index, path, conn, spec).run()
    except TrainerGone:
        return 3  # orphaned: exit quietly, the trainer (if alive) names what happened
    except BaseException as exc:  # report, then exit: the trainer names this engine and its path
        try:
            conn.send(P.Failed(f"{type(exc).__name__}: {one_line(exc)}", traceback.format_exc()))
        except Exception:
            pass
        return 1
    return 0


def main() -> None:
    """``python -m tiertrain.update.engines.worker ADDRESS INDEX``: connect to the trainer, get
    the spec, run. A fresh interpreter, so nothing of the trainer's script runs here."""
    import os
    import sys
    from multiprocessing.connection import Client

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when its engines stop
    address, index = sys.argv[1], int(sys.argv[2])
    try:
        conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ["TIERTRAIN_ENGINE_KEY"]))
        conn.send(("hello", index))
        path, spec = conn.recv()
    except (OSError, EOFError):
        sys.exit(3)  # the trainer went away during start-up
    code = run_engine(index, path, conn, spec)
    gc.freeze()  # exit without the interpreter's final collections (about 1 s here; see cli.console)
    sys.exit(code)


if __name__ == "__main__":
    main()
