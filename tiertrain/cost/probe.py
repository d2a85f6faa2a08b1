"""Quick measurements the cost model starts from: the storage tier's sequential read and
write bandwidth, CRC32C speed, and the compute time of one unit of each kind.

The disk probe writes and reads one file of ``probe_mib`` through the run's own storage
settings (paths, threads, chunks, O_DIRECT), checksums off (their CPU cost is measured on
its own). The compute probe runs the model's embedding, first block and head on a
micro-batch of the run's shape, with parameters and gradients in temporary buffers, through
the same kept-graph path the executor uses (which also gives one pair's activation bytes).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..activations.keep import KeptGraphs
from ..activations.offload import measure_record
from ..config import Config, IOConfig
from ..execute.vocab import piece_backward, piece_logsumexp
from ..io import Storage, aligned_empty
from ..io.checksum import crc32c
from ..update.kernels import adamw_segments

__all__ = ["Rates", "DiskProbe", "probe_compute", "probe_act_bytes", "probe_acts", "probe_crc"]


@dataclass
class Rates:
    """What one step's time is predicted from (seconds are per micro-batch per unit)."""

    read_gbps: float
    write_gbps: float
    crc_gbps: float  # one thread
    io_cpu_s_per_gb: float  # CPU the storage tier's threads take per GB moved (system calls, copies)
    io_slowdown: float  # compute time while the storage tier reads flat out / compute time alone
    embed_fwd_s: float
    embed_bwd_s: float
    block_fwd_s: float
    block_bwd_s: float
    head_s: float  # forward and backward
    act_bytes: int  # one (block, micro-batch) pair's saved activations
    update_elem_s: float  # the AdamW kernel, per element
    cores: int
    record_bytes: int = 0  # one pair's record of offloaded activations (its input, in the stash, not counted)

    def to_dict(self) -> dict:
        return asdict(self)


def _timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class DiskProbe:
    """One file of ``probe_mib`` over every path of the storage tier (no checksums), written
    and read through a 16 MiB buffer; ``reading()`` keeps the disk reading in the background
    (to measure compute while the storage tier works). A context manager; the file goes at
    exit."""

    def __init__(self, io: IOConfig, probe_mib: int = 256) -> None:
        if probe_mib < 1:
            raise ValueError(f"probe_mib must be >= 1, got {probe_mib}")
        self.piece = min(probe_mib << 20, 16 << 20)  # the buffer: the probe's own memory stays small
        self.size = (probe_mib << 20) // self.piece * self.piece
        self.io = io
        self.st = Storage(
            io.paths,
            threads=io.threads,
            chunk_bytes=io.chunk_kib << 10,
            stripe_bytes=io.stripe_kib << 10,
            direct=io.direct,
            checksum=False,
        )
        self.buf = aligned_empty(self.piece)
        self.buf.numpy()[:] = np.random.default_rng(0).integers(0, 255, self.piece, dtype=np.uint8)
        self.name = f".tiertrain-probe-{os.getpid()}"
        self.f = self.st.create(self.name, self.size)
        self.cpu_s = 0.0

    def write(self) -> float:
        """GB/s of writing the file (until it is on the device)."""
        c0, t0 = time.process_time(), time.perf_counter()
        for fut in [self.f.pwrite(self.buf, file_offset=off) for off in range(0, self.size, self.piece)]:
            fut.get()
        self.f.flush()  # sync point: the bytes are on the device
        self.cpu_s += time.process_time() - c0
        return self.size / (time.perf_counter() - t0) / 1e9

    def read(self) -> float:
        """GB/s of reading it (one buffer: pieces in turn, each spread over the threads)."""
        c0, t0 = time.process_time(), time.perf_counter()
        for off in range(0, self.size, self.piece):
            self.f.read(self.buf, file_offset=off)
        self.cpu_s += time.process_time() - c0
        return self.size / (time.perf_counter() - t0) / 1e9

    @contextlib.contextmanager
    def reading(self):
        stop = threading.Event()

        def loop() -> None:
            buf = aligned_empty(self.piece)
            while not stop.is_set():
                for off in range(0, self.size, self.piece):
                    if stop.is_set():
                        break
                    self.f.read(buf, file_offset=off)

        t = threading.Thread(target=loop, daemon=True, name="tiertrain-probe-reader")
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    def __enter__(self) -> "DiskProbe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()
        for p in self.io.paths:
            try:
                os.remove(os.path.join(p, self.name))
            except FileNotFoundError:
                pass
        self.st.close()


def probe_crc(mib: int = 64) -> float:
    """CRC32C GB/s on one thread."""
    data = np.random.default_rng(1).integers(0, 255, mib << 20, dtype=np.uint8)
    return (mib << 20) / _timed(lambda: crc32c(data), repeats=2) / 1e9


def probe_update(dtype: torch.dtype, numel: int, cfg: Config) -> float:
    """Seconds per element of one AdamW step on the host (fp32 states)."""
    n = max(1 << 16, min(numel, 1 << 20))
    gen = torch.Generator().manual_seed(0)  # not the global one: the run's draws stay its own
    p, g, m, v = (torch.randn(n, generator=gen) * 0.02 for _ in range(4))
    v.abs_()
    return _timed(lambda: adamw_segments([p], [g], [m], [v], step=2, lr=1e-4, cfg=cfg.optim), repeats=2) / n


def probe_act_bytes(cfg: Config, model, layout, dev, dtype: torch.dtype, hidden: int) -> int:
    """One (block, micro-batch) pair's saved activations: one forward of the first block
    through the kept-graph path (parameter views not counted, as the executor counts)."""
    return probe_acts(cfg, model, layout, dev, dtype, hidden)[0]


def probe_acts(cfg: Config, model, layout, dev, dtype: torch.dtype, hidden: int) -> tuple[int, int]:
    """(one pair's saved activation bytes as kept, its record's bytes when offloaded): one
    forward of the first block through each path (a dry run before the first step)."""
    out = probe_compute(cfg, model, layout, dev, dtype, hidden, act_only=True)
    return out["act_bytes"], out["record_bytes"]


def probe_compute(
    cfg: Config,
    model,
    layout,
    dev,
    dtype: torch.dtype,
    hidden: int,
    *,
    act_only: bool = False,
    blocks_only: bool = False,
) -> dict:
    """Run in a forked RNG: a probe never changes what the run draws (dropout, resume).

    Per micro-batch: seconds of the embedding's forward and backward, one block's forward
    and backward, the head's forward + backward; and one block's activation bytes."""
    with torch.random.fork_rng(devices=[dev.device] if dev.cuda else []):
        return _probe_compute(cfg, model, layout, dev, dtype, hidden, act_only, blocks_only)


def _probe_compute(
    cfg: Config, model, layout, dev, dtype: torch.dtype, hidden: int, act_only: bool, blocks_only: bool
) -> dict:
    d = cfg.data
    plan = model.plan
    embed = next(r for r in plan if r.role == "embed")
    block = next(r for r in plan if r.role == "block")
    head = next(r for r in plan if r.role == "head")
    pieces = {r.role: r.index for r in plan if r.role in ("embed_piece", "head_piece") and r.piece == 0}  # K alike

    def with_borrows(*us: int) -> list[int]:
        return sorted({x for u in us for x in (*layout.units[u].borrows, u)})

    # one group of units in memory at a time: the probe's peak is one kind's, not the model's few largest
    groups = {
        "embed": with_borrows(embed.index, *[pieces[k] for k in ("embed_piece",) if k in pieces]),
        "head": with_borrows(head.index, *[pieces[k] for k in ("head_piece",) if k in pieces]),
        "block": with_borrows(block.index),
    }
    flats, grads = {}, {}
    saved = {u: [rec.param.data for rec in layout.units[u].params] for g in groups.values() for u in g}

    def bind(group: str) -> None:
        for u in groups[group]:
            n = layout.units[u].numel
            flats[u] = (torch.randn(n, device=dev.device) * 0.02).to(dtype)
            grads[u] = torch.zeros(n, device=dev.device, dtype=dtype)
            layout.bind(u, flats[u])
            layout.bind_grads(u, grads[u])

    def unbind() -> None:  # put the placeholders back, free the group's memory
        for u in list(flats):
            layout.bind_grads(u, None)
            for rec, data in zip(layout.units[u].params, saved[u]):
                rec.param.data = data
            del flats[u], grads[u]

    cut = len(model.head_pieces)
    vocab = model.embed_pieces[0].num_embeddings if cut else getattr(model.embed, model.embed.TOKENS).num_embeddings
    ids = torch.randint(0, vocab, (d.micro_batch_size, d.seq_len), device=dev.device)  # in piece 0 if cut

    def embed_call():
        if not cut:
            return model.embed(ids, pos)
        tok = torch.empty(*ids.shape, hidden, dtype=dtype, device=dev.device)
        model.embed_pieces[0].gather_into(tok, ids)
        return model.embed.finish(tok.requires_grad_(), pos)

    pos = torch.arange(d.seq_len, device=dev.device)
    sync = dev.synchronize
    kept = KeptGraphs(1 << 62, lambda u: flats[u])
    block_units = (*layout.units[block.index].borrows, block.index)
    bind("embed")
    x = embed_call().detach()
    dh = torch.randn_like(x) * 1e-3
    out: dict = {}

    def embed_fwd():
        with torch.enable_grad():
            out["e"] = embed_call()
        sync()

    def embed_bwd():
        with torch.enable_grad():
            e = embed_call()
        torch.autograd.backward(e, dh)
        if cut:
            p0 = model.embed_pieces[0]
            p0.add_grad(p0.weight.grad, ids, dh)
        sync()

    L = min(len(model.blocks), 4)  # a few blocks time one as well as all do, at a fraction of the cost
    fwd = lambda t: block.module(t, pos)  # noqa: E731

    def blocks_pass(keep_n: int) -> tuple[float, float]:
        """The forward of ``L`` (at most 4) blocks (block 0's parameters each time), the first
        ``keep_n`` graphs kept as the executor keeps them (memory allocated and freed as in a
        step), then the backward of the kept ones in reverse: (forward s, backward s) per block."""
        kept.clear()
        h = x
        t0 = time.perf_counter()
        for i in range(L):
            h, _ = kept.forward((i, 0), block_units, fwd, h, lambda n, k, i=i: i < keep_n)
        sync()
        t1 = time.perf_counter()
        g = dh
        for i in reversed(range(keep_n)):
            g = kept.backward((i, 0), g)
        sync()
        t2 = time.perf_counter()
        return (t1 - t0) / L, (t2 - t1) / max(keep_n, 1)

    def head_fb():
        h = x.detach().requires_grad_()
        if cut:  # the norm, then pass 1 and pass 2 of piece 0 for each of the K pieces, the norm's backward
            with torch.enable_grad():
                y = head.module.hidden(h)
            hn, t = y.detach().reshape(-1, hidden), ids.reshape(-1)
            lse = torch.full((t.numel(),), float("-inf"), device=dev.device)
            picked = torch.zeros(t.numel(), device=dev.device)
            dhn = torch.zeros(hn.shape, device=dev.device)
            for _ in range(cut):
                lse, picked = piece_logsumexp(model.head_pieces[0], hn, t, lse, picked)
            for _ in range(cut):
                dhn += piece_backward(model.head_pieces[0], hn, t, lse, t.numel())
            torch.autograd.backward(y, dhn.view(y.shape).to(y.dtype))
            sync()
            return
        with torch.enable_grad():
            loss = head.module.loss(head.module.logits(h), ids)
        loss.backward()
        sync()

    was = model.training
    model.train()  # dropout as in training
    try:
        out_s = {}
        if not (act_only or blocks_only):
            out_s.update(embed_fwd_s=_timed(embed_fwd), embed_bwd_s=max(0.0, _timed(embed_bwd) - _timed(embed_fwd)))
            unbind()
            bind("head")
            out_s["head_s"] = _timed(head_fb)
        unbind()
        bind("block")
        record = measure_record(block_units, flats.__getitem__, fwd, x, cfg.io.checksum_block_kib << 10)
        if act_only:
            kept.forward((0, 0), block_units, fwd, x, lambda n, k: True)
            return {"act_bytes": kept.kept_bytes, "record_bytes": record}
        kept.clear()
        kept.forward((0, 0), block_units, fwd, x, lambda n, k: True)
        out_s["act_bytes"] = act = kept.kept_bytes
        out_s["record_bytes"] = record
        budget = cfg.memory.keep_act_mib
        keep_n = (
            0
            if cfg.memory.activations == "recompute"
            # None: still being planned: a few
            else min(L, 4)
            if budget is None
            else min(L, (budget << 20) // max(act, 1))
        )
        blocks_pass(max(keep_n, 1))  # warm-up
        runs = [blocks_pass(max(keep_n, 1)) for _ in range(2)]
        out_s["block_fwd_s"] = statistics.median(r[0] for r in runs)
        out_s["block_bwd_s"] = statistics.median(r[1] for r in runs)
        return out_s
    finally:
        model.train(was)
        kept.clear()
        unbind()
