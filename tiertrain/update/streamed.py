"""The streamed optimizer: AdamW (or SGD) over per-unit state, through fixed buffers. The
baseline update path runs it in the trainer; each update engine runs it on its slices.

Optimizer state (first and second moments, and fp32 master weights when parameters are
kept in a lower precision) lives on the storage tier, laid out like the parameters.
``step`` walks every chunk of every unit, layer 0 first, with three buffer sets in
flight: chunk i+1 is being read while chunk i is updated (torch's fused AdamW on its
per-parameter segments) and chunk i-1 is being written. Optionally (update engines) the
state of the first chunks is read ahead into extra sets while the trainer is still in its
backward (``read_ahead``), so the step starts with those reads done. Memory: 3 (+ read-
ahead) sets of ``chunk`` elements, fixed at start.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .. import faults
from ..config import OptimConfig
from ..io import IOFuture, Storage, aligned_empty
from ..state.decl import StateDecl
from ..state.double import DoubleRegions, build_region, declare_state
from ..state.layout import FlatLayout, chunk_align
from ..state.regions import TieredRegions
from ..state.scales import ScaleLayout
from .adamw8bit import adamw8bit_segments, align_dtype, eight_bit
from .base import UpdateStats
from .kernels import adamw_segments, sgd_segments
from .on_device import DeviceStates

DEVICE, HOST, BUFFERS = "device", "host", "buffers"  # where a unit's update runs (``StreamedOptimizer._where``)

__all__ = [
    "StreamedOptimizer",
    "device_units",
    "optimizer_shares",
    "optimizer_sizes",
    "optimizer_states",
    "state_bytes_per_element",
    "update_set_bytes",
]

F32 = torch.float32


class _BufferSet:
    """Aligned buffers for one chunk: params, grads (and an fp32 copy), moments, master."""

    # views into one aligned slab, set below by name (``v`` only with two moments, ``g32`` and
    # ``w`` only for lower-precision parameters)
    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    g32: torch.Tensor
    w: torch.Tensor

    def __init__(
        self, chunk: int, pdtype: torch.dtype, master: bool, moments: int = 2, mdtype: torch.dtype = F32
    ) -> None:
        parts = [("p", pdtype), ("g", pdtype), ("m", mdtype)] + ([("v", mdtype)] if moments == 2 else [])
        if pdtype != F32:
            parts += [("g32", F32), ("w", F32)]
        total = sum(chunk * d.itemsize for _, d in parts)
        self.slab = aligned_empty(total)
        pos = 0
        for name, d in parts:
            n = chunk * d.itemsize  # chunk is a multiple of 2048 elements: every part 4 KiB aligned
            setattr(self, name, self.slab[pos : pos + n].view(d))
            pos += n
        self.nbytes = total


def _per_elem(cfg: OptimConfig, pdtype: torch.dtype) -> int:
    """Bytes a buffer set holds per element (``_BufferSet``): parameters and gradients, the
    moments, an fp32 gradient and master weight for lower-precision parameters."""
    mdtype = torch.uint8 if eight_bit(cfg) else F32
    moments = 2 if cfg.name != "sgd" else 1
    return 2 * pdtype.itemsize + mdtype.itemsize * moments + (8 if pdtype != F32 else 0)


def update_chunk(cfg: OptimConfig, pdtype: torch.dtype, record_align: int, buffer_bytes: int, max_numel: int) -> int:
    """Elements of one chunk of the streamed optimizer: ``buffer_bytes`` (``memory.update_buffer_kib``)
    of them in whole aligned steps, at most a unit's (``max_numel``), and at least one step:
    chunks start at multiples of a step, whole checksum blocks (``record_align`` bytes) in every
    state file and multiples of 64 elements per parameter (the fused kernel's exactness; 8-bit
    states: of 256, their blocks, as parameters then start on them). One step can be more than
    ``buffer_bytes`` (large checksum blocks, 8-bit states): ``update_set_bytes`` counts it."""
    per_elem, step = _per_elem(cfg, pdtype), chunk_align(record_align, align_dtype(cfg, pdtype))
    chunk = max(step, (buffer_bytes // per_elem) // step * step)
    return max(step, min(chunk, -(-max_numel // step) * step))


def update_set_bytes(cfg, dtype: torch.dtype, record_align: int, max_numel: int) -> int:
    """What one of the streamed optimizer's three buffer sets holds (``cfg``: the run's Config),
    for the budget's fixed pools: ``memory.update_buffer_kib``, or one aligned chunk where that
    is more (it was counted as the setting alone: 32 MiB budgeted for 64 with 16 MiB checksum
    blocks, 8 for 14 with 8-bit states in bf16)."""
    buffer_bytes = cfg.memory.update_buffer_kib << 10
    chunk = update_chunk(cfg.optim, dtype, record_align, buffer_bytes, max_numel)
    return max(buffer_bytes, chunk * _per_elem(cfg.optim, dtype))


def optimizer_states(
    cfg: OptimConfig,
    layout,
    pdtype: torch.dtype,
    align: int,
    host_bytes: int,
    *,
    owner: str,
    file=lambda name: f"{name}.bin",
    path: str | None = None,
    double: bool = False,
    device_bytes: int = 0,
) -> list[StateDecl]:
    """The optimizer's states: fp32 master weights (when parameters are lower precision),
    then the moments (AdamW: ``exp_avg``, ``exp_avg_sq``; AdamW8bit: the same as one-byte codes,
    and their scales, ``exp_avg_scales``; SGD: ``momentum``), each within its share of
    ``host_bytes`` (``optimizer_shares``), but for the units whose states ``device_bytes`` holds
    (``device_units``: in device memory). ``file(name)``: the file a state lives in on ``path``;
    ``double``: each held twice (the speculative update's ``DoubleRegions``)."""
    shares = optimizer_shares(cfg, layout, pdtype, host_bytes)
    on_device = device_units(cfg, layout, pdtype, device_bytes) if not double else frozenset()
    return [
        declare_state(
            double,
            ScaleLayout(layout) if n == "exp_avg_scales" else layout,
            file(n),
            _dtype(cfg, n),
            share,
            align,
            name=n,
            owner=owner,
            checkpointed=True,
            path=path,
            weights=n == "master",
            **({"device_units": on_device} if on_device else {}),
        )
        for n, share in shares.items()
    ]


def device_units(cfg: OptimConfig, layout, pdtype: torch.dtype, device_bytes: int) -> frozenset[int]:
    """The trained units whose optimizer states (every one: master and moments) ``device_bytes``
    of device memory holds, the first that fit in order; none for 8-bit states (their kernel
    and scales are the host's)."""
    if device_bytes <= 0 or eight_bit(cfg):
        return frozenset()
    per = state_bytes_per_element(cfg, pdtype)
    out, left = [], device_bytes
    for unit in layout.units:
        if not unit.frozen and 0 < unit.numel * per <= left:
            out.append(unit.index)
            left -= unit.numel * per
    return frozenset(out)


def state_bytes_per_element(cfg: OptimConfig, pdtype: torch.dtype) -> int:
    """The optimizer's state bytes a parameter element takes (fp32 master and moments; 8-bit
    moments: their codes, the scales not counted)."""
    return (4 if pdtype != F32 else 0) + sum(_dtype(cfg, n).itemsize for n in _moments(cfg) if n != "exp_avg_scales")


def optimizer_sizes(cfg: OptimConfig, layout, pdtype: torch.dtype) -> dict[str, int]:
    """Each optimizer state's bytes over ``layout``, by name (AdamW8bit's scales with the small
    parameters' fp32 moments and each record's padding: what the budget holds)."""
    names = (["master"] if pdtype != F32 else []) + _moments(cfg)
    numel = lambda lay: sum(u.numel for u in lay.units)  # noqa: E731  (an engine's slices have no total)
    return {n: numel(ScaleLayout(layout) if n == "exp_avg_scales" else layout) * _dtype(cfg, n).itemsize for n in names}


def optimizer_shares(cfg: OptimConfig, layout, pdtype: torch.dtype, host_bytes: int) -> dict[str, int]:
    """Each optimizer state's share of ``host_bytes``, by name, in proportion to its bytes (equal
    shares for fp32 states; AdamW8bit's scales, about 1/64 of its codes, a share to match)."""
    sizes = optimizer_sizes(cfg, layout, pdtype)
    total = max(1, sum(sizes.values()))
    return {n: host_bytes * size // total for n, size in sizes.items()}


def _dtype(cfg: OptimConfig, name: str) -> torch.dtype:
    return torch.uint8 if name in ("exp_avg", "exp_avg_sq") and eight_bit(cfg) else F32


def _moments(cfg: OptimConfig) -> list[str]:
    if cfg.name == "sgd":
        return ["momentum"]
    return ["exp_avg", "exp_avg_sq"] + (["exp_avg_scales"] if eight_bit(cfg) else [])


class StreamedOptimizer:
    """AdamW or SGD with momentum over the states ``optimizer_states`` declares.

    ``params`` and ``grads``: regions (``TieredRegions``-like: ``read``, ``write``,
    ``on_host``, ``host_view``) holding the parameters (read when there is no master copy,
    written with the new values) and the gradients (read).

    States held twice (``DoubleRegions``: the speculative update) are read from their
    current half and written to the other one, which ``flip(u)`` makes current once the
    step is validated; host-resident parameters held twice are copied like the others
    instead of updated in place."""

    def __init__(
        self,
        layout: FlatLayout,
        storage: Storage,
        params: TieredRegions,
        grads: TieredRegions,
        cfg: OptimConfig,
        states: list[StateDecl],
        *,
        buffer_bytes: int,
        ahead_bytes: int = 0,
        dev=None,
    ) -> None:
        self.layout, self.params, self.grads, self.cfg = layout, params, grads, cfg
        pdtype = params.dtype
        self.has_master = pdtype != F32
        self.adamw = cfg.name != "sgd"
        self.eight_bit = eight_bit(cfg)
        moments = 2 if self.adamw else 1
        mdtype = torch.uint8 if self.eight_bit else F32
        self.chunk = update_chunk(cfg, pdtype, storage.record_align, buffer_bytes, layout.max_unit_numel)
        scales = ScaleLayout(layout) if self.eight_bit else None  # fp32 records
        regions = {
            d.name: build_region(scales if d.name == "exp_avg_scales" else layout, storage, d, device=dev)
            for d in states
        }
        self.m = regions["exp_avg" if self.adamw else "momentum"]
        self.v = regions.get("exp_avg_sq")
        self.master = regions.get("master")
        self.scales = _Scales(regions["exp_avg_scales"]) if self.eight_bit else None
        self._double = [r for r in (*self.state_files, params) if isinstance(r, DoubleRegions)]  # fixed at start
        self.on_device = DeviceStates.build(self, dev)  # units whose states are in device memory (or None)
        self.sets = [_BufferSet(self.chunk, pdtype, self.has_master, moments, mdtype) for _ in range(3)]
        # Read-ahead sets: the first chunks' state (not gradients), read before the step
        # while the disk is idle (``read_ahead``); as many whole sets as ``ahead_bytes`` holds.
        # Never more sets than the step has chunks: a budget larger than the state holds all of it.
        self.trainable = [u for u in layout.units if not u.frozen]  # a full step's units (train.freeze: not all)
        self._all_chunks = self._chunks()  # a full step's chunks, in order (the layout is fixed)
        n_ahead, ahead_units = self._ahead_fit(ahead_bytes, self.sets[0].nbytes, scales)
        self.ahead_sets = [_BufferSet(self.chunk, pdtype, self.has_master, moments, mdtype) for _ in range(n_ahead)]
        if self.scales is not None:  # a record per unit in flight: 3 sets' units, the read-ahead's units
            self.scales.allocate(3 + ahead_units)
        self._ahead: dict[int, list[IOFuture]] = {}  # chunk index -> its state reads in flight
        self.step_count = 0
        self.stats = UpdateStats()

    def _ahead_fit(self, ahead_bytes: int, set_bytes: int, scales: ScaleLayout | None) -> tuple[int, int]:
        """How many of the step's first chunks are read ahead within ``ahead_bytes``, and how many
        units they span: each chunk takes a buffer set, and (8-bit states) the first chunk of
        each unit a buffer of the largest scales record, within the same bytes."""
        record = 4 * scales.max_unit_numel if scales is not None else 0
        n, units, used = 0, 0, 0
        for u, a, _ in self._all_chunks:
            more = set_bytes + (record if a == 0 else 0)
            if used + more > ahead_bytes:
                break
            n, units, used = n + 1, units + (a == 0), used + more
        return n, units

    @property
    def pool_bytes(self) -> int:
        own = sum(s.nbytes for s in self.sets + self.ahead_sets) + (self.scales.pool_bytes if self.scales else 0)
        return own + sum(r.host_bytes for r in self.state_files)

    @property
    def state_files(self) -> list[TieredRegions | DoubleRegions]:
        scales = self.scales.region if self.scales is not None else None
        return [r for r in (self.master, self.m, self.v, scales) if r is not None]

    def flip(self, u: int) -> None:
        """Unit ``u``'s state written by the last step (every write of it complete) becomes
        current in every state held twice (speculation: every state the step writes)."""
        for r in self._double:
            r.flip(u)

    def _in_place(self, u: int) -> bool:
        """Host-resident parameters held once are updated in place."""
        return self.params.on_host(u) and not isinstance(self.params, DoubleRegions)

    def regions(self) -> dict[str, TieredRegions | DoubleRegions]:
        """The optimizer's states by name."""
        return {r.name: r for r in self.state_files}

    def init_unit(self, u: int, flat32: torch.Tensor) -> None:
        """Initial state of unit ``u`` from its fp32 weights: the master copy (when kept) and
        the parameters in their dtype. Moments start at zero: fresh state files are
        zero-filled when created."""
        futs = [self.master.write(u, flat32)] if self.master is not None else []
        futs.append(self.params.write(u, flat32 if self.params.dtype == F32 else flat32.to(self.params.dtype)))
        for f in futs:
            f.get()

    def _chunks(self, units: list[int] | None = None) -> list[tuple[int, int, int]]:
        todo = self.trainable if units is None else [self.layout.units[u] for u in units]
        return [
            (unit.index, a, min(a + step, unit.numel))
            for unit in todo
            for step in [self._chunk_of(unit)]
            for a in range(0, unit.numel, step)
        ]

    def _chunk_of(self, unit) -> int:
        """Elements a chunk of ``unit`` holds: the buffer sets' chunk, or the whole unit where it
        is updated in device memory with nothing passing through them (one wait a unit)."""
        whole = self.on_device is not None and self.on_device.whole(unit.index)
        return max(1, unit.numel) if whole else self.chunk

    def read_ahead(self) -> int:
        """Start reading the state (moments, parameters or master) of the first chunks of
        the next full step into the read-ahead sets; returns how many. Call only between
        steps (the state must not change before the step that uses it)."""
        if not self.ahead_sets or self._ahead:
            return len(self._ahead)  # none, or already under way
        for i, chunk in enumerate(self._all_chunks[: len(self.ahead_sets)]):
            self._ahead[i] = self._read_state(self.ahead_sets[i], *chunk)
        return len(self._ahead)

    def drop_ahead(self) -> None:
        """Forget what was read ahead (the state files are about to change hands)."""
        for futs in self._ahead.values():
            _wait(futs)
        self._ahead = {}
        if self.scales is not None:
            self.scales.drop()

    def step(
        self,
        lr: float,
        clip_coef: torch.Tensor | None,
        *,
        step: int | None = None,
        units: list[int] | None = None,
        on_unit_done: Callable[[int], None] | None = None,
        on_chunk: Callable[[int, int, int, torch.Tensor], None] | None = None,
        grads=None,
    ) -> UpdateStats:
        """Apply optimizer step ``step`` (default: the next) to ``units`` (default: all, in
        order). Gradients must be home. ``on_unit_done(u)`` is called once every write of
        unit ``u`` has completed; ``on_chunk(u, a, b, p)`` right after elements ``[a, b)``
        of unit ``u`` are updated, with ``p`` their new parameters (in the parameter dtype),
        before they are written. ``grads``: where this step reads its gradients, if not from
        ``self.grads`` (an engine's shared slot)."""
        self.step_count = self.step_count + 1 if step is None else step
        grads = self.grads if grads is None else grads
        st = UpdateStats()
        t_start = time.perf_counter()
        coef = clip_coef.to("cpu") if clip_coef is not None else None  # sync point on CUDA: one scalar
        chunks = self._all_chunks if units is None else self._chunks(units)
        unit_writes: list[IOFuture] = []
        order = [u.index for u in self.trainable] if units is None else list(units)
        announced = 0  # units of `order` reported done (empty ones included: an engine may own nothing of a unit)

        def report_until(u: int | None) -> None:
            nonlocal announced
            while announced < len(order) and order[announced] != u:
                if on_unit_done is not None:
                    on_unit_done(order[announced])
                announced += 1

        if self.scales is not None and not self._ahead:  # nothing read ahead: no unit's scales are held
            st.wait_s += self.scales.reset()  # (a step that raised may have left some)
        # Chunks 0..K-1 use the read-ahead sets (their state already read or on its way),
        # the rest rotate through the 3 sets: read i+1 while i is updated and i-1 written.
        ahead, self._ahead = (self._ahead, {}) if units is None else ({}, self._ahead)
        K = st.ahead = len(ahead)
        writes: list[list[IOFuture]] = [[] for _ in self.sets + self.ahead_sets[:K]]
        reads: dict[int, list[IOFuture]] = {}
        slot = lambda i: len(self.sets) + i if i < K else (i - K) % len(self.sets)  # noqa: E731
        bufs = self.sets + self.ahead_sets[:K]

        placed = self._where(grads)
        where = {u: placed(u) for u in dict.fromkeys(c[0] for c in chunks)}.__getitem__  # once a unit, not a chunk

        def issue(i: int) -> None:
            s = slot(i)
            st.wait_s += _wait(writes[s])
            writes[s] = []
            u, a, b = chunks[i]
            if where(u) != BUFFERS:  # updated where its states live (a read-ahead copy is dropped)
                reads[i] = (ahead.pop(i) if i < K else []) + (
                    self.on_device.reads(grads, bufs[s], u, a, b) if where(u) == DEVICE else []
                )
                return
            state = ahead.pop(i) if i < K else self._read_state(bufs[s], *chunks[i])
            reads[i] = state + [grads.read(u, bufs[s].g, a, b)]

        if chunks:
            issue(0)
        for i, (u, a, b) in enumerate(chunks):
            if i + 1 < len(chunks):
                issue(i + 1)
            st.wait_s += _wait(reads.pop(i))  # sync point: chunk i's states are in memory
            t0 = time.perf_counter()
            bs = bufs[slot(i)]
            faults.point("update")
            kind = where(u)
            if kind == DEVICE:
                self.on_device.update(bs, grads, u, a, b, lr, coef)
            elif kind == HOST:
                self._compute_resident(bs, grads, u, a, b, lr, coef)
            else:
                self._compute(bs, u, a, b, lr, coef)
            if on_chunk is not None:
                on_chunk(u, a, b, self._pview(bs, u, a, b))
            st.compute_s += time.perf_counter() - t0
            writes[slot(i)] = (
                self._write(bs, u, a, b)
                if kind == BUFFERS
                else self.on_device.writes(bs, u, a, b)
                if kind == DEVICE
                else []
            )
            if self.scales is not None and b == self.layout.units[u].numel:  # the unit's last chunk
                unit_writes.append(self.scales.write(u))
            unit_writes += writes[slot(i)]
            if on_unit_done is not None and (i + 1 == len(chunks) or chunks[i + 1][0] != u):
                st.wait_s += _wait(unit_writes)  # the unit is complete on storage
                unit_writes = []
                report_until(u)  # earlier empty units, then this one
                on_unit_done(u)
                announced += 1
        for w in writes:
            st.wait_s += _wait(w)
        if self.scales is not None:
            st.wait_s += self.scales.settle()
        report_until(None)
        st.seconds, st.chunks = time.perf_counter() - t_start, len(chunks)
        self.stats = st
        return st

    # -- one chunk --------------------------------------------------------------------------------
    def _pview(self, bs: _BufferSet, u: int, a: int, b: int) -> torch.Tensor:
        if self._in_place(u):  # host-resident parameters are updated in place
            return self.params.host_view(u)[a:b]
        return bs.p[: b - a]

    def _read_state(self, bs: _BufferSet, u: int, a: int, b: int) -> list[IOFuture]:
        futs = [self.m.read(u, bs.m, a, b)]
        if self.scales is not None and a == 0:  # the unit's first chunk: its scales, read whole
            futs += self.scales.read(u)
        if self.v is not None:
            futs.append(self.v.read(u, bs.v, a, b))
        if not self._in_place(u) and not self.has_master:
            futs.append(self.params.read(u, bs.p, a, b))
        if self.master is not None:
            futs.append(self.master.read(u, bs.w, a, b))
        return futs

    def _where(self, grads) -> Callable[[int], str]:
        """Where a unit's update runs: ``DEVICE``, its states in device memory (``on_device.py``);
        ``HOST``, in place (``_compute_resident``): every state it reads and writes is in host
        memory, held once, and AdamW's or SGD's in fp32 (an 8-bit state's codes and scales go
        through the buffers); else ``BUFFERS``, through a buffer set. In place, a parameter moves
        through memory once instead of three times (copied into a buffer set, updated, copied
        back): on CUDA, where the host's update bounds the step, it is most of the update's time."""
        dev = self.on_device.units if self.on_device is not None else frozenset()
        if self._double or self.scales is not None:
            return lambda u: DEVICE if u in dev else BUFFERS
        if not hasattr(grads, "on_host"):  # an engine's shared gradient slot: read through the buffers
            return lambda u: DEVICE if u in dev else BUFFERS
        regions = [r for r in (self.m, self.v, self.master, grads) if r is not None]
        return lambda u: (
            DEVICE if u in dev else HOST if self._in_place(u) and all(r.on_host(u) for r in regions) else BUFFERS
        )

    def _compute_resident(
        self, bs: _BufferSet, grads, u: int, a: int, b: int, lr: float, coef: torch.Tensor | None
    ) -> None:
        """``_compute`` on the states where they live: the same kernel on the same elements in
        the same segments, so the same bits. The gradient is copied once where it must change
        (upcast to fp32, or clipped: the stored gradient stays as the backward wrote it)."""
        n = b - a
        g = grads.host_view(u)[a:b]
        if self.has_master or coef is not None:
            g = (bs.g32 if self.has_master else bs.g)[:n].copy_(g)
        self._apply(u, a, b, lr, coef, g, self._view(self.master, u, a, b), self._view(self.m, u, a, b),
                    self._view(self.v, u, a, b))  # fmt: skip
        if self.has_master:
            self.params.host_view(u)[a:b].copy_(self.master.host_view(u)[a:b])  # the new low-precision parameters

    @staticmethod
    def _view(region, u: int, a: int, b: int) -> torch.Tensor | None:
        return None if region is None else region.host_view(u)[a:b]

    def _compute(self, bs: _BufferSet, u: int, a: int, b: int, lr: float, coef: torch.Tensor | None) -> None:
        n = b - a
        g = bs.g[:n]
        if self.has_master:  # lower-precision gradients: clipped after the upcast, in fp32
            bs.g32[:n].copy_(g)
            g = bs.g32[:n]
        self._apply(
            u,
            a,
            b,
            lr,
            coef,
            g,
            bs.w[:n] if self.has_master else None,
            bs.m[:n],
            bs.v[:n] if self.v is not None else None,
            bs,
        )
        if self.has_master:
            self._pview(bs, u, a, b).copy_(bs.w[:n])  # new low-precision parameters from the master

    def _apply(self, u, a, b, lr, coef, g, master, m, v, bs: _BufferSet | None = None) -> None:
        """The kernel on elements ``[a, b)`` of unit ``u``: ``g`` the fp32 gradient (clipped here
        where ``coef`` is given), ``master`` the fp32 weights (None: the parameters, in place or
        in ``bs``), ``m``/``v`` the moments."""
        w = master if master is not None else self.params.host_view(u)[a:b] if bs is None else self._pview(bs, u, a, b)
        if coef is not None:
            g.mul_(coef)  # as clip_grad_norm_ does (fp32: on the gradient itself, bit-identical)
        segs = self.layout.segments(u, a, b)
        cut = lambda t: [t[x - a : y - a] for _, x, y in segs]  # noqa: E731
        if self.scales is not None:
            unit, record = self.scales.of(u)
            adamw8bit_segments(
                segs, cut(w), cut(g), cut(m), cut(v), unit, record, step=self.step_count, lr=lr, cfg=self.cfg
            )
        elif self.adamw:
            adamw_segments(cut(w), cut(g), cut(m), cut(v), step=self.step_count, lr=lr, cfg=self.cfg)
        else:
            sgd_segments(cut(w), cut(g), cut(m), step=self.step_count, lr=lr, cfg=self.cfg)

    def _write(self, bs: _BufferSet, u: int, a: int, b: int) -> list[IOFuture]:
        futs = [_put(self.m, u, bs.m, a, b)]
        if self.v is not None:
            futs.append(_put(self.v, u, bs.v, a, b))
        if self.master is not None:
            futs.append(_put(self.master, u, bs.w, a, b))
        if not self._in_place(u):
            futs.append(_put(self.params, u, bs.p, a, b))
        return futs

    def close(self) -> None:
        for r in self.state_files:
            r.close()


class _Scales:
    """The 8-bit states' per-unit records (``exp_avg_scales``), each read whole with its unit's
    first chunk into a buffer of its own and written whole after its last: a few buffers
    rotate over the units in flight (the read-ahead ones, the one read next, the one being
    updated, the ones still being written)."""

    def __init__(self, region) -> None:
        self.region = region
        self.layout: ScaleLayout = region.layout
        self.bufs: list[torch.Tensor] = []
        self.free: list[int] = []
        self.held: dict[int, int] = {}  # unit -> its buffer
        self.pending: dict[int, IOFuture] = {}  # buffer -> its write in flight

    def allocate(self, n: int) -> None:
        size = self.layout.max_unit_numel * 4
        self.bufs = [aligned_empty(size).view(F32) for _ in range(n)] if size else []
        self.free = list(range(len(self.bufs)))

    @property
    def pool_bytes(self) -> int:
        return sum(b.numel() * 4 for b in self.bufs)

    def read(self, u: int) -> list[IOFuture]:
        n = self.layout.units[u].numel
        if not n:
            return []
        if not self.free:  # the oldest written unit's buffer (reads come in unit order)
            raise RuntimeError("8-bit states: more units in flight than scale buffers")
        assert u not in self.held, "a unit's scales read twice (read ahead, then again)"
        k = self.free.pop(0)
        if k in self.pending:
            self.pending.pop(k).get()  # sync point: its last unit's record is on storage
        self.held[u] = k
        return [self.region.read(u, self.bufs[k], 0, n)]

    def of(self, u: int):
        unit = self.layout.units[u]
        return unit, (self.bufs[self.held[u]] if unit.numel else torch.empty(0))

    def write(self, u: int) -> IOFuture:
        n = self.layout.units[u].numel
        if not n:
            return IOFuture.completed(0)
        k = self.held.pop(u)
        f = self.pending[k] = _put(self.region, u, self.bufs[k], 0, n)
        self.free.append(k)
        return f

    def settle(self) -> float:
        t0 = time.perf_counter()
        for k in list(self.pending):
            self.pending.pop(k).get()
        return time.perf_counter() - t0

    def reset(self) -> float:
        """Every buffer free, every write settled; the seconds waited."""
        waited = self.settle()
        self.drop()
        return waited

    def drop(self) -> None:
        """Forget the units read ahead (their records are read again when needed)."""
        self.free.extend(self.held.values())
        self.held.clear()


def _put(region, u: int, src: torch.Tensor, a: int, b: int) -> IOFuture:
    """A step's new state: into the half that is not current where the state is held twice."""
    if isinstance(region, DoubleRegions):
        return region.write_next(u, src, a, b)
    return region.write(u, src, a, b)


def _wait(futs: list[IOFuture]) -> float:
    t0 = time.perf_counter()
    for f in futs:
        f.get()
    return time.perf_counter() - t0
