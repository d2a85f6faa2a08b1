"""Saving and restoring checkpoints by streaming states through two fixed buffers.

A checkpoint file holds one checkpointed state (as its owner declared it) for every unit, in
layout order at the units' layout offsets (``params.bin``, ``exp_avg.bin``, ``exp_avg_sq.bin``,
``master.bin``, ``residual.bin`` ...), plus ``rng.safetensors`` and the manifest. Saving reads each state from wherever it lives (RAM or the
storage tier) chunk by chunk into one of two aligned buffers while the other is written
out, so its memory does not depend on the model's size. Every byte is covered by the
file's CRC32C, computed on the way and checked on the way back.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
from typing import Callable

import numpy as np
import torch

from .. import faults
from ..io import BufferPool, FileHandle, IOFuture, IOWorkers, OutOfSpaceError, check_space, free_bytes
from ..io.checksum import crc32c
from ..io.errors import StorageError, human_bytes
from ..paths import fsync_path
from ..state.layout import FlatLayout
from ..state.quant import QuantLayout
from ..state.regions import TieredRegions
from ..state.scales import ScaleLayout
from .manifest import (
    MANIFEST,
    CheckpointError,
    CheckpointMismatch,
    FileEntry,
    Manifest,
    latest_checkpoint,
    list_checkpoints,
    step_of,
)

__all__ = ["CheckpointIO", "SaveResult", "write_tensors", "read_tensors"]

log = logging.getLogger("tiertrain")
RNG = "rng.safetensors"  # safetensors: the same state always gives the same bytes


class SaveResult:
    def __init__(self, path: str, nbytes: int, seconds: float) -> None:
        self.path, self.nbytes, self.seconds = path, nbytes, seconds

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class CheckpointIO:
    """Moves state regions (file name -> object with ``read``/``write`` per unit, like
    ``TieredRegions``) to and from checkpoint directories."""

    def __init__(self, layout: FlatLayout, *, chunk_bytes: int = 16 << 20, threads: int = 4) -> None:
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.workers = IOWorkers("checkpoint", threads=threads, chunk_bytes=chunk_bytes)
        self.buffers = BufferPool(2, chunk_bytes, name="checkpoint")

    @property
    def pool_bytes(self) -> int:
        return self.buffers.size_bytes + self.workers.pool_bytes

    def _layout(self, region):
        """The layout ``region`` is written in: a 4-bit base's own (its units are bytes), else
        the checkpoint's."""
        own = getattr(region, "file_layout", None) or getattr(region, "layout", None)  # ranks: the one-rank records'
        return own if isinstance(own, (QuantLayout, ScaleLayout)) else self.layout

    def file_size(self, region: TieredRegions) -> int:
        return self._layout(region).total_numel * region.esize

    # -- streaming ------------------------------------------------------------------------------
    def _chunks(self, region: TieredRegions) -> list[tuple[int, int, int]]:
        step = self.chunk_bytes // region.esize
        units = self._layout(region).units
        return [(u.index, a, min(a + step, u.numel)) for u in units for a in range(0, u.numel, step)]

    def _copy(self, region: TieredRegions, read: Callable, write: Callable) -> int:
        """Chunk by chunk: read into a buffer (the next one is read while this is written);
        return the CRC32C of the bytes in file order."""
        crc, chunks = 0, self._chunks(region)
        bufs = [self.buffers.acquire(), self.buffers.acquire()]
        writes: list[IOFuture | None] = [None, None]
        try:
            pending = read(*chunks[0], bufs[0].tensor.view(region.dtype)) if chunks else None
            for i, (u, a, b) in enumerate(chunks):
                cur = bufs[i % 2].tensor.view(region.dtype)
                pending.get()  # sync point: chunk i is in memory
                if i + 1 < len(chunks):
                    nxt = (i + 1) % 2
                    if writes[nxt] is not None:
                        writes[nxt].get()
                        writes[nxt] = None
                    pending = read(*chunks[i + 1], bufs[nxt].tensor.view(region.dtype))
                faults.point("checkpoint")
                crc = crc32c(cur[: b - a].view(torch.uint8).numpy(), crc)
                writes[i % 2] = write(u, a, b, cur)
            for w in writes:
                if w is not None:
                    w.get()
        finally:
            for buf in bufs:
                buf.release()
        return crc

    # -- save ------------------------------------------------------------------------------------
    def save(
        self,
        regions: dict,
        root: str,
        step: int,
        config: dict,
        *,
        keep: int,
        drop: list[str] = (),
        weights: str = "",
        extra: dict[str, tuple[dict, dict]] | None = None,
        compute_dtype: str = "",
        ranks: int = 1,
        rows: int = 0,
        rows_of: str = "",
    ) -> SaveResult:
        """Write a complete checkpoint of step ``step`` under ``root``; then delete ``drop``
        (checkpoints this one supersedes) and keep the last ``keep``. ``weights``: the region
        that holds the weights (named in the manifest: what export and eval read); ``extra``:
        small files by name, (tensors, metadata) each (the adapters), checked as the rest;
        ``compute_dtype``: recorded where a region holds a 4-bit base (what its weights are made in);
        ``ranks``: the ranks that trained it, ``rows``: the fine-tuning rows read (recorded), ``rows_of`` their content. The caller asks ``space_problem`` first
        (with ranks, before the gathers the others wait in)."""
        t0 = time.perf_counter()
        os.makedirs(root, exist_ok=True)
        final = os.path.join(root, f"step-{step:08d}")
        tmp = os.path.join(root, f".tmp-step-{step:08d}-{os.getpid()}")
        sizes = {name: self.file_size(r) for name, r in regions.items()}
        total = sum(sizes.values()) + small_files_bytes(extra)
        previous = latest_checkpoint(root)
        try:  # (the space its files need: asked first, ``space_problem``; a disk filled meanwhile is caught below)
            os.makedirs(tmp)
            entries = [self._save_region(tmp, name, regions[name], sizes[name]) for name in sizes]
            entries.append(_save_rng(tmp))
            entries += [write_tensors(tmp, name, t, meta) for name, (t, meta) in (extra or {}).items()]
            Manifest(
                step,
                entries,
                config,
                [u.numel for u in self.layout.units],
                str(regions["params.bin"].dtype),
                weights=weights,
                weights_dtype=str(regions[weights].dtype) if weights else "",
                compute_dtype=compute_dtype,
                ranks=ranks,
                rows=rows,
                rows_of=rows_of,
                params=self.layout.fingerprint,
            ).write(tmp)
            fsync_path(tmp)
            _replace_dir(tmp, final)
        except OutOfSpaceError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(_no_space(root, step, total, previous)) from exc
        except OSError as exc:
            placed = not os.path.exists(tmp) and os.path.exists(os.path.join(final, MANIFEST))
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, StorageError) and not placed:  # a state file's read or write: it names its file
                raise
            raise CheckpointError(_write_failed(root, final, step, total, previous, exc, placed)) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        gone = [old for old in drop if os.path.abspath(old) != os.path.abspath(final)]  # step-N: replaced above
        # only steps up to this one count against keep (a later course's step left over must not push it out)
        gone += [old for old in list_checkpoints(root) if step_of(old) <= step][:-keep]
        _remove_dirs(gone)
        return SaveResult(final, total, time.perf_counter() - t0)

    def space_problem(self, regions: dict, root: str, step: int, extra: dict | None = None) -> str:
        """Why the checkpoint of ``step`` would not fit under ``root`` ('' where it would): asked
        by rank 0 before the gathers the other ranks wait in (refused inside ``save``, it left
        them waiting for the timeout, then told "rank 0 died"). ``extra``: ``save``'s."""
        tmp = os.path.join(root, f".tmp-step-{step:08d}-{os.getpid()}")
        sizes = {name: self.file_size(r) for name, r in regions.items()}
        sizes[MANIFEST] = small_files_bytes(extra)  # with the RNG's state, the manifest and the adapters
        try:
            check_space([(os.path.join(tmp, name), n) for name, n in sizes.items()])
        except OutOfSpaceError:
            return _no_space(root, step, sum(sizes.values()), latest_checkpoint(root))
        return ""

    def _save_region(self, directory: str, name: str, region, size: int) -> FileEntry:
        esize, units = region.esize, self._layout(region).units
        with FileHandle(os.path.join(directory, name), "w", size=size, workers=self.workers) as f:
            crc = self._copy(
                region,
                read=lambda u, a, b, buf: region.read(u, buf, a, b),
                write=lambda u, a, b, buf: f.pwrite(buf, (b - a) * esize, (units[u].offset + a) * esize),
            )
            f.flush()
        return FileEntry(name, size, crc)

    # -- restore -----------------------------------------------------------------------------------
    def restore(self, regions: dict, path: str, *, zero_if_absent: set[str] = frozenset()) -> Manifest:
        """Load checkpoint ``path`` into ``regions``, checking every file's size and CRC32C.
        A region named in ``zero_if_absent`` that the checkpoint lacks is zeroed (with a warning)."""
        man = Manifest.read(path)
        units = [u.numel for u in self.layout.units]
        if man.units != units or man.param_dtype != str(regions["params.bin"].dtype):
            raise CheckpointMismatch(
                f"checkpoint {path} was written for another model or precision ({_describe(man.units, man.param_dtype)}) "
                f"than this run ({_describe(units, str(regions['params.bin'].dtype))}); resume with the config it was "
                f"made with: {_made_with(man.config, man.param_dtype)}"
            )
        if man.params and man.params != self.layout.fingerprint:  # (units of the same sizes: padding hid it)
            raise CheckpointMismatch(
                f"checkpoint {path} was written for a model with other parameters ({man.params}) than this "
                f"run's ({self.layout.fingerprint}): another model directory, or a tied head against an untied "
                f"one; resume with the model it was made with: {_made_with(man.config, man.param_dtype)}"
            )
        for name, region in regions.items():
            entry = man.entry(name)
            if entry is None and name in zero_if_absent:
                log.warning("checkpoint %s has no %s: it starts at zero", path, name)
                self._zero_region(region)
                continue
            if entry is None:
                raise CheckpointError(f"checkpoint {path} has no {name}, which this run needs")
            self._restore_region(path, entry, region)
        _restore_rng(path, man.entry(RNG))
        return man

    def _restore_region(self, directory: str, entry: FileEntry, region) -> None:
        path = os.path.join(directory, entry.name)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        actual = os.path.getsize(path)
        if actual != entry.size:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or damaged: {actual} bytes, the manifest says {entry.size}"
            )
        if entry.size != self.file_size(region):  # intact, but made for another layout or state format
            raise CheckpointMismatch(
                f"checkpoint file {path} holds {entry.size} bytes where this run's {entry.name} takes "
                f"{self.file_size(region)}: it was made with another model layout or optimizer (the file is intact, "
                "as the manifest records it); resume with the configuration it was made with"
            )
        esize, units = region.esize, self._layout(region).units
        with FileHandle(path, "r", workers=self.workers) as f:
            crc = self._copy(
                region,
                read=lambda u, a, b, buf: f.pread(buf, (b - a) * esize, (units[u].offset + a) * esize),
                write=lambda u, a, b, buf: region.write(u, buf, a, b),
            )
        if crc != entry.crc32c:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: crc32c {crc:#010x}, the manifest says {entry.crc32c:#010x}; "
                "use an earlier checkpoint"
            )

    def _zero_region(self, region) -> None:
        buf = self.buffers.acquire()
        try:
            zeros = buf.tensor.view(region.dtype)
            zeros.zero_()
            for u, a, b in self._chunks(region):
                region.write(u, zeros, a, b).get()
        finally:
            buf.release()

    def close(self) -> None:
        self.workers.shutdown()


def _made_with(config: dict, param_dtype: str) -> str:
    """The settings that set a checkpoint's units and precision, as it stored them (the
    parameters' dtype as it resolved: 'auto' is the machine's choice)."""
    model = config.get("model") or {}
    # a Hugging Face model's shape is its directory's (n_layers and d_model are the built-in GPT's)
    shape = (("model", "hf_dir"),) if model.get("hf_dir") else (("model", "n_layers"), ("model", "d_model"))
    # (io.checksum's block sets how units are padded: another block is another layout)
    fields = (*shape, ("model", "layer_pieces"), ("model", "vocab_pieces"), ("model", "base_dtype"),
              ("io", "checksum"), ("io", "checksum_block_kib"), ("io", "chunk_kib"))  # fmt: skip
    said = [f"{sec}.{name} = {(config.get(sec) or {}).get(name)!r}" for sec, name in fields]
    said.append(f"train.param_dtype = {param_dtype.removeprefix('torch.')!r} (its parameters' dtype)")
    return ", ".join(said)


def _describe(units: list[int], dtype: str) -> str:
    """A layout in words, detailed enough that two different ones read differently."""
    return (
        f"{len(units)} units of {', '.join(f'{n:,}' for n in units[:3])}{', ...' if len(units) > 3 else ''} elements, "
        f"{sum(units):,} in all, {dtype.removeprefix('torch.')}"
    )


def write_tensors(directory: str, name: str, tensors: dict, metadata: dict | None = None) -> FileEntry:
    """A small safetensors file of the checkpoint (the RNG, the adapters), durable, with its
    manifest entry (size and CRC32C)."""
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(name, len(data), crc32c(np.frombuffer(data, dtype=np.uint8)))


def read_tensors(directory: str, name: str, entry: FileEntry | None, needed: str = "") -> tuple[dict, dict]:
    """``write_tensors``' file, checked against its manifest entry: (tensors, metadata).
    ``needed``: why this run needs it (named in the error where it is absent)."""
    import json
    import struct

    path = os.path.join(directory, name)
    if entry is None or not os.path.exists(path):
        raise CheckpointError(f"checkpoint {directory} has no {name}{needed}")
    data = open(path, "rb").read()
    if len(data) != entry.size or crc32c(np.frombuffer(data, dtype=np.uint8)) != entry.crc32c:
        raise CheckpointError(f"checkpoint file {path} is corrupt (size or crc32c differ from the manifest)")
    from safetensors.torch import load

    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + n]).get("__metadata__", {})
    return load(data), meta


def _save_rng(directory: str) -> FileEntry:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return write_tensors(directory, RNG, state)


def _restore_rng(directory: str, entry: FileEntry | None) -> None:
    state, _ = read_tensors(directory, RNG, entry)
    torch.set_rng_state(state["cpu"])
    cuda = [state[f"cuda{i}"] for i in range(torch.cuda.device_count()) if f"cuda{i}" in state]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


SMALL_FILES = 1 << 20  # a checkpoint's RNG state and manifest (KiB) and their files' blocks, with room


def small_files_bytes(extra: dict | None) -> int:
    """The bytes of a checkpoint beside its state files: ``save``'s ``extra`` (the adapters), the
    RNG's state and the manifest."""
    tensors = [t for ts, _ in (extra or {}).values() for t in ts.values()]
    return SMALL_FILES + sum(t.numel() * t.element_size() for t in tensors)


def _write_failed(
    root: str, final: str, step: int, total: int, previous: str | None, exc: OSError, placed: bool
) -> str:
    """A checkpoint's small file, a sync or a rename failed (``exc``, a plain ``OSError``)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not placed:
        return _no_space(root, step, total, previous)
    what = f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc.strerror or exc)
    if placed:  # renamed into place: only its directory's sync failed
        return (
            f"the checkpoint of step {step} is in place at {final}, but making it durable failed ({what}): a crash "
            "or power loss could still lose it; check the disk"
        )
    return f"writing the checkpoint of step {step} in {root} failed ({what}); " + (
        f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    )


def _no_space(root: str, step: int, total: int, previous: str | None) -> str:
    free = free_bytes(root)
    return (
        f"not enough space for the checkpoint of step {step} in {root}: it needs {human_bytes(total)}, "
        f"{human_bytes(free)} are free ({human_bytes(max(0, total - free))} missing); "
        + (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists")
    )


def _remove_dirs(paths: list[str]) -> None:
    """Remove checkpoints ``paths``: first renamed out of their ``step-N`` names (``.drop-...``,
    durable before any file goes: a crash while deleting gigabytes leaves nothing that looks
    like a checkpoint, say the later course of a run a resume replaced), then deleted
    (``clean_incomplete`` deletes what a crash leaves)."""
    moved = []
    for path in dict.fromkeys(paths):
        dropped = os.path.join(os.path.dirname(path), f".drop-{os.path.basename(path)}-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, dropped)
            moved.append(dropped)
    if moved:
        fsync_path(os.path.dirname(moved[0]))
    for path in moved:
        shutil.rmtree(path, ignore_errors=True)


def _replace_dir(tmp: str, final: str) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older ``final`` only once ``tmp`` is in place:
    set aside as ``final.old-PID`` meanwhile, and put back where the second rename fails or is
    interrupted; after a crash between the two, ``clean_incomplete`` puts it back)."""
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None and not os.path.exists(final):
            os.rename(old, final)
        raise
    fsync_path(os.path.dirname(final))
    if old:
        shutil.rmtree(old, ignore_errors=True)
