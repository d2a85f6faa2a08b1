"""FileHandle: correctness across sizes, offsets, thread counts and chunk sizes."""

import concurrent.futures as cf
import errno
import logging
import os
import threading

import pytest
import torch

from tiertrain.io import ChecksumError, FileHandle, IOWorkers, StorageError, TruncatedFileError, aligned_empty
from tiertrain.io import handle as handle_mod

KIB, MIB = 1 << 10, 1 << 20
SIZES = [1, 4095, 4096, 4097, 3 * MIB + 123]
OFFSETS = [0, 4096, 513]


def rand_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("threads,chunk", [(1, 64 * KIB), (3, 199 * KIB), (8, 16 * MIB)])
def test_roundtrip_sizes_offsets(tmp_path, size, offset, threads, chunk):
    data = rand_bytes(size, seed=size + offset)
    path = tmp_path / "f"
    with FileHandle(path, "w", threads=threads, chunk_bytes=chunk) as f:
        assert f.direct, "O_DIRECT should work on this filesystem"
        assert f.pwrite(data, file_offset=offset).get() == size
    assert os.path.getsize(path) == offset + size  # no alignment padding left behind
    with FileHandle(path, "r", threads=threads, chunk_bytes=chunk) as f:
        out = torch.zeros(size, dtype=torch.uint8)
        assert f.read(out, file_offset=offset) == size
        assert torch.equal(out, data)
        # an unaligned buffer (odd address) and an unaligned read inside the data
        raw = torch.zeros(size + 3, dtype=torch.uint8)
        assert f.read(raw, size, offset, buf_offset=3) == size
        assert torch.equal(raw[3:], data)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_checksummed_roundtrip_and_partial_rewrites(tmp_path, size, offset):
    total = offset + size + 5000
    base = rand_bytes(total, seed=1)
    patch = rand_bytes(size, seed=2)
    kw = dict(checksum=True, checksum_block=64 * KIB, threads=3, chunk_bytes=192 * KIB)
    with FileHandle(tmp_path / "c", "w", size=total, **kw) as f:
        f.write(base)
        f.write(patch, file_offset=offset)  # partial checksum blocks: read-modify-write
    expect = base.clone()
    expect[offset : offset + size] = patch
    with FileHandle(tmp_path / "c", "r", **kw) as f:
        assert f.size == total
        out = torch.zeros(total, dtype=torch.uint8)
        assert f.read(out) == total
        assert torch.equal(out, expect)
        assert f.verify() == total
        part = torch.zeros(size, dtype=torch.uint8)
        f.read(part, file_offset=offset)
        assert torch.equal(part, patch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_tensor_helpers_any_dtype(tmp_path, dtype):
    t = torch.randn(12345).to(dtype)
    with FileHandle(tmp_path / "t", "w") as f:
        f.write(t, file_offset=8192)
        back = torch.empty_like(t)
        f.read(back, file_offset=8192)
    assert torch.equal(back, t)


def test_reads_past_end_are_short_not_errors(tmp_path):
    data = rand_bytes(5000)
    with FileHandle(tmp_path / "s", "w") as f:
        f.write(data)
        buf = torch.zeros(8192, dtype=torch.uint8)
        assert f.read(buf, file_offset=4096) == 5000 - 4096
        assert torch.equal(buf[: 5000 - 4096], data[4096:])
        assert f.read(buf, file_offset=100_000) == 0


def test_concurrent_writers_sharing_blocks_lose_nothing(tmp_path):
    """Many unaligned writes that share 4 KiB blocks, in parallel: read-modify-write must lock."""
    n, piece = 400, 1000  # 1000-byte pieces: most blocks are shared by 5 writers
    data = rand_bytes(n * piece, seed=3)
    with FileHandle(tmp_path / "w", "w", size=n * piece, threads=8, chunk_bytes=64 * KIB) as f:
        futs = [f.pwrite(data[i * piece : (i + 1) * piece], file_offset=i * piece) for i in range(n)]
        assert sum(x.get() for x in futs) == n * piece
        out = torch.zeros(n * piece, dtype=torch.uint8)
        f.read(out)
    assert torch.equal(out, data)


def test_concurrent_readers_and_writers_on_disjoint_ranges(tmp_path):
    size = 8 * MIB
    data = rand_bytes(size, seed=4)
    workers = IOWorkers("test", threads=3, chunk_bytes=256 * KIB)
    with FileHandle(tmp_path / "rw", "w", size=size, workers=workers) as f:
        f.write(data[: size // 2])

        def writer():
            return f.write(data[size // 2 :], file_offset=size // 2)

        def reader():
            out = torch.zeros(size // 2, dtype=torch.uint8)
            f.read(out)
            return torch.equal(out, data[: size // 2])

        with cf.ThreadPoolExecutor(6) as ex:
            results = [ex.submit(reader) for _ in range(4)] + [ex.submit(writer)]
            assert all(r.result() for r in results[:4])
            assert results[4].result() == size // 2
        out = torch.zeros(size, dtype=torch.uint8)
        f.read(out)
        assert torch.equal(out, data)
    workers.shutdown()


def test_byte_counters_are_exact(tmp_path):
    workers = IOWorkers("count", threads=3, chunk_bytes=64 * KIB)
    with FileHandle(tmp_path / "n", "w", workers=workers) as f:
        f.write(rand_bytes(300_001))
        f.write(rand_bytes(17), file_offset=5)
        f.read(torch.zeros(4097, dtype=torch.uint8), file_offset=3)
    s = workers.stats.snapshot()
    assert s.write_bytes == 300_001 + 17
    assert s.read_bytes == 4097
    assert s.write_ops == -(-300_001 // (64 * KIB)) + 1
    assert s.read_busy_s > 0 and s.write_busy_s > 0
    workers.shutdown()


def test_chunks_use_the_thread_pool(tmp_path):
    """A request of several chunks is served by several threads at once."""
    seen, lock = set(), threading.Lock()
    real = os.pwritev

    def spy(fd, bufs, off):
        with lock:
            seen.add(threading.get_ident())
        return real(fd, bufs, off)

    with FileHandle(tmp_path / "p", "w", threads=4, chunk_bytes=64 * KIB) as f:
        orig = handle_mod.os.pwritev
        handle_mod.os.pwritev = spy
        try:
            f.write(aligned_empty(4 * MIB))
        finally:
            handle_mod.os.pwritev = orig
    assert len(seen) > 1


def test_checksum_mismatch_names_file_and_offset(tmp_path):
    path = tmp_path / "bad"
    with FileHandle(path, "w", size=3 * MIB, checksum=True, chunk_bytes=MIB) as f:
        f.write(rand_bytes(3 * MIB))
    with open(path, "r+b") as raw:  # flip one byte in the second 1 MiB block
        raw.seek(MIB + 777)
        b = raw.read(1)
        raw.seek(MIB + 777)
        raw.write(bytes([b[0] ^ 0xFF]))
    with FileHandle(path, "r", checksum=True, chunk_bytes=MIB) as f:
        with pytest.raises(ChecksumError, match=rf"checksum mismatch in {path} at offset {MIB} .*corrupt") as ei:
            f.read(torch.zeros(3 * MIB, dtype=torch.uint8))
        assert ei.value.errno == errno.EIO and ei.value.filename == str(path)
        f.read(torch.zeros(MIB, dtype=torch.uint8))  # the intact first block still reads
        with pytest.raises(ChecksumError):
            f.verify()


def test_truncated_file_is_detected_at_open(tmp_path):
    path = tmp_path / "trunc"
    with FileHandle(path, "w", size=MIB + 5, checksum=True, chunk_bytes=MIB) as f:
        f.write(rand_bytes(MIB + 5))
    os.truncate(path, 100_000)
    with pytest.raises(TruncatedFileError, match=rf"{path} is truncated: expected {MIB + 5} bytes, found 100000"):
        FileHandle(path, "r", checksum=True, chunk_bytes=MIB)


def test_corrupt_or_missing_sidecar_is_named(tmp_path):
    path = tmp_path / "side"
    with FileHandle(path, "w", size=10_000, checksum=True) as f:
        f.write(rand_bytes(10_000))
    with open(str(path) + ".crc", "r+b") as raw:
        raw.seek(50)
        raw.write(b"\x00\x01")
    with pytest.raises(StorageError, match=r"checksum file .*side\.crc is corrupt"):
        FileHandle(path, "r", checksum=True)
    os.remove(str(path) + ".crc")
    with pytest.raises(StorageError, match=r"checksum file .*side\.crc is missing"):
        FileHandle(path, "r", checksum=True)


def test_worker_errors_reach_the_future_with_errno_and_path(tmp_path, monkeypatch):
    path = tmp_path / "e"
    with FileHandle(path, "w", threads=3, chunk_bytes=64 * KIB) as f:
        f.write(rand_bytes(MIB))
        real = os.preadv

        def failing(fd, bufs, off):
            if off >= 512 * KIB:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, bufs, off)

        monkeypatch.setattr(handle_mod.os, "preadv", failing)
        fut = f.pread(torch.zeros(MIB, dtype=torch.uint8))
        with pytest.raises(
            StorageError, match=rf"read of 65536 bytes at offset 524288 of {path} failed: Input/output"
        ) as ei:
            fut.get(timeout=30)
        assert ei.value.errno == errno.EIO and ei.value.filename == str(path) and ei.value.offset == 512 * KIB
        assert fut.done()  # every chunk stopped before the error was raised


def test_open_errors_keep_errno(tmp_path):
    with pytest.raises(StorageError, match=rf"open of 0 bytes at offset 0 of {tmp_path}.*Is a directory") as ei:
        FileHandle(tmp_path, "r+")
    assert ei.value.errno == errno.EISDIR
    with pytest.raises(StorageError) as ei:
        FileHandle(tmp_path / "nope", "r")
    assert ei.value.errno == errno.ENOENT


def test_bad_calls_are_refused_with_a_reason(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of"):
        FileHandle(tmp_path / "m", "rw")
    with pytest.raises(ValueError, match="pass size= when creating"):
        FileHandle(tmp_path / "m", "w", checksum=True)
    with pytest.raises(ValueError, match="must divide chunk_bytes"):
        FileHandle(tmp_path / "m", "w", size=10, checksum=True, checksum_block=12 * KIB, chunk_bytes=16 * KIB)
    with FileHandle(tmp_path / "m", "w", size=8192, checksum=True) as f:
        with pytest.raises(ValueError, match=r"runs past the end .* \(fixed size 8192\)"):
            f.write(bytes(10), file_offset=8190)
        with pytest.raises(ValueError, match="outside the 10-byte buffer"):
            f.write(bytes(10), size=11)
        with pytest.raises(ValueError, match="read-only"):
            f.read(b"0123")
        with pytest.raises(ValueError, match="contiguous"):
            f.write(torch.zeros(4, 4).t())
    with FileHandle(tmp_path / "m", "r", checksum=True) as f:
        with pytest.raises(ValueError, match="open read-only"):
            f.write(bytes(4))
    f.close()  # closing twice is harmless
    with pytest.raises(ValueError, match="I/O on closed file"):
        f.read(bytearray(4))


def test_close_waits_for_work_in_flight(tmp_path):
    data = rand_bytes(16 * MIB)
    f = FileHandle(tmp_path / "cl", "w", threads=2, chunk_bytes=256 * KIB)
    futs = [f.pwrite(data, file_offset=0), f.pwrite(data, file_offset=16 * MIB)]
    f.close()
    assert all(x.done() for x in futs) and sum(x.get() for x in futs) == 32 * MIB
    with FileHandle(tmp_path / "cl", "r") as g:
        out = torch.zeros(32 * MIB, dtype=torch.uint8)
        g.read(out)
    assert torch.equal(out[: 16 * MIB], data) and torch.equal(out[16 * MIB :], data)


def test_close_with_cancel_drops_queued_chunks_cleanly(tmp_path):
    f = FileHandle(tmp_path / "cc", "w", threads=1, chunk_bytes=64 * KIB)
    fut = f.pwrite(aligned_empty(64 * MIB), file_offset=0)  # 1024 chunks on one thread
    f.close(cancel=True)
    assert fut.done()
    with pytest.raises(cf.CancelledError, match="cancelled"):
        fut.get()


def test_buffered_fallback_warns_once(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(handle_mod.os, "open", no_direct)
    monkeypatch.setattr(handle_mod, "_warned_buffered", set())
    data = rand_bytes(10_001)
    with caplog.at_level(logging.WARNING, logger="tiertrain"):
        for name in ("a", "b"):
            with FileHandle(tmp_path / name, "w", size=10_001, checksum=True) as f:
                assert not f.direct
                f.write(data, file_offset=0)
                f.write(data[:77], file_offset=3)
            with FileHandle(tmp_path / name, "r", checksum=True) as f:
                out = torch.zeros(10_001, dtype=torch.uint8)
                f.read(out)
            expect = data.clone()
            expect[3:80] = data[:77]
            assert torch.equal(out, expect)
    warnings = [r for r in caplog.records if "does not support O_DIRECT" in r.message]
    assert len(warnings) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gds_mode", ["off", "auto"])
def test_device_tensors_roundtrip(tmp_path, gds_mode):
    from tiertrain.io import gds

    gds.set_mode(gds_mode)
    try:
        t = torch.randn(3 * MIB + 7, device="cuda")
        with FileHandle(tmp_path / "g", "w", chunk_bytes=MIB) as f:  # a write through kvikio grows the file
            f.write(t, file_offset=4096)
            back = torch.empty_like(t)
            f.read(back, file_offset=4096)
        assert torch.equal(back, t)
        with FileHandle(tmp_path / "c", "w", size=t.numel() * 4, checksum=True, checksum_block=MIB) as f:
            f.write(t)  # checksums computed on the GPU (the last chunk ends at the file's end: whole blocks)
            back.zero_()
            f.read(back)
        assert torch.equal(back, t)
    finally:
        gds.set_mode("auto")


def test_work_after_a_read_runs_once_in_the_thread_that_waits(tmp_path):
    """``IOFuture.then``: the work on the bytes read (a narrower base's widening) runs once, in
    the thread that calls ``get`` (in an I/O thread it took the reads' CPU on 2 cores, measured
    slower), after every chunk is in; its error, and a chunk's, reach ``get``."""
    import threading

    import torch

    from tiertrain.io import FileHandle, IOFuture

    data = torch.arange(1 << 18, dtype=torch.float32)
    path = str(tmp_path / "f.bin")
    with FileHandle(path, "w", size=data.numel() * 4, chunk_bytes=64 << 10) as f:
        f.write(data.view(torch.uint8).numpy())
    seen = []
    with FileHandle(path, "r", chunk_bytes=64 << 10) as f:
        buf = torch.zeros_like(data)
        fut = f.pread(buf.view(torch.uint8).numpy()).then(
            lambda: seen.append((threading.current_thread().name, buf.sum().item()))
        )
        assert fut.get() == data.numel() * 4 and fut.get() == data.numel() * 4
    assert seen == [(threading.current_thread().name, data.sum().item())]  # once, here, every chunk in

    def boom():
        raise ValueError("conversion failed")

    with pytest.raises(ValueError, match="conversion failed"):
        IOFuture.completed(8).then(boom).get()
    import concurrent.futures as cf

    failed: cf.Future = cf.Future()
    failed.set_exception(OSError(5, "Input/output error"))  # a chunk's error: the work never runs
    with pytest.raises(OSError, match="Input/output error"):
        IOFuture([failed]).then(lambda: seen.append("ran")).get()
    assert "ran" not in seen


def test_gathered_futures_keep_each_ones_work_after_the_read():
    """``IOFuture.gather`` of futures made by ``then``: every one's work runs (once, in the
    order given) before the gathered ``get`` returns; the bytes are their sum."""
    import concurrent.futures as cf

    from tiertrain.io import IOFuture

    seen = []
    a = IOFuture.completed(8).then(lambda: seen.append("a"))
    b = IOFuture.completed(4)
    c = IOFuture.completed(2).then(lambda: seen.append("c"))
    both = IOFuture.gather([a, b, c])
    assert both.get() == 14 and both.get() == 14
    assert seen == ["a", "c"]
    failed: cf.Future = cf.Future()
    failed.set_exception(OSError(5, "Input/output error"))
    with pytest.raises(OSError, match="Input/output error"):
        IOFuture.gather([IOFuture.completed(1).then(lambda: seen.append("d")), IOFuture([failed])]).get()
    assert "d" not in seen  # a chunk failed: nothing worked on bytes that are not all in


def test_a_tail_write_takes_whole_pages_and_verify_needs_no_bounce_buffer(tmp_path):
    """An O_DIRECT write of a file's unaligned tail wrote the whole checksum block (1 MiB for 100
    bytes, past the space claimed until close cut it off: ENOSPC on a nearly full disk); verify()
    held a bounce buffer while its own read of an unaligned tail needed one (with one, it hung)."""
    import threading

    p = str(tmp_path / "f.bin")
    with FileHandle(p, "w", size=5000, checksum=True, checksum_block=1 << 20, chunk_bytes=1 << 20) as h:
        h.write(bytearray(b"y" * 100), 100, 4900)
        assert os.stat(p).st_size <= 8192, os.stat(p).st_size  # whole pages, not the 1 MiB block
    assert os.stat(p).st_size == 5000
    workers = IOWorkers("t", threads=2, chunk_bytes=1 << 20, bounce_buffers=1)
    with FileHandle(p, "r", checksum=True, checksum_block=1 << 20, workers=workers) as h:
        t = threading.Thread(target=lambda: h.verify(), daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "verify() hung"
    workers.shutdown()
