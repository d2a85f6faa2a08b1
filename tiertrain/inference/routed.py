"""Routed expert reads: a forward-only run reads only the experts its tokens reach.

A mixture of experts' block holds every expert, but a token uses ``num_experts_per_tok`` of
them; in eval and generation (forward only) there is no gradient and no update, so the experts
no token of the pass reaches need not be read at all. With ``io.weights = "tier"`` (the
converted copy, one file in the runtime's flat layout, where expert ``e`` of a parameter
``[E, ...]`` is one contiguous range) a block's unit is read without its experts' ranges
(``RoutedReads.load``); a forward pre-hook on each experts module (transformers' experts
modules take the routing as ``top_k_index`` or ``router_indices``; so do the ranges of experts
of a cut layer, ``models/experts_cut.py``, numbering their own from 0) reads the experts the
micro-batch's routing names and this unit's slot does not hold yet, before they compute. An
expert read once stays for the rest of the unit's residency (the other micro-batches of the
pass); a unit read again starts with none. Two other forms name the experts reached their own
way: JetMoE's ``JetMoeParallelExperts`` take each expert's count of (token, expert) pairs
(``expert_size``: an expert with none is reached by no token), and Llama 4's experts module runs
every expert on every token, on an expert-major input where an expert no token picked has only
rows of zeros (``models/experts_dense.py: every_expert_module``).

Exactness: transformers' experts forwards (eager, ``grouped_mm``, ``batched_mm``) compute
each token with its routed experts' rows only; the rows of the experts not reached are never
read by the arithmetic (tested with them set to NaN), so the outputs are those of the whole
block, bit for bit; so do JetMoE's (an expert's product over no pairs is empty). Llama 4's
experts do read every expert's rows: an expert not reached multiplies zeros, whose products
are zero for any finite weights, so its rows in the slot are set to zeros instead of read (a
fill in the slot's memory, no read), and the sum over the experts adds the same zeros.

The expert cache: host memory for the experts reached most often (counted over the run),
one fixed pool of rows claimed at start (``memory.expert_cache_mib``; by default what the
host budget for weights leaves after the units kept whole, ``weights.resident_budget``). A
reached expert found there is copied from it instead of read; one read from the file takes a
free row, or the row of the cached expert reached least often when that one was reached less.

A read the routing asks for is synchronous (a sync point: the routing is known only when the
block's router has run). Guesses (``io.guess_experts``) take those reads off the compute's
path where the routing repeats: each unit remembers the experts its last residency reached
and how many of them the next reached (a running mean, ``GUESS_DECAY``); where that mean is at
least ``GUESS_AT`` (eval of many tokens, a long prompt's passes: nearly every expert each
time), a load reads those experts with the unit, ahead of the compute, as the whole block's
prefetch would; where they were at least ``GUESS_ALL`` of a module's experts, it reads all of
that module's (the few others would each wait on a read after the router). Decoding a few tokens a step reaches other experts each step (the mean stays
low): nothing is guessed there, and the bytes stay the routing's. A guessed expert the routing
does not reach costs its bytes and nothing else: no expert not reached is computed with.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Hashable

import torch
import torch.nn as nn

from ..io import IOFuture, aligned_empty
from ..models.experts_dense import every_expert_module
from ..state.layout import FlatLayout, ParamRecord
from ..state.sources import ParamSource

__all__ = ["ExpertCache", "Experts", "RoutedReads", "RoutedStats", "find_experts", "weights_read"]

log = logging.getLogger("tiertrain")

BOUNCE_ROWS = 8  # experts read at once through a separate device's bounce buffer
GUESS_AT = 0.5  # least running share of the last residency's experts reached again, to guess them
GUESS_DECAY = 0.5  # weight of the past in that running share
GUESS_ALL = 0.75  # a module whose last residency reached this share of its experts: all guessed
_INDEX_ARGS = ("top_k_index", "router_indices")  # transformers' names of the routing argument
_COUNTS_ARG = "expert_size"  # JetMoE's: each expert's count of (token, expert) pairs


@dataclass(frozen=True)
class Experts:
    """One experts module of unit ``unit``: its parameters indexed by expert (first dimension
    ``n``), and where its forward takes the routing (``arg``, positional index ``pos``) in which
    form (``kind``): ``"index"``, the experts of each (token, slot); ``"counts"``, each expert's
    number of pairs; ``"rows"``, the expert-major input itself (an expert not reached: zeros)."""

    unit: int
    module: nn.Module = field(repr=False, compare=False)
    records: tuple[ParamRecord, ...]
    n: int
    arg: str
    pos: int
    kind: str = "index"

    def reached(self, args: tuple, kwargs: dict) -> list[int]:
        """The experts the routing of this call reaches (a sync point but for ``counts``)."""
        val = kwargs[self.arg] if self.arg in kwargs else args[self.pos]
        if self.kind == "counts":
            counts = val.tolist() if torch.is_tensor(val) else list(val)
            return [e for e, c in enumerate(counts) if c]
        if self.kind == "rows":
            return val.reshape(self.n, -1).ne(0).any(1).nonzero().flatten().tolist()
        return [e for e in torch.unique(val).tolist() if 0 <= e < self.n]

    @property
    def row(self) -> int:
        """Elements of one expert over all its parameters."""
        return sum(r.numel // self.n for r in self.records)


def _routing(mod: nn.Module, names: list[str]) -> tuple[str, str] | None:
    """(argument, form) of an experts module's routing, or None (see ``Experts``)."""
    arg = next((a for a in _INDEX_ARGS if a in names), None)
    if arg is not None:
        return arg, "index"
    if _COUNTS_ARG in names:
        return _COUNTS_ARG, "counts"
    if len(names) == 1 and every_expert_module(mod):
        return names[0], "rows"
    return None


def find_experts(model: nn.Module, layout: FlatLayout) -> list[Experts]:
    """The experts modules whose forward takes the routing (in one of ``Experts``' forms), with
    their unit and parameters (those whose first dimension is the number of experts: 3-D
    weights, 2-D biases)."""
    owner = {id(r.param): (u.index, r) for u in layout.units for r in u.params}
    out = []
    for mod in model.modules():
        own = [p for p in mod.parameters(recurse=False) if p.dim() == 3]
        if not own or any(id(p) not in owner for p in own):
            continue
        try:
            names = list(inspect.signature(mod.forward).parameters)
        except (TypeError, ValueError):
            continue
        routing = _routing(mod, names)
        if routing is None:
            continue
        arg, kind = routing
        n = own[0].shape[0]
        params = [p for p in mod.parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == n]
        if any(id(p) not in owner for p in params):
            continue
        units = {owner[id(p)][0] for p in params}
        if len(units) != 1:
            continue
        recs = tuple(sorted((owner[id(p)][1] for p in params), key=lambda r: r.offset))
        out.append(Experts(units.pop(), mod, recs, n, arg, names.index(arg), kind))
    return out


@dataclass
class RoutedStats:
    """What the routed reads of a run did (bytes as asked of the storage tier: a read covers
    whole checksum blocks, ``weights.ROUTED_BLOCK``)."""

    skipped_bytes: int = 0  # experts' bytes left out of units' reads
    read_bytes: int = 0  # experts' bytes read by the routing
    cached_bytes: int = 0  # experts' bytes copied from the expert cache
    reached: int = 0  # (unit residency, expert) pairs the routing reached
    of: int = 0  # (unit residency, expert) pairs there were
    wait_s: float = 0.0  # seconds the compute waited for the experts' reads
    guessed: int = 0  # (unit residency, expert) pairs read ahead with their unit
    guessed_bytes: int = 0
    guess_hits: int = 0  # of those, the pairs the routing then reached
    hit_bytes: int = 0  # their bytes (reached: with ``read_bytes`` and ``cached_bytes``, the reached experts')

    def line(self) -> str:
        """The stats in words, for the summary lines."""
        never = self.skipped_bytes - self.read_bytes - self.cached_bytes - self.guessed_bytes
        return (
            f"experts: {self.reached} of {self.of} reached and loaded ({self.read_bytes / 1e9:.3f} GB read in "
            f"{self.wait_s:.2f} s waited, {self.guessed_bytes / 1e9:.3f} GB read ahead as guessed ({self.guess_hits} "
            f"of {self.guessed} reached), {self.cached_bytes / 1e9:.3f} GB from the expert cache, "
            f"{never / 1e9:.3f} GB of experts not reached never read)"
        )


class ExpertCache:
    """``rows`` fixed host rows of ``row_bytes`` each, for the experts reached most often (see
    the module docstring). ``pin``: page-locked, for uploads to a CUDA device."""

    def __init__(self, rows: int, row_bytes: int, *, pin: bool = False) -> None:
        self.row_bytes = row_bytes
        self.pool = aligned_empty(rows * row_bytes, pin=pin) if rows else torch.empty(0, dtype=torch.uint8)
        self.free = list(range(rows))[::-1]
        self.where: dict[Hashable, int] = {}  # an expert's key (unit, experts module, expert) -> its row
        self.counts: dict[Hashable, int] = {}
        self.evictions = 0

    @property
    def bytes(self) -> int:
        """The pool's size."""
        return self.pool.numel()

    def reached(self, key: Hashable) -> None:
        """The routing reached ``key`` once more."""
        self.counts[key] = self.counts.get(key, 0) + 1

    def get(self, key: Hashable) -> torch.Tensor | None:
        """``key``'s row (bytes), or None where it is not kept."""
        row = self.where.get(key)
        return None if row is None else self.row(row)

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` of the pool (bytes)."""
        return self.pool[i * self.row_bytes : (i + 1) * self.row_bytes]

    def admit(self, key: Hashable) -> torch.Tensor | None:
        """A row to put ``key``'s bytes in (a free one, else the coldest's when it is colder),
        or None: not kept."""
        if key in self.where:
            return self.row(self.where[key])
        if self.free:
            self.where[key] = self.free.pop()
            return self.row(self.where[key])
        if not self.where:
            return None
        cold = min(self.where, key=lambda k: self.counts.get(k, 0))
        if self.counts.get(cold, 0) >= self.counts.get(key, 0):
            return None
        self.evictions += 1
        self.where[key] = self.where.pop(cold)
        return self.row(self.where[key])


class RoutedReads(ParamSource):
    """``inner`` (the converted copy ``tier``, or units of it kept in host memory) with the
    experts of ``experts`` read by the routing (see the module docstring); ``cache``: the
    expert cache, or None. Closed with ``close()`` (the hooks go)."""

    file_backed = True

    def __init__(
        self, inner: ParamSource, tier, experts: list[Experts], dev, cache: ExpertCache | None, *, guess: bool = True
    ) -> None:
        self.inner, self.tier, self.dev, self.cache, self.guess = inner, tier, dev, cache, guess
        self.dtype, self.layout = inner.dtype, tier.layout
        self.stats = RoutedStats()
        self.by_unit: dict[int, list[Experts]] = {}
        for ex in experts:
            self.by_unit.setdefault(ex.unit, []).append(ex)
        self.keep = {u: _complement(self.layout.units[u].numel, exs) for u, exs in self.by_unit.items()}
        self.present: dict[int, set[tuple[int, int]]] = {}  # unit -> (experts module, expert) in its slot
        self.zeroed: dict[int, set[int]] = {}  # unit -> its "rows" experts modules whose slot rows are zeros or read
        # guesses (module docstring): per unit, the (experts module, expert) pairs reached in its
        # residency now and in its last one, those read ahead now, and the running share
        self.now: dict[int, set[tuple[int, int]]] = {}
        self.last: dict[int, set[tuple[int, int]]] = {}
        self.guessed: dict[int, set[tuple[int, int]]] = {}
        self.share: dict[int, float] = {}
        self._filled: dict[int, list[tuple[int, int]]] = {}  # unit -> the ranges its load fills
        self._row = max(ex.row for ex in experts)
        # a separate device's rows cross through pinned host memory, BOUNCE_ROWS reads at a time
        self._bounce = (
            aligned_empty(BOUNCE_ROWS * self._row * self.dtype.itemsize, pin=dev.pin).view(self.dtype)
            if dev.separate
            else None
        )
        # the bytes read before (units kept whole in host memory): not the passes'
        self.base_bytes = tier.file.workers.stats.snapshot().read_bytes
        self._hooks = [
            # first among the module's pre-hooks: LoRA's makes the experts' adapted weights of them
            ex.module.register_forward_pre_hook(partial(self._reach, ex, j), with_kwargs=True, prepend=True)
            for exs in self.by_unit.values()
            for j, ex in enumerate(exs)
        ]

    # -- ParamSource ------------------------------------------------------------------------------
    def on_host(self, u: int) -> bool:
        return self.inner.on_host(u)

    def host_view(self, u: int) -> torch.Tensor:
        return self.inner.host_view(u)

    def loaded_bytes(self, u: int, numel: int, itemsize: int) -> int:
        return self.inner.loaded_bytes(u, numel, itemsize)

    @property
    def host_bytes(self) -> int:
        return self.inner.host_bytes + (self.cache.bytes if self.cache is not None else 0)

    def filled(self, u: int) -> list[tuple[int, int]] | None:
        """The element ranges of unit ``u`` its last load filled (its experts left out but those
        guessed; None: all)."""
        return self._filled.get(u, self.keep.get(u))

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        """Unit ``u`` without its experts (those read when the routing reaches them), but those
        guessed (see the module docstring)."""
        if u not in self.keep:
            return self.inner.load(u, out, slot)
        guess = self._guess(u)
        self.present[u], self.zeroed[u], self.guessed[u] = set(guess), set(), set(guess)
        unit, e = self.layout.units[u], self.dtype.itemsize
        ranges = self._filled[u] = _merged(self.keep[u] + self._rows(u, guess))
        self.stats.skipped_bytes += (unit.numel - sum(b - a for a, b in self.keep[u])) * e
        self.stats.of += sum(ex.n for ex in self.by_unit[u])
        self.stats.guessed += len(guess)
        self.stats.guessed_bytes += sum(self.by_unit[u][j].row for j, _ in guess) * e
        f = self.tier.file
        return IOFuture.gather([f.pread(out[a:b], (b - a) * e, (unit.offset + a) * e) for a, b in ranges])

    def _guess(self, u: int) -> list[tuple[int, int]]:
        """The pairs to read ahead with unit ``u``'s load; its last residency's record closed."""
        now = self.now.pop(u, None)
        if now:  # a residency that ran: how much of the one before it came again
            last = self.last.get(u)
            if last:
                again = len(last & now) / len(last)  # the first is taken as it is
                self.share[u] = GUESS_DECAY * self.share.get(u, again) + (1 - GUESS_DECAY) * again
            self.last[u] = now
        self.now[u] = set()
        if not self.guess or self.share.get(u, 0.0) < GUESS_AT:
            return []
        last = set(self.last.get(u, ()))
        for j, ex in enumerate(self.by_unit[u]):  # nearly every expert last time: all of them (no miss to wait on)
            if sum(i == j for i, _ in last) >= GUESS_ALL * ex.n:
                last.update((j, e) for e in range(ex.n))
        cached = self.cache.where if self.cache is not None else {}
        return sorted(p for p in last if (u, *p) not in cached)  # the cache's are copied, not read

    def _rows(self, u: int, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Element ranges (in unit ``u``) of the rows of ``pairs``, per parameter, runs merged."""
        out = []
        for j, ex in enumerate(self.by_unit[u]):
            for a, b in _runs([e for i, e in pairs if i == j]):
                out += [(r.offset + a * (r.numel // ex.n), r.offset + b * (r.numel // ex.n)) for r in ex.records]
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.inner.close()

    # -- the routing --------------------------------------------------------------------------------
    def _reach(self, ex: Experts, j: int, module, args, kwargs) -> None:
        """Forward pre-hook of an experts module: the experts its routing names, loaded."""
        if self.inner.on_host(ex.unit):  # kept whole in host memory
            return
        have = self.present.setdefault(ex.unit, set())
        # sync point: the routing is needed on the host to know what to read
        reached = ex.reached(args, kwargs)
        miss = [e for e in reached if (j, e) not in have]
        self._tally(ex, j, reached)
        try:
            self._load(ex, j, miss)
            if ex.kind == "rows" and j not in self.zeroed.setdefault(ex.unit, set()):
                # the experts not reached multiply zeros: their rows zero, not read (the slot's
                # rows may hold anything, NaN included, and NaN times zero is NaN)
                self._zero(ex, [e for e in range(ex.n) if (j, e) not in have and e not in miss])
                self.zeroed[ex.unit].add(j)
        except BaseException:
            self.present.pop(ex.unit, None)  # what the slot holds is unknown: read again if asked
            raise
        have.update((j, e) for e in miss)
        self.stats.reached += len(miss)

    def _tally(self, ex: Experts, j: int, reached: list[int]) -> None:
        """The pairs reached in this residency (guesses' record), and the guessed ones reached
        for the first time in it."""
        now, guessed = self.now.setdefault(ex.unit, set()), self.guessed.get(ex.unit, set())
        hits = [e for e in reached if (j, e) in guessed and (j, e) not in now]
        now.update((j, e) for e in reached)
        self.stats.guess_hits += len(hits)
        self.stats.hit_bytes += len(hits) * ex.row * self.dtype.itemsize
        self.stats.reached += len(hits)
        if self.cache is not None:
            for e in hits:
                self.cache.reached((ex.unit, j, e))

    def _load(self, ex: Experts, j: int, miss: list[int]) -> None:
        """Experts ``miss`` of ``ex`` into the slot: from the cache where kept, else read."""
        reads, pending = [], []
        for e in miss:
            key = (ex.unit, j, e)
            if self.cache is not None:
                self.cache.reached(key)
                row = self.cache.get(key)
                if row is not None:
                    pending += self._put(ex, e, row.view(self.dtype))
                    self.stats.cached_bytes += ex.row * self.dtype.itemsize
                    continue
            reads.append(e)
        t0 = time.perf_counter()
        if self._bounce is None:  # device memory is host memory: read straight into the slot
            # one request per run of consecutive experts and parameter: fewer, larger reads
            IOFuture.gather([self._read(ex, a, [r.param.data[a:b] for r in ex.records]) for a, b in _runs(reads)]).get()
            for e in reads:  # sync point above: the rows are in the slot
                self._keep(ex, j, e, None)
        else:
            rows = self._bounce[: BOUNCE_ROWS * ex.row].view(BOUNCE_ROWS, ex.row)
            for i in range(0, len(reads), BOUNCE_ROWS):
                batch = reads[i : i + BOUNCE_ROWS]
                IOFuture.gather([self._read(ex, e, _split(rows[k], ex)) for k, e in enumerate(batch)]).get()
                evs = []
                for k, e in enumerate(batch):
                    self._keep(ex, j, e, rows[k])
                    evs += self._put(ex, e, rows[k])
                for ev in evs:  # sync point: the bounce rows are read into again next
                    self.dev.sync(ev)
        for ev in pending:  # sync point: a cache row may be given to another expert after this
            self.dev.sync(ev)
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.read_bytes += len(reads) * ex.row * self.dtype.itemsize

    def _zero(self, ex: Experts, ids: list[int]) -> None:
        """Experts ``ids``' rows in the slot set to zeros (on the compute stream, before the
        experts' forward: ordered after the unit's upload and the reached experts' rows)."""
        for a, b in _runs(ids):
            for r in ex.records:
                r.param.data[a:b].zero_()

    def _read(self, ex: Experts, e: int, dst: list[torch.Tensor]) -> IOFuture:
        """Read into ``dst`` (one tensor per parameter) the rows of experts ``e``, ``e + 1``, ...
        (as many as ``dst``'s tensors hold)."""
        unit, es = self.layout.units[ex.unit], self.dtype.itemsize
        f = self.tier.file
        return IOFuture.gather(
            [
                f.pread(d, d.numel() * es, (unit.offset + r.offset + e * (r.numel // ex.n)) * es)
                for r, d in zip(ex.records, dst)
            ]
        )

    def _put(self, ex: Experts, e: int, row: torch.Tensor) -> list:
        """Expert ``e``'s ``row`` (host) into its parameters' rows in the slot; the uploads'
        events on a separate device (``row`` must stay as it is until they have run)."""
        evs = []
        for r, src in zip(ex.records, _split(row, ex)):
            dst = r.param.data[e].reshape(-1)
            if self.dev.separate:
                # after what the compute stream has queued: kernels of the unit the slot held before
                ev = self.dev.upload(dst, src, after=self.dev.event())
                self.dev.wait(ev)  # the compute stream uses the row next
                evs.append(ev)
            else:
                dst.copy_(src)
        return evs

    def _keep(self, ex: Experts, j: int, e: int, row: torch.Tensor | None) -> None:
        """Expert ``e`` (just read: in ``row``, else in the slot) into the cache, if it admits it."""
        if self.cache is None:
            return
        dst = self.cache.admit((ex.unit, j, e))
        if dst is None:
            return
        dst = dst.view(self.dtype)
        if row is not None:
            dst[: ex.row].copy_(row)
        else:
            for r, d in zip(ex.records, _split(dst, ex)):
                d.copy_(r.param.data[e].reshape(-1))


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of consecutive ids in sorted ``ids``."""
    out: list[tuple[int, int]] = []
    for e in ids:
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``[a, b)`` ranges, touching ones joined (fewer, larger reads and uploads)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _split(row: torch.Tensor, ex: Experts) -> list[torch.Tensor]:
    """``row`` (one expert's elements, its parameters in turn) cut into each parameter's part."""
    out, pos = [], 0
    for r in ex.records:
        n = r.numel // ex.n
        out.append(row[pos : pos + n])
        pos += n
    return out


def _complement(numel: int, experts: list[Experts]) -> list[tuple[int, int]]:
    """Element ranges of a unit of ``numel`` outside its experts' parameters."""
    cut = sorted((r.offset, r.offset + r.numel) for ex in experts for r in ex.records)
    out, pos = [], 0
    for a, b in cut:
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < numel:
        out.append((pos, numel))
    return out


def weights_read(store, source: ParamSource) -> tuple[int, str]:
    """The weights' bytes a forward-only run has read, and its experts' line ('' for a run
    without routed reads): the parameter store's unit loads, or, with routed reads, what the
    storage tier counted on the converted copy since the passes began (units without their
    experts, the experts reached; not the units read once into host memory before)."""
    if not isinstance(source, RoutedReads):
        return store.stats.fetch_bytes, ""
    return source.tier.file.workers.stats.snapshot().read_bytes - source.base_bytes, source.stats.line()
