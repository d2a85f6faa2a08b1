"""``tiertrain bench io``: sequential write and read bandwidth of the storage tier,
against fio at the same block size and depth, measured in the same run.

Both tools overwrite and read back a file that was laid out (allocated and written)
first: that is the steady state of training, where state files are rewritten every step.
Runs alternate (tiertrain, fio, tiertrain, fio, ...) so drift in the disk's speed hits
both; medians are reported.

A mixed pass reads 4/7 of the file and rewrites the other 3/7 at once (the AdamW update's
ratio: gradients, parameters and two moments read, three written back) and reports its time
over the time the same bytes take one after the other at that repeat's rates: about 1 means
the disk does not overlap reads with writes, and the cost model's sum of the two is right.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

from ..errors import UsageError
from ..io import Storage, aligned_empty
from ..paths import check_writable_dir, prepare_output_file

__all__ = ["IOBenchResult", "bench_io_command", "run_io_bench", "format_io_bench", "run_sweep"]

log = logging.getLogger("tiertrain")


@dataclass
class IOBenchResult:
    paths: list[str]
    size_bytes: int
    threads: int
    chunk_bytes: int
    repeats: int
    ours: dict[str, list[float]] = field(
        default_factory=lambda: {"write": [], "read": [], "read_crc": [], "mixed": [], "mixed_vs_serial": []}
    )
    fio: dict[str, list[float]] = field(default_factory=lambda: {"write": [], "read": []})
    fio_version: str | None = None
    fio_note: str = "not installed (apt-get install fio)"
    dropped_cache: bool = False

    def median(self, who: str, kind: str) -> float | None:
        vals = (self.ours if who == "ours" else self.fio).get(kind) or []
        return statistics.median(vals) if vals else None


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache, when this process is allowed to."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _ours(st: Storage, name: str, buf: torch.Tensor, size: int, kind: str) -> float:
    """GB/s of one sequential pass over ``name``, the buffer reused at successive offsets."""
    with st.open(name, "r" if kind == "read" else "r+") as f:
        t0 = time.perf_counter()
        futs = []
        for off in range(0, size, buf.numel()):
            n = min(buf.numel(), size - off)
            futs.append(f.pread(buf, n, off) if kind == "read" else f.pwrite(buf, n, off))
        done = sum(x.get() for x in futs)
        dt = time.perf_counter() - t0
    assert done == size, f"moved {done} of {size} bytes"
    return size / dt / 1e9


MIXED_READ = 4 / 7  # the update's share of reads: g, p, m, v in; p, m, v out


def _ours_mixed(
    st: Storage, name: str, buf: torch.Tensor, size: int, read_gbps: float, write_gbps: float
) -> tuple[float, float]:
    """(combined GB/s, time over the serial time) of reading the file's first 4/7 while
    rewriting the rest, every request queued at once, alternating as the update issues them."""
    step = buf.numel()
    split = (int(size * MIXED_READ) // step) * step
    reads = list(range(0, split, step))
    writes = list(range(split, size, step))
    out = aligned_empty(step)
    with st.open(name, "r+") as f:
        t0 = time.perf_counter()
        futs = []
        for i in range(max(len(reads), len(writes))):
            if i < len(reads):
                futs.append(f.pread(out, min(step, split - reads[i]), reads[i]))
            if i < len(writes):
                futs.append(f.pwrite(buf, min(step, size - writes[i]), writes[i]))
        done = sum(x.get() for x in futs)
        dt = time.perf_counter() - t0
    assert done == size, f"moved {done} of {size} bytes"
    serial = split / (read_gbps * 1e9) + (size - split) / (write_gbps * 1e9)
    return size / dt / 1e9, dt / serial


FIO_ENGINES = ("libaio", "io_uring")


def _fio(paths: list[str], name: str, size: int, threads: int, chunk: int, kind: str) -> float:
    """GB/s of fio on the same files, O_DIRECT, one job per path, ``threads`` requests in
    flight of ``chunk`` bytes: the better of its libaio and io_uring engines."""
    return max(_fio_engine(e, paths, name, size, threads, chunk, kind) for e in FIO_ENGINES)


def _fio_engine(engine: str, paths: list[str], name: str, size: int, threads: int, chunk: int, kind: str) -> float:
    if kind == "read":
        drop_page_cache()
    args = ["fio", "--output-format=json", "--group_reporting", "--direct=1", f"--ioengine={engine}"]
    args += [f"--bs={chunk}", f"--iodepth={threads}", f"--rw={'read' if kind == 'read' else 'write'}"]
    args += ["--fallocate=none", "--overwrite=1" if kind == "write" else "--overwrite=0"]
    per_path = size // len(paths)
    for p in paths:
        args += [f"--name=job-{os.path.basename(p)}", f"--filename={os.path.join(p, name)}", f"--size={per_path}"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    job = json.loads(out)["jobs"][0]
    return job["read" if kind == "read" else "write"]["bw_bytes"] / 1e9


def bench_io_command(args) -> int:
    """``tiertrain bench io``: the paths and ``--out`` checked before any work (``--path
    /proc/x`` was a FileNotFoundError traceback), then the benchmark, its report printed."""
    import math

    if not (math.isfinite(args.size_gib) and args.size_gib > 0):
        raise UsageError(f"bench io --size-gib {args.size_gib}: give a positive size in GiB, e.g. 4")
    for flag, value in (("--threads", args.threads), ("--chunk-mib", args.chunk_mib), ("--repeats", args.repeats)):
        if value < 1:
            raise UsageError(f"bench io {flag} {value}: give at least 1")
    if len({os.path.realpath(p) for p in args.path}) != len(args.path):
        raise UsageError(f"bench io --path {' '.join(args.path)}: give each directory once (each is measured apart)")
    for p in args.path:
        check_writable_dir("bench io --path", p, UsageError)
    out = prepare_output_file("bench io --out", args.out) if args.out else None
    res = run_io_bench(
        args.path,
        size_bytes=int(args.size_gib * 2**30),
        threads=args.threads,
        chunk_bytes=args.chunk_mib << 20,
        repeats=args.repeats,
        use_fio=not args.no_fio,
    )
    report = format_io_bench(res)
    if args.sweep:
        report += "\n" + run_sweep(args.path, size_bytes=min(res.size_bytes, 1 << 30))
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)
        log.info("wrote %s", out)
    return 0


def run_io_bench(
    paths: list[str],
    *,
    size_bytes: int = 2 << 30,
    threads: int = 8,
    chunk_bytes: int = 16 << 20,
    repeats: int = 3,
    use_fio: bool = True,
    progress: bool = True,
) -> IOBenchResult:
    from tqdm import tqdm

    res = IOBenchResult(list(paths), size_bytes, threads, chunk_bytes, repeats)
    fio_ok = use_fio and shutil.which("fio") is not None
    if not use_fio:
        res.fio_note = "skipped (--no-fio)"
    if fio_ok:
        res.fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    name = "tiertrain-bench-io.dat"
    buf = aligned_empty(min(size_bytes, 256 << 20))
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
    st = Storage(paths, threads=threads, chunk_bytes=chunk_bytes, stripe_bytes=chunk_bytes, checksum=False)
    try:
        st.check_space([(name, size_bytes)])
        with st.create(name, size_bytes) as f:  # lay out: allocate and write once
            for off in range(0, size_bytes, buf.numel()):
                f.write(buf, min(buf.numel(), size_bytes - off), off)
        steps = repeats * (5 if fio_ok else 3)
        bar = tqdm(total=steps, desc="bench io", disable=not progress, unit="pass")
        for _ in range(repeats):
            res.ours["write"].append(_ours(st, name, buf, size_bytes, "write"))
            bar.update()
            if fio_ok:
                res.fio["write"].append(_fio(st.paths, name, size_bytes, threads, chunk_bytes, "write"))
                bar.update()
            res.dropped_cache = drop_page_cache()
            res.ours["read"].append(_ours(st, name, buf, size_bytes, "read"))
            bar.update()
            mixed, ratio = _ours_mixed(st, name, buf, size_bytes, res.ours["read"][-1], res.ours["write"][-1])
            res.ours["mixed"].append(mixed)
            res.ours["mixed_vs_serial"].append(ratio)
            bar.update()
            if fio_ok:
                res.fio["read"].append(_fio(st.paths, name, size_bytes, threads, chunk_bytes, "read"))
                bar.update()
        bar.close()
        _rewrite_with_checksums(st, name, buf, size_bytes)
        for _ in range(repeats):  # the same read, verifying a CRC32C per block on the way
            res.ours["read_crc"].append(_ours_crc(st, name, buf, size_bytes))
    finally:
        st.remove(name)
        st.close()
    return res


def _rewrite_with_checksums(st: Storage, name: str, buf: torch.Tensor, size: int) -> None:
    with st.create(name, size, checksum=True) as f:
        for off in range(0, size, buf.numel()):
            f.write(buf, min(buf.numel(), size - off), off)


def _ours_crc(st: Storage, name: str, buf: torch.Tensor, size: int) -> float:
    with st.open(name, "r", checksum=True) as f:
        t0 = time.perf_counter()
        futs = [f.pread(buf, min(buf.numel(), size - off), off) for off in range(0, size, buf.numel())]
        done = sum(x.get() for x in futs)
        dt = time.perf_counter() - t0
    assert done == size
    return size / dt / 1e9


def _machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.node()}: {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def format_io_bench(res: IOBenchResult) -> str:
    """A markdown report: medians, spreads, and the ratio to fio."""
    lines = [
        f"# tiertrain bench io, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"- machine: {_machine()}",
        f"- paths: {', '.join(res.paths)}",
        f"- file: {res.size_bytes / 2**30:.2f} GiB per pass, {res.threads} threads, {res.chunk_bytes >> 20} MiB chunks,"
        f" {res.repeats} alternating repeats; page cache dropped before reads: {res.dropped_cache}",
        f"- fio: {res.fio_version or res.fio_note}"
        + (
            f" (O_DIRECT, bs={res.chunk_bytes >> 20} MiB, iodepth={res.threads}; each run the better of"
            f" {' and '.join(FIO_ENGINES)})"
            if res.fio_version
            else ""
        ),
        "",
        "| direction | tiertrain GB/s (median, runs) | fio GB/s (median, runs) | tiertrain / fio |",
        "|---|---|---|---|",
    ]
    for kind in ("write", "read"):
        ours, fio = res.median("ours", kind), res.median("fio", kind)
        ratio = f"{ours / fio:.2f}" if fio else "n/a"
        lines.append(
            f"| {kind} | {ours:.2f} ({', '.join(f'{v:.2f}' for v in res.ours[kind])}) | "
            + (f"{fio:.2f} ({', '.join(f'{v:.2f}' for v in res.fio[kind])})" if fio else "n/a")
            + f" | {ratio} |"
        )
    crc = res.median("ours", "read_crc")
    if crc:
        lines.append(
            f"| read + crc32c verify | {crc:.2f} ({', '.join(f'{v:.2f}' for v in res.ours['read_crc'])}) | | |"
        )
    mixed = res.median("ours", "mixed")
    if mixed:
        ratio = res.median("ours", "mixed_vs_serial")
        lines += [
            "",
            f"Reads and writes at once ({MIXED_READ * 7:.0f}:{7 - MIXED_READ * 7:.0f}, as the update): "
            f"{mixed:.2f} GB/s combined ({', '.join(f'{v:.2f}' for v in res.ours['mixed'])}); "
            f"{ratio:.2f}x the time of the same reads and writes one after the other "
            f"({', '.join(f'{v:.2f}' for v in res.ours['mixed_vs_serial'])}): "
            + (
                "the disk does not overlap them, as the cost model assumes (it adds read and write times)."
                if ratio > 0.85
                else "the disk overlaps them; the cost model, which adds read and write times, is pessimistic here."
            ),
        ]
    return "\n".join(lines) + "\n"


def run_sweep(
    paths: list[str],
    *,
    size_bytes: int = 1 << 30,
    threads: tuple[int, ...] = (1, 2, 4, 8, 16),
    chunks_mib: tuple[int, ...] = (1, 4, 16, 64),
    progress: bool = True,
) -> str:
    """Write and read GB/s over a grid of thread counts and chunk sizes (no fio)."""
    from tqdm import tqdm

    rows = ["| threads | " + " | ".join(f"{c} MiB write / read" for c in chunks_mib) + " |"]
    rows.append("|---|" + "---|" * len(chunks_mib))
    bar = tqdm(total=len(threads) * len(chunks_mib), desc="sweep", disable=not progress)
    for t in threads:
        cells = []
        for c in chunks_mib:
            r = run_io_bench(
                paths, size_bytes=size_bytes, threads=t, chunk_bytes=c << 20, repeats=1, use_fio=False, progress=False
            )
            cells.append(f"{r.median('ours', 'write'):.2f} / {r.median('ours', 'read'):.2f}")
            bar.update()
        rows.append(f"| {t} | " + " | ".join(cells) + " |")
    bar.close()
    head = f"## Sweep: GB/s, {size_bytes / 2**30:.1f} GiB per pass, one run each (noisy disk)\n\n"
    return head + "\n".join(rows) + "\n"
