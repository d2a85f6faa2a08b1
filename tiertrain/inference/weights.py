"""A forward-only model's weights as a file of the storage tier, made once and kept.

``io.weights = "tier"`` (for ``tiertrain eval`` and ``generate``): the model's weights, from
wherever they come (a Hugging Face directory, an export, a checkpoint), are written unit by
unit (one unit of memory, a progress bar) into ``weights-<lineage>-<key>.bin`` on the first
``io.paths`` entry, in the runtime's flat layout and compute dtype, checksummed; every later
run with the same key reads it instead of converting again. The key hashes what the weights
depend on: the model config, the dtype, the units' sizes and the source files' paths, sizes,
modification times and inode change times (a file copied in with its old time, ``cp -p``,
``rsync -a`` or an archive's, has a new change time: no user sets that; a chmod changes it too,
and the copy is made again), and a
checkpoint's weights file's CRC32C (a changed source, or a run
trained again into the same directory, makes a new file, and the copy of the same source's
earlier content is removed then; copies of other settings or sources are the user's to delete).
The file is complete or absent: it is written under a temporary name and renamed when done; a
copy found short or with its checksums missing or damaged is made again, and damage found
while reading it names the copy and the fix (``copy_hint``). Units are read with O_DIRECT straight into the parameter store's slots.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import glob
import hashlib
import json
import logging
import os
import socket
import time
import zlib

import torch

from ..io import FileHandle, IOFuture, aligned_empty, round_up
from ..models import WeightSource
from ..paths import check_writable_dir, pid_alive
from ..state.layout import FlatLayout
from ..state.quant import DequantSource
from ..state.sources import ParamSource
from .budget import refuse_small_budget, resident_budget

__all__ = [
    "WeightParams",
    "CheckpointWeights",
    "ResidentWeights",
    "TierWeights",
    "forward_params",
    "weights_key",
    "copy_hint",
]

log = logging.getLogger("tiertrain")

ROUTED_BLOCK = 64 << 10  # checksum block of a converted copy whose experts are read as routed


def weights_key(
    model_cfg: dict, dtype: torch.dtype, layout: FlatLayout, files: list[str], describe: str, identity: str = ""
) -> tuple[str, str]:
    """(key, lineage): what the converted weights depend on, hashed (see the module docstring);
    the lineage leaves the files' sizes and times and ``identity`` (their contents) out: a copy
    of the same lineage under another key is of an earlier content of the same files."""
    st = {f: os.stat(f) for f in files}
    stats = [(os.path.abspath(f), st[f].st_size, st[f].st_mtime_ns, st[f].st_ctime_ns) for f in sorted(files)]
    same = [model_cfg, str(dtype), [u.numel for u in layout.units], [s[0] for s in stats], describe]
    key, lineage = (json.dumps(b, sort_keys=True, default=str) for b in ([*same, stats, identity], same))
    return hashlib.sha256(key.encode()).hexdigest()[:16], hashlib.sha256(lineage.encode()).hexdigest()[:16]


def forward_params(
    cfg, rt, progress: bool = True, *, other_bytes: int = 0, host: tuple[int, str] | None = None
) -> ParamSource:
    """The parameter source of a forward-only run of ``rt`` (``io.weights``): the model's own
    files, or their converted copy on the storage tier, with as many units kept in host memory
    as ``resident_budget`` allows (``other_bytes``: the run's other fixed host memory, e.g. the
    key/value cache; ``host``: the run's ``host_budget``, taken once). Closed with ``close()``."""
    from .routed import find_experts

    refuse_small_budget(cfg, rt)  # before any weight is read or converted
    experts = find_experts(rt.model, rt.layout)  # a mixture of experts' experts modules (none: dense)
    quant = _quant_layout(cfg, rt)
    if quant is not None and experts:
        log.info("experts read whole, not as routed: a 4-bit base's units are not laid out by parameter")
        experts = []
    inner = _stored(cfg, rt, quant, experts, progress)
    budget, why = resident_budget(cfg, rt, other_bytes, host)
    try:
        if budget < min(u.numel for u in rt.layout.units) * rt.dtype.itemsize:
            log.info("weights in host memory: none (%s); every unit read at every pass", why)
        else:
            inner = ResidentWeights(inner, rt.layout, budget, pin=rt.dev.pin, why=why, progress=progress)
        return _routed(cfg, rt, inner, experts, max(0, budget - inner.host_bytes))
    except BaseException:
        inner.close()
        raise


def _stored(cfg, rt, quant, experts: list, progress: bool) -> ParamSource:
    """Where the units come from: the model's own files (``io.weights = source``) or their
    converted copy on the tier; a 4-bit base (``quant``) read in its 4 bits where it can be (a
    checkpoint's records as stored, or a copy made in 4 bits) and dequantized in the slots."""
    source = _rounded(cfg, rt, rt.weights)
    records = source.records
    if quant is not None and records is not None and _same_layout(records.quant, quant):
        log.info("weights: the checkpoint's 4-bit base read as it is stored (%s)", quant.spec.describe())
        return DequantSource(records, records.quant, rt.dtype)
    if cfg.io.weights == "source":
        # a float base quantized and dequantized as training does it (a checkpoint's is already)
        made = quant.through(source) if quant is not None and not source.dequantized else source
        return WeightParams(rt.layout, made, rt.dtype)
    if source.dequantized:  # a checkpoint's base in another layout: converted as its values
        quant = None
    # a routed read takes one expert's rows: its checksum blocks (whole ones are read to be
    # checked) small beside them, so that the bytes read are the bytes asked for; by the model
    # alone, so that io.routed_experts either way reads the same copy
    block = min(rt.align, ROUTED_BLOCK) if experts else rt.align
    # (without how units are cut: the layout's sizes are in the key; eval leaves vocab_pieces to the
    # planner, generate sets 1, and each made its own copy of the same weights)
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in ("vocab_pieces", "layer_pieces")}
    key, lineage = weights_key(
        model,
        rt.dtype,
        rt.layout,
        [*source_files(cfg.model), *source.files],
        source.describe
        + (f", checksum blocks of {block} bytes" if block != rt.align else "")
        + (f", in {quant.spec.describe()}" if quant is not None else ""),
        source.identity,
    )
    tier = TierWeights(
        rt.layout, source, rt.dtype, path=cfg.io.paths[0], key=key, checksum=cfg.io.checksum, block=block,
        progress=progress, quant=quant, lineage=lineage,
    )  # fmt: skip
    return tier if quant is None else DequantSource(tier, quant, rt.dtype, owns=True)


def _rounded(cfg, rt, source):
    """``source`` with each unit's weights rounded to a narrower float base's dtype and back
    (``model.base_dtype = 'bfloat16'`` under float32 compute), as the adapter run trained on
    them: it keeps its base in that dtype (a checkpoint's already is: rounding it again changes
    nothing). Unchanged where the base is the compute dtype or quantized."""

    base = rt.base_dtype
    if not cfg.adapter.on or base == rt.dtype or not base.is_floating_point or source.dequantized:
        return source

    def load(u: int, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: t.to(base).to(rt.dtype) if t.is_floating_point() else t for n, t in source.load(u, names).items()}

    return dataclasses.replace(source, describe=f"{source.describe}, rounded to {base} as the base", load=load)


def _quant_layout(cfg, rt):
    """The 4-bit base's ``QuantLayout`` of an adapter run that keeps one, else None."""
    from ..state.quant import base_storage

    if not cfg.adapter.on:
        return None
    stored, dtype = base_storage(cfg, rt.layout, rt.dtype, rt.align)
    return stored if dtype == torch.uint8 else None


def _same_layout(a, b) -> bool:
    """Two 4-bit layouts whose records and dequantized units are interchangeable."""
    return (
        a.spec == b.spec
        and a.dtype == b.dtype
        and [u.numel for u in a.units] == [u.numel for u in b.units]
        and [u.numel for u in a.flat.units] == [u.numel for u in b.flat.units]
    )


def _routed(cfg, rt, inner: ParamSource, found: list, left: int) -> ParamSource:
    """``inner`` with the experts modules ``found`` (those of units not kept whole in host
    memory) read as the routing reaches them (``routed.RoutedReads``: from the converted copy
    only), an expert cache of ``memory.expert_cache_mib`` (default: ``left``, what the
    weights' host budget leaves)."""
    from .routed import ExpertCache, RoutedReads

    experts = [ex for ex in found if not inner.on_host(ex.unit)]
    if not experts or not cfg.io.routed_experts:
        return inner
    if cfg.io.weights != "tier":
        log.info(
            "experts: read whole with their blocks (io.weights = %r); --io.weights=tier reads only the experts "
            "the tokens reach",
            cfg.io.weights,
        )
        return inner
    tier = inner.inner if isinstance(inner, ResidentWeights) else inner
    row = max(ex.row for ex in experts) * rt.dtype.itemsize
    total = sum(ex.n for ex in experts)
    mib = cfg.memory.expert_cache_mib
    rows = min(total, ((mib << 20) if mib is not None else left) // row)
    cache = ExpertCache(rows, row, pin=rt.dev.pin) if rows else None
    log.info(
        "experts: %d experts modules in %d units read as the routing reaches them; expert cache: %d of %d experts "
        "(%.1f MiB, %s)",
        len(experts),
        len({ex.unit for ex in experts}),
        rows,
        total,
        rows * row / 2**20,
        f"memory.expert_cache_mib = {mib}" if mib is not None else "what the weights' host budget leaves",
    )
    return RoutedReads(inner, tier, experts, rt.dev, cache, guess=cfg.io.guess_experts)


class ResidentWeights(ParamSource):
    """The first units (in pass order) that fit in ``budget`` bytes read once, at start, into
    host memory and used in place from then on (uploaded from there on CUDA: pinned); the
    others read from ``inner`` at every pass. Every unit is read as often in a pass, so any
    byte kept saves the same: the order is the schedule's, the cut is the budget's."""

    file_backed = True

    def __init__(
        self, inner: ParamSource, layout: FlatLayout, budget: int, *, pin: bool, why: str, progress: bool = True
    ) -> None:
        from tqdm import tqdm

        self.inner, self.layout, self.dtype = inner, layout, inner.dtype
        self.resident: dict[int, torch.Tensor] = {}
        used, e = 0, self.dtype.itemsize
        for unit in layout.units:
            if used + unit.numel * e > budget:
                break
            # whole pages: a direct read of the unit's last block lands inside the buffer
            self.resident[unit.index] = aligned_empty(round_up(unit.numel * e), pin=pin).view(self.dtype)
            used += unit.numel * e
        self._bytes = used
        total = layout.total_numel * e
        log.info(
            "weights in host memory: %d of %d units (%.3f of %.3f GB), read once (%s); the rest read at every pass",
            len(self.resident),
            len(layout.units),
            used / 1e9,
            total / 1e9,
            why,
        )
        for u, buf in tqdm(
            self.resident.items(),
            desc="load resident weights",
            unit="unit",
            disable=True if not progress or len(self.resident) < 2 else None,  # None: where stderr is a terminal
        ):
            inner.load(u, buf).get()  # sync point: before the first pass

    @property
    def host_bytes(self) -> int:
        return self._bytes

    def on_host(self, u: int) -> bool:
        return u in self.resident

    def host_view(self, u: int) -> torch.Tensor:
        return self.resident[u][: self.layout.units[u].numel]

    def loaded_bytes(self, u: int, numel: int, itemsize: int) -> int:
        return self.inner.loaded_bytes(u, numel, itemsize)  # a quantized base's records

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        return self.inner.load(u, out, slot)

    # the units not kept are the inner source's to finish (a 4-bit base dequantized on the device)
    def attach(self, dev) -> None:
        self.inner.attach(dev)

    def filled(self, u: int) -> list[tuple[int, int]] | None:
        return None if u in self.resident else self.inner.filled(u)

    def finish_on_device(self, u: int, flat: torch.Tensor) -> None:
        if u not in self.resident:
            self.inner.finish_on_device(u, flat)

    def close(self) -> None:
        self.resident.clear()
        self.inner.close()


def source_files(model_cfg) -> list[str]:
    """The files a model's weights are read from (none for a random init)."""
    out = []
    for d in (model_cfg.hf_dir, model_cfg.init_from):
        if d and os.path.isdir(d):
            out += glob.glob(os.path.join(glob.escape(d), "*.safetensors"))
        elif d:
            out.append(d)
    return out


class TierWeights(ParamSource):
    """Units read from the converted file (made first if absent). A context manager."""

    file_backed = True

    def __init__(
        self,
        layout: FlatLayout,
        source: WeightSource,
        dtype: torch.dtype,
        *,
        path: str,
        key: str,
        checksum: bool,
        block: int,
        progress: bool = True,
        quant=None,
        lineage: str = "",
    ) -> None:
        """``quant``: a ``QuantLayout``: the copy holds each unit quantized (its records are
        read with ``read``, through a ``DequantSource``), not in ``dtype``. ``lineage``
        (``weights_key``'s) leads the file's name: copies of it under another key are removed
        once this one is made."""
        self.layout, self.dtype, self.quant = layout, dtype, quant
        self.path = os.path.join(path, f"weights-{lineage + '-' if lineage else ''}{key}.bin")
        size = layout.total_numel * dtype.itemsize if quant is None else quant.total_numel
        _remove_dead_partials(path)
        damage = _damaged_copy(self.path, size, checksum, block) if os.path.exists(self.path) else None
        if damage:  # the copy is ours, made from the source: made again, not a dead end
            log.warning("weights: the converted copy %s is damaged (%s): converted again", self.path, damage)
            _remove_copy(self.path)
        if not os.path.exists(self.path):
            self._convert(source, size, checksum, block, progress)
            for old in glob.glob(os.path.join(glob.escape(path), f"weights-{lineage}-*.bin")) if lineage else []:
                if old != self.path:  # an earlier content of the same source: never read again
                    _remove_copy(old)
                    log.info("weights: %s removed (a copy of an earlier content of the same source)", old)
        else:
            log.info("weights: %s (converted before)", self.path)
        self.file = FileHandle(self.path, "r", checksum=checksum, checksum_block=block)

    def _convert(self, source: WeightSource, size: int, checksum: bool, block: int, progress: bool) -> None:
        from tqdm import tqdm

        check_writable_dir("io.paths", os.path.dirname(self.path))  # (a file there was a FileExistsError)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp-{_HOST}-{os.getpid()}"  # (its host's mark: a dead pid of this host's is dead)
        log.info("weights: converting %s into %s (%.2f GB, once)", source.describe, self.path, size / 1e9)
        buf = aligned_empty(self.layout.max_unit_numel * self.dtype.itemsize).view(self.dtype)
        try:
            with FileHandle(tmp, "w", size=size, checksum=checksum, checksum_block=block) as f:
                for unit in tqdm(
                    self.layout.units, desc="convert weights", disable=None if progress else True, unit="unit"
                ):
                    view = buf[: unit.numel]
                    view.zero_()
                    values = source.load(unit.index, [r.name for r in unit.params])
                    for r in unit.params:
                        view[r.offset : r.offset + r.numel].copy_(values[r.name].reshape(-1))
                    if self.quant is not None:  # stored in 4 bits, quantized as a training run does
                        q = self.quant.units[unit.index]
                        f.write(self.quant.quantize(unit.index, view), q.numel, q.offset)
                    else:
                        f.write(view, unit.numel * self.dtype.itemsize, unit.offset * self.dtype.itemsize)
                f.flush()
            for suffix in (".crc", ""):  # the file itself last: its presence says it is complete
                if os.path.exists(tmp + suffix):
                    os.replace(tmp + suffix, self.path + suffix)
        except BaseException:
            for suffix in ("", ".crc"):
                if os.path.exists(tmp + suffix):
                    os.remove(tmp + suffix)
            raise

    def on_host(self, u: int) -> bool:
        return False

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("weights read from the tier are never used in place")

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        unit, e = self.layout.units[u], self.dtype.itemsize
        return self.file.pread(out[: unit.numel], unit.numel * e, unit.offset * e)

    def read(self, u: int, buf: torch.Tensor) -> IOFuture:
        """Unit ``u``'s 4-bit record into ``buf`` (bytes; a copy made with ``quant``)."""
        q = self.quant.units[u]
        return self.file.pread(buf, q.numel, q.offset)

    def close(self) -> None:
        self.file.close()


def _host_mark() -> str:
    """This host (and container: its pid namespace) as 4 hex digits, in a partial copy's name."""
    ns = "/proc/self/ns/pid"
    where = f"{socket.gethostname()}:{os.stat(ns).st_ino if os.path.exists(ns) else 0}"
    return f"h{zlib.crc32(where.encode()) & 0xFFFF:04x}"


_HOST = _host_mark()


def _remove_dead_partials(path: str) -> None:
    """The partial copies (``weights-*.bin.tmp-PID``, and their checksums) that conversions
    killed in directory ``path`` left, removed and said (each the copy's size); a live
    process's, being made now, left, and any written to in the last 10 minutes."""
    for tmp in glob.glob(os.path.join(glob.escape(path), "weights-*.bin.tmp-*")):
        pid = tmp.rsplit("-", 1)[-1].removesuffix(".crc")
        ours = tmp.removesuffix(".crc").endswith(f".tmp-{_HOST}-{pid}")  # made on this host: its pid is a pid here
        try:  # (a process of another container or host sharing the directory is no pid here: its
            # conversion writes all along, so a partial written to in the last 10 minutes is left)
            fresh = time.time() - os.path.getmtime(tmp) < 600
        except FileNotFoundError:
            continue
        if not pid.isdigit() or pid_alive(int(pid), tmp if ours else None) or (fresh and not ours):
            continue
        size = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if not tmp.endswith(".crc"):
            log.info("weights: removed %s, a partial copy a killed conversion left (%.1f MiB)", tmp, size / 2**20)


def _remove_copy(path: str) -> None:
    """A converted copy and its checksums, gone."""
    for suffix in (".crc", ""):  # the file itself last: its presence says it is complete
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


def _damaged_copy(path: str, size: int, checksum: bool, block: int) -> str:
    """Why the converted copy ``path`` cannot be read whole ('' where it can, as far as its size
    and its checksum file tell without reading it: a flipped byte is found when read)."""
    from ..io.checksum import ChecksumTable, sidecar_path
    from ..io.errors import StorageError

    if os.path.getsize(path) < size:
        return f"{os.path.getsize(path)} bytes, not {size}"
    if checksum:
        try:
            table = ChecksumTable.load(sidecar_path(path))
        except StorageError as exc:
            return str(exc.strerror)
        if (table.size, table.block) != (size, block):
            return f"its checksums are of {table.size} bytes in blocks of {table.block}, not {size} in {block}"
    return ""


def copy_hint(path: str | None) -> str:
    """What to do about an error in file ``path`` where it is a converted copy of weights
    (``weights-<lineage>-<key>.bin`` or its checksums; '' for any other file): damage found while reading
    it (a flipped byte) is named by the storage tier, which knows nothing of where it came from."""
    name = os.path.basename(path or "")
    if not (name.startswith("weights-") and name.endswith((".bin", ".bin.crc"))):
        return ""
    return (
        "it is tiertrain's converted copy of the weights (io.weights = 'tier'): delete it and run again to convert anew"
    )


class WeightParams(ParamSource):
    """A forward-only model's parameters, read unit by unit from its ``WeightSource`` on one
    reader thread (loads overlap the compute of the unit before), converted to ``dtype``."""

    file_backed = True  # never host-resident: every unit is loaded into a slot

    def __init__(self, layout: FlatLayout, source: WeightSource, dtype: torch.dtype) -> None:
        self.layout, self.source, self.dtype = layout, source, dtype
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="tiertrain-weights")

    def on_host(self, u: int) -> bool:
        return False

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("forward-only weights are never used in place")

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        return IOFuture([self._pool.submit(self._fill, u, out)])

    def _fill(self, u: int, out: torch.Tensor) -> int:
        unit = self.layout.units[u]
        unit.fill(self.source.load(u, [r.name for r in unit.params]), out)
        return unit.numel * out.element_size()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CheckpointWeights:
    """A tiertrain checkpoint's weights (the weights state its run declared: fp32 master
    weights where kept), read unit by unit from its file. The whole file's CRC32C is checked
    against the manifest first, in one streaming pass of one unit's memory. ``config``: the
    checkpoint's config (a dict: the model to build, flags go on top); ``source``: the
    ``WeightSource`` to evaluate with. A context manager."""

    def __init__(self, path: str, hf_dir: str | None = None) -> None:
        """``hf_dir``: the model directory its run read, where it has moved (``moved_model_dir``)."""
        from ..checkpoint import Manifest, find_checkpoint
        from ..checkpoint.export import relocate_model_dir, weights_file
        from ..io import FileHandle

        self.path = find_checkpoint(path, "eval --checkpoint")
        man = Manifest.read(self.path)
        if hf_dir is not None:
            relocate_model_dir(man.config, hf_dir)
        w = weights_file(self.path, man)
        file, self.dtype, entry = w.path, w.weights_dtype, w.entry
        self.config, self.layout, self._w = man.config, w.layout, w
        self.quant = w.quant
        self.source = WeightSource(
            describe=f"checkpoint {self.path} (step {man.step})",
            load=self.load,
            adapters=_adapters_of(self.path, man),
            dequantized=w.quant is not None,
            records=self if w.quant is not None else None,
            files=(os.path.abspath(file),),
            identity=f"crc32c {entry.crc32c:08x}",
        )
        self._raw = torch.empty(w.max_unit_bytes, dtype=torch.uint8)
        self._buf = torch.empty(self.layout.max_unit_numel, dtype=self.dtype) if w.quant is not None else None
        self._file = FileHandle(file, "r")
        try:
            self._verify(entry)
        except BaseException:
            self.close()
            raise

    def _read_raw(self, u: int) -> torch.Tensor:
        offset, length = self._w.unit_bytes(u)
        raw = self._raw[:length]
        self._file.read(raw, length, offset)
        return raw

    def _read(self, u: int) -> torch.Tensor:
        """Unit ``u``'s flat weights (a 4-bit base's dequantized: what its training computed with)."""
        return self._w.unit(self._read_raw(u), u, self._buf)

    def _verify(self, entry) -> None:
        from ..checkpoint import CheckpointError
        from ..io.checksum import crc32c

        crc = 0
        for u in range(len(self.layout.units)):  # as export chains it: unit by unit, in order
            crc = crc32c(self._read_raw(u).numpy(), crc)
        if crc != entry.crc32c:
            raise CheckpointError(
                f"checkpoint {self.path}: its weights are corrupt (crc32c {crc:#010x}, the manifest "
                f"says {entry.crc32c:#010x}); use an earlier checkpoint"
            )

    # a 4-bit base's records as stored (``DequantSource`` reads them: ``WeightSource.records``)
    def read(self, u: int, buf: torch.Tensor) -> IOFuture:
        """Unit ``u``'s 4-bit record into ``buf`` (bytes), as stored in the checkpoint."""
        offset, length = self._w.unit_bytes(u)
        return self._file.pread(buf, length, offset)

    def on_host(self, u: int) -> bool:
        return False

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("a checkpoint's records are read, never used in place")

    def load(self, u: int, names: list[str]) -> dict[str, torch.Tensor]:
        recs = self.layout.units[u].params if u < len(self.layout.units) else []
        if [r.name for r in recs] != list(names):  # the model runs cut otherwise (generation: its vocabulary whole)
            return self._load_whole(names)
        view = self._read(u)  # one reader thread (WeightParams): the buffer is reused unit after unit
        return {r.name: view[r.offset : r.offset + r.numel].view(r.shape) for r in recs}

    def _load_whole(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors ``names`` where the checkpoint's units are cut otherwise than the model asking
        (a run trained with its vocabulary in pieces, generated from whole: a KeyError): each
        piece's rows copied into its whole matrix."""
        from ..checkpoint import CheckpointError

        want, out, pieces = set(names), {}, self._w.model.row_pieces
        for unit in self.layout.units:
            hits = [r for r in unit.params if r.name in want or (r.name in pieces and pieces[r.name].whole in want)]
            if not hits:
                continue
            view = self._read(unit.index)
            for r in hits:
                t = view[r.offset : r.offset + r.numel].view(r.shape)
                rp = pieces.get(r.name)
                if rp is None:
                    out[r.name] = t.clone()
                else:
                    out.setdefault(rp.whole, torch.empty(rp.whole_shape, dtype=t.dtype))[rp.start : rp.stop].copy_(t)
        if want - out.keys():
            raise CheckpointError(f"checkpoint {self.path} holds no weights for {sorted(want - out.keys())[:3]}")
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "CheckpointWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _adapters_of(path: str, man) -> dict[str, torch.Tensor] | None:
    """The trained adapters of a checkpoint of an adapter run (checked), else None."""
    from ..adapters import ADAPTER_FILE
    from ..checkpoint import read_tensors

    entry = man.entry(ADAPTER_FILE)
    return None if entry is None else read_tensors(path, ADAPTER_FILE, entry)[0]
