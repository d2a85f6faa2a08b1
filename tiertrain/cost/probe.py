"""Quick measurements the cost model starts from: the storage tier's sequential read and
write bandwidth, CRC32C speed, and the compute time of one unit of each kind.

The disk probe writes and reads one file of ``probe_mib`` through the run's own storage
settings (paths, threads, chunks, O_DIRECT), checksums off (their CPU cost is measured on
its own). The compute probe times the executor's own unit steps on a micro-batch of the run's
shape (``unit_timing.py``), and measures one pair's activation bytes, kept and offloaded, by
one forward of the first block through the kept-graph and record paths.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..activations.keep import KeptGraphs
from ..activations.offload import PACK_ALIGN, measure_record
from ..config import Config, IOConfig
from ..io import Storage, aligned_empty
from ..io.checksum import crc32c
from ..update.kernels import adamw_segments
from .unit_timing import time_unit_steps

__all__ = [
    "probe_link",
    "Rates",
    "DiskProbe",
    "probe_compute",
    "probe_act_bytes",
    "probe_fits",
    "probe_acts",
    "probe_crc",
    "probe_widen",
    "probe_base",
]


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
    widen_gbps: float = 0.0  # GB/s of the compute dtype made from a narrower or 4-bit base (0: none to make)
    # host <-> device copies where device memory is separate (pinned host memory, one copy in
    # flight, each direction alone), GB/s; 0: the device computes in host memory (no link)
    up_gbps: float = 0.0
    down_gbps: float = 0.0

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
    and read through a 16 MiB buffer, as many pieces in flight as keep the I/O threads busy;
    ``reading()`` keeps the disk reading in the background (to measure compute while the
    storage tier works). A context manager; the file goes at exit."""

    def __init__(self, io: IOConfig, probe_mib: int = 256) -> None:
        if probe_mib < 1:
            raise ValueError(f"probe_mib must be >= 1, got {probe_mib}")
        self.piece = min(probe_mib << 20, 16 << 20)  # the buffer: the probe's own memory stays small
        self.size = (probe_mib << 20) // self.piece * self.piece
        # pieces in flight at once (through the one buffer: a probe's bytes do not matter): as many
        # as keep every I/O thread busy, as a unit's read does (one piece at a time read at
        # 0.85 GB/s where the steps that followed read at 1.50 GB/s)
        self.depth = max(1, min(io.threads * (io.chunk_kib << 10) // self.piece, self.size // self.piece))
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
        self._laid_out = False

    def write(self) -> float:
        """GB/s of overwriting the file (until it is on the device). The file's first write,
        into newly allocated space, is not timed: training overwrites its state files, and a
        first write ran 1.2-1.5x slower than an overwrite on this project's development disk."""
        if not self._laid_out:
            self._write_once()  # untimed, its CPU not counted
            self._laid_out = True
        c0, t0 = time.process_time(), time.perf_counter()
        self._write_once()
        self.cpu_s += time.process_time() - c0
        return self.size / (time.perf_counter() - t0) / 1e9

    def _write_once(self) -> None:
        for fut in [self.f.pwrite(self.buf, file_offset=off) for off in range(0, self.size, self.piece)]:
            fut.get()
        self.f.flush()  # sync point: the bytes are on the device

    def read(self) -> float:
        """GB/s of reading it: ``depth`` pieces in flight, each spread over the threads."""
        c0, t0 = time.process_time(), time.perf_counter()
        inflight: collections.deque = collections.deque()
        for off in range(0, self.size, self.piece):
            if len(inflight) == self.depth:
                inflight.popleft().get()
            inflight.append(self.f.pread(self.buf, file_offset=off))
        for fut in inflight:
            fut.get()
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


def probe_link(dev, mib: int = 64) -> tuple[float, float]:
    """GB/s of host -> device and device -> host copies of ``mib`` MiB, as the stores copy
    (page-locked host memory where the device pins, its upload and download streams), each
    direction timed alone; (0, 0) where the device computes in host memory."""
    if not dev.separate:
        return 0.0, 0.0
    n = mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=dev.pin)
    d = dev.empty(n, torch.uint8)

    def copy(fn) -> float:
        def once() -> None:
            fn()
            dev.synchronize()  # sync point: the copy has run

        return n / _timed(once, repeats=2) / 1e9

    try:
        return copy(lambda: dev.upload(d, host, after=dev.event())), copy(lambda: dev.download(host, d))
    finally:
        dev.release(d)


def probe_crc(mib: int = 64) -> float:
    """CRC32C GB/s on one thread."""
    data = np.random.default_rng(1).integers(0, 255, mib << 20, dtype=np.uint8)
    return (mib << 20) / _timed(lambda: crc32c(data), repeats=2) / 1e9


def probe_base(cfg, rt) -> float:
    """GB/s of the compute dtype that making a frozen base's fetched unit takes: widening a
    narrower dtype (``probe_widen``) or dequantizing a 4-bit base (the largest quantized unit,
    its weights random); 0 with nothing to convert."""
    from ..state.quant import base_storage

    if not cfg.adapter.on:
        return 0.0
    stored, dtype = base_storage(cfg, rt.layout, rt.dtype, rt.align)
    if dtype != torch.uint8:
        return probe_widen(dtype, rt.dtype, rt.layout.max_unit_numel)
    u = max((x for x in stored.units if not x.plain), key=lambda x: x.numel, default=None)
    if u is None:
        return 0.0
    n = rt.layout.units[u.index].numel
    out = torch.randn(n, dtype=torch.float32).to(rt.dtype)
    q = stored.quantize(u.index, out)
    return n * rt.dtype.itemsize / _timed(lambda: stored.dequantize_into(u.index, q, out), repeats=2) / 1e9


def probe_widen(src: torch.dtype, dst: torch.dtype, numel: int) -> float:
    """GB/s of ``dst`` that widening a narrower base of ``src`` makes, as a fetched unit is
    widened inside its slot (``widen_in_place``, on the thread that waits for the unit); 0 when
    the two are the same (nothing to widen)."""
    if src == dst:
        return 0.0
    from ..io.align import round_down
    from ..update.frozen import widen_in_place

    n = max(1 << 16, min(numel, 1 << 24))
    out = torch.zeros(n, dtype=dst)  # written first: the slots' pages are resident
    offset = round_down(n * (dst.itemsize - src.itemsize))
    return n * dst.itemsize / _timed(lambda: widen_in_place(out, offset, src), repeats=2) / 1e9


def probe_update(dtype: torch.dtype, numel: int, cfg: Config) -> float:
    """Seconds per element of one optimizer step on the host: fused AdamW on fp32 states, or
    bitsandbytes' AdamW8bit kernel on 8-bit ones (``optim.name``); with parameters of a lower
    precision than the fp32 master (``dtype``), the gradient's upcast and the parameters' copy
    from the master too, as the update does them (``StreamedOptimizer._compute_resident``).

    Over as many elements as the update's three buffer sets hold (``memory.update_buffer_kib``:
    6 Mi by default, 96 MiB of fp32 states, memory the steps hold too): an update streams its
    states at the memory's rate, not the caches' (1 Mi elements, 16 MiB, fit a server's cache:
    that probe said 1.00 s for an update of a 3 B model that took 4.5 s on an H200 machine's 16
    cores). Adapters on a frozen model step a few small tensors: 1 Mi at most."""
    cap = 1 << 20 if cfg.adapter.on else max(1 << 20, 3 * (cfg.memory.update_buffer_kib << 10) // 16)
    n = max(1 << 16, min(numel, cap))
    gen = torch.Generator().manual_seed(0)  # not the global one: the run's draws stay its own
    p, g, m, v = (torch.randn(n, generator=gen) * 0.02 for _ in range(4))
    v.abs_()
    if cfg.optim.name == "adamw8bit":
        return _timed(_adamw8bit_step(p, g, cfg), repeats=2) / n
    if dtype == torch.float32:
        return _timed(lambda: adamw_segments([p], [g], [m], [v], step=2, lr=1e-4, cfg=cfg.optim), repeats=2) / n
    low, g_low = p.to(dtype), g.to(dtype)

    def step() -> None:
        g.copy_(g_low)
        adamw_segments([p], [g], [m], [v], step=2, lr=1e-4, cfg=cfg.optim)
        low.copy_(p)

    return _timed(step, repeats=2) / n


def _adamw8bit_step(p: torch.Tensor, g: torch.Tensor, cfg: Config):
    """One AdamW8bit step of ``p`` as one 8-bit parameter, its codes and scales made here, once:
    the step alone is timed."""
    from ..state.scales import UnitScales
    from ..state.slices import Piece
    from ..update.adamw8bit import adamw8bit_segments

    n = p.numel()
    unit = UnitScales(0, [(0, n, n, n)], 1)
    record, c1, c2 = torch.zeros(unit.numel), torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    segs = [(Piece(0, n), 0, n)]
    return lambda: adamw8bit_segments(segs, [p], [g], [c1], [c2], unit, record, step=2, lr=1e-4, cfg=cfg.optim)


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
    acts: tuple[int, int] | None = None,
) -> dict:
    """Run in a forked RNG: a probe never changes what the run draws (dropout, resume).

    Per micro-batch: seconds of the embedding's forward and backward, one block's forward
    and backward, the head's forward + backward; and one block's activation bytes and record
    (``acts``: those already measured, not again)."""
    with torch.random.fork_rng(devices=[dev.device] if dev.cuda else []):
        return _probe_compute(cfg, model, layout, dev, dtype, hidden, act_only, blocks_only, acts)


def _positions(cfg: Config, device) -> torch.Tensor:
    """The positions a step's block gets: ``[T]``, or for examples with attention within each
    document ``[B, T]`` restarting at each document (here two a row, so that transformers sees
    documents and builds the block-diagonal mask the steps build and save)."""
    from ..data.loader import by_document

    d = cfg.data
    pos = torch.arange(d.seq_len, device=device)
    if not by_document(d):
        return pos
    half = d.seq_len // 2
    return torch.cat([pos[:half], pos[: d.seq_len - half]]).expand(d.micro_batch_size, -1).contiguous()


def _measure_acts(cfg: Config, model, layout, dev, dtype: torch.dtype, hidden: int) -> tuple[int, int]:
    """(kept graph bytes, offload record bytes) of one pair, the most of any kind of block."""
    d = cfg.data
    x = torch.randn(d.micro_batch_size, d.seq_len, hidden, device=dev.device).to(dtype)
    pos = _positions(cfg, dev.device)
    act = record = 0
    was = model.training
    model.train()  # dropout as in training
    try:
        for block in distinct_blocks(model):
            width = getattr(block.module, "in_width", hidden)  # a sub-layer unit's input: maybe wider
            xb = x if width == hidden else torch.randn(*x.shape[:-1], width, device=dev.device).to(dtype)
            if hasattr(block.module, "example_input"):  # a range of experts: ids of experts, evenly spread
                xb = block.module.example_input(x)
            a, r = _saved_bytes(cfg, block, layout, dev, dtype, xb, pos)
            act, record = max(act, a), max(record, r)
    finally:
        model.train(was)
    return act, record


def distinct_blocks(model) -> list:
    """One block of each structure (its parameters' names, shapes and whether they are trained,
    and its attention type): a model's blocks may differ (DeepSeek-V3's dense first layers before
    its experts'; a frozen block, ``train.freeze``, saves less for the backward than a trained one;
    a sliding layer other tensors than a full one); what one saves for the backward is measured
    on each kind, the most planned for."""
    kinds: dict = {}
    for ref in (r for r in model.plan if r.role == "block"):
        # ranges of experts alike but for their number (``range3.gate_up_proj``) are one kind
        sig = tuple(
            (re.sub(r"\.range\d+\.", ".range.", n), tuple(p.shape), p.requires_grad)
            for n, p in ref.module.named_parameters()
        )
        m = ref.module
        kind = getattr(m, "kind", None)
        if hasattr(m, "lo") and hasattr(m, "k"):  # a range of experts: the first, a middle or the last
            kind = ("experts", m.k == 0, m.k == m.n - 1)  # (its kind names its experts: one per range)
        kinds.setdefault((sig, kind, getattr(m, "attn_kind", None)), ref)
    return list(kinds.values())


def _saved_bytes(cfg: Config, block, layout, dev, dtype: torch.dtype, x: torch.Tensor, pos) -> tuple[int, int]:
    """(kept graph bytes, offload record bytes) of ``block``'s forward on ``x``, its units bound
    to random values; a mixture of experts' record with room for any routing (``routed_slack``)."""
    units = (*layout.units[block.index].borrows, block.index)
    saved = {u: [rec.param.data for rec in layout.units[u].params] for u in units}
    # drawn in place in the compute dtype: no unit-sized temporaries (this runs before the pools exist)
    flats = {u: torch.randn(layout.units[u].numel, device=dev.device, dtype=dtype).mul_(0.02) for u in units}
    fwd = lambda t: block.module(t, pos)  # noqa: E731
    kept = KeptGraphs(1 << 62, flats.__getitem__)
    try:
        for u in units:
            layout.bind(u, flats[u])
        slack = routed_slack(block.module, x)
        record = measure_record(units, flats.__getitem__, fwd, x, cfg.io.checksum_block_kib << 10, slack=slack)
        kept.forward((0, 0), units, fwd, x, lambda n, k: True)
        return kept.kept_bytes, record
    finally:
        kept.clear()
        for u in units:
            layout.bind_grads(u, None)
            for rec, data in zip(layout.units[u].params, saved[u]):
                rec.param.data = data


def routed_slack(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes a block with experts may save beyond what one forward on ``x`` measured: the tokens
    each expert gets change with the routing (their sum does not), and each expert reached saves
    a few storages of its own, each padded within the record (``PACK_ALIGN``): room for every
    expert's, generously 16 storages each. A range of experts (``models/experts_cut.py``) gets
    from none to every (token, expert) pair: room for them all (``record_slack``)."""
    experts = max((p.shape[0] for p in block.parameters() if p.dim() == 3), default=0)
    extra = block.record_slack(x.shape[0] * x.shape[1], x.dtype.itemsize) if hasattr(block, "record_slack") else 0
    return experts * 16 * PACK_ALIGN + extra


def _probe_compute(
    cfg: Config,
    model,
    layout,
    dev,
    dtype: torch.dtype,
    hidden: int,
    act_only: bool,
    blocks_only: bool,
    acts: tuple[int, int] | None,
) -> dict:
    act, record = acts if acts is not None else _measure_acts(cfg, model, layout, dev, dtype, hidden)
    if act_only:
        return {"act_bytes": act, "record_bytes": record}
    # a few blocks time one as well as all do, at a fraction of the cost; whole layers where cut
    # (the head takes hidden states: a mixture of experts' dense layers cut into fewer units than
    # its MoE layers, the prefix is extended to a layer's end)
    parts = model.layer_parts
    L = min(len(model.blocks), parts * max(1, 4 // parts))
    layers = model.block_layers
    while layers is not None and L < len(layers) and layers[L] == layers[L - 1]:
        L += 1
    budget = cfg.memory.keep_act_mib
    keep = L if budget is None else min(L, (budget << 20) // max(act, 1))  # None: still being planned
    out = time_unit_steps(cfg, model, layout, dev, dtype, hidden, blocks=L, keep=keep, blocks_only=blocks_only)
    return {**out, "act_bytes": act, "record_bytes": record}


def probe_fits(mib: int, paths, stripe_kib: int = 1024) -> None:
    """The disk probe's file fits the filesystems of ``paths`` (else its size, this command's own
    option, is named; the storage tier's out-of-space error names only the path). The file is
    striped over the paths (``stripe_kib``): each holds its share, added up per filesystem."""
    from collections import defaultdict

    from ..errors import UsageError
    from ..io.space import device_of, free_bytes

    stripe, n = stripe_kib << 10, max(1, len(paths))
    share = -(-(mib << 20) // n // stripe) * stripe + stripe  # at most: a share in whole stripes, and one more
    need: dict[int, list] = defaultdict(lambda: [None, 0])
    for p in paths:
        entry = need[device_of(p)]  # (of the filesystem that would hold it, where it is not made yet)
        entry[0], entry[1] = entry[0] or p, entry[1] + min(share, mib << 20)
    for p, nbytes in need.values():
        free = free_bytes(p)
        if nbytes > free:
            where = p if n == 1 else f"{p} (striped over the {n} io.paths: {nbytes >> 20:,} MiB on this filesystem)"
            raise UsageError(
                f"--probe-mib = {mib}: the disk probe writes {mib:,} MiB into {where}, whose filesystem has "
                f"{free >> 20:,} MiB free; give a smaller --probe-mib (default 256)"
            )
