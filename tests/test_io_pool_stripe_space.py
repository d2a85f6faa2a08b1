"""Buffer pools, striping over several paths, and space claimed at start."""

import os
import re
import shutil
import threading
import time

import pytest
import torch

from tiertrain.io import ALIGN, BufferPool, FileHandle, OutOfSpaceError, Storage, check_space
from tiertrain.io.stripe import local_size

KIB, MIB = 1 << 10, 1 << 20


def rand_bytes(n, seed=0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# -- pools ------------------------------------------------------------------------------------


def test_pool_buffers_are_aligned_and_fixed():
    pool = BufferPool(5, 10_000, pin=False)
    assert pool.size_bytes == 5 * 12_288  # stride rounded up to 4 KiB
    bufs = [pool.acquire() for _ in range(5)]
    assert all(b.tensor.data_ptr() % ALIGN == 0 and b.tensor.numel() == 10_000 for b in bufs)
    assert len({b.tensor.data_ptr() for b in bufs}) == 5
    for b in bufs:
        b.release()
    assert pool.high_water == 5 and pool.in_use == 0 and pool.size_bytes == 5 * 12_288


def test_pool_blocks_when_exhausted_then_resumes():
    pool = BufferPool(2, 4096, pin=False)
    a, b = pool.acquire(), pool.acquire()
    got = []

    def taker():
        got.append(pool.acquire())  # blocks until a buffer comes back

    t = threading.Thread(target=taker)
    t.start()
    time.sleep(0.2)
    assert not got and t.is_alive()
    a.release()
    t.join(5)
    assert len(got) == 1 and got[0].index == a.index
    assert pool.high_water == 2 and pool.wait_s > 0.1
    with pytest.raises(TimeoutError, match="no buffer free after 0.05 s"):
        pool.acquire(timeout=0.05)
    b.release()
    got[0].release()


def test_pool_refuses_double_release_and_bad_sizes():
    pool = BufferPool(1, 100, pin=False)
    with pool.acquire() as buf:
        pass
    with pytest.raises(ValueError, match="released twice"):
        buf.release()
    with pytest.raises(ValueError, match="count must be >= 1"):
        BufferPool(0, 100)
    with pytest.raises(ValueError, match="size must be >= 1 byte"):
        BufferPool(1, 0)


# -- striping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("npaths", [1, 3])
@pytest.mark.parametrize("size", [1, 4097, 5 * MIB + 4321])
def test_striped_roundtrip(tmp_path, npaths, size):
    paths = [str(tmp_path / f"ssd{i}") for i in range(npaths)]
    data = rand_bytes(size, seed=size)
    with Storage(paths, stripe_bytes=256 * KIB, chunk_bytes=192 * KIB, threads=3, checksum_block=64 * KIB) as st:
        off = size // 3
        plen = min(1000, size - off)
        with st.create("state", size) as f:
            assert f.write(data) == size
            f.write(data[:plen], file_offset=off)  # a partial rewrite across stripe edges
        expect = data.clone()
        expect[off : off + plen] = data[:plen]
        with st.open("state", "r") as f:
            assert f.size == size
            out = torch.zeros(size, dtype=torch.uint8)
            assert f.read(out) == size
            assert torch.equal(out, expect)
            if size > 10:
                piece = torch.zeros(size - 7, dtype=torch.uint8)
                f.read(piece, file_offset=7)
                assert torch.equal(piece, expect[7:])
        per_path = st.stats()
        for i, p in enumerate(st.paths):  # each path wrote exactly its stripes
            assert os.path.getsize(os.path.join(p, "state")) == local_size(size, i, npaths, 256 * KIB)
        assert sum(s.write_bytes for s in per_path.values()) == size + plen


def test_stripes_land_on_the_right_paths(tmp_path):
    stripe = 64 * KIB
    paths = [str(tmp_path / f"p{i}") for i in range(3)]
    data = rand_bytes(7 * stripe + 5)
    with Storage(paths, stripe_bytes=stripe, chunk_bytes=stripe, checksum=False) as st:
        with st.create("x", data.numel()) as f:
            f.write(data)
    for k in range(8):  # stripe k -> path k % 3 at local offset (k // 3) * stripe
        with open(os.path.join(paths[k % 3], "x"), "rb") as raw:
            raw.seek((k // 3) * stripe)
            got = raw.read(stripe)
        assert got == data[k * stripe : (k + 1) * stripe].numpy().tobytes()


def test_three_paths_work_at_once(tmp_path):
    paths = [str(tmp_path / f"q{i}") for i in range(3)]
    with Storage(paths, stripe_bytes=256 * KIB, chunk_bytes=256 * KIB, checksum=False) as st:
        with st.create("big", 6 * MIB) as f:
            f.write(rand_bytes(6 * MIB))
        stats = st.stats()
    assert [s.write_bytes for s in stats.values()] == [2 * MIB] * 3


def test_storage_rejects_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="at least one path"):
        Storage([])
    with pytest.raises(ValueError, match="must be distinct"):
        Storage([str(tmp_path), str(tmp_path) + "/"])


# -- space ------------------------------------------------------------------------------------


def test_full_disk_is_reported_at_start_with_numbers(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(
        OutOfSpaceError, match=rf"not enough space on the filesystem of {tmp_path}.*need \d+ bytes .* bytes free"
    ) as ei:
        check_space([(str(tmp_path / "huge"), free * 4)])
    assert ei.value.needed == free * 4 and ei.value.errno == 28
    with pytest.raises(OutOfSpaceError, match="not enough space"):
        FileHandle(tmp_path / "huge", "w", size=free * 4)
    assert not (tmp_path / "huge").exists() or os.path.getsize(tmp_path / "huge") == 0
    with Storage([str(tmp_path / "s")]) as st:
        with pytest.raises(OutOfSpaceError):
            st.check_space([("a", free // 2 + 4096), ("b", free // 2 + 4096)])  # summed per filesystem


def test_create_claims_the_blocks(tmp_path):
    with FileHandle(tmp_path / "pre", "w", size=8 * MIB) as f:
        assert f.size == 8 * MIB
    st = os.stat(tmp_path / "pre")
    assert st.st_size == 8 * MIB and st.st_blocks * 512 >= 8 * MIB  # allocated, not sparse


@pytest.fixture
def small_fs(tmpfs):
    """A 4 MiB tmpfs, when this process may mount one."""
    return tmpfs("small", 4096)


def test_enospc_during_preallocation_names_the_path(small_fs):
    with pytest.raises(OutOfSpaceError, match=rf"filesystem of {small_fs}/f.*need 8388608 bytes"):
        FileHandle(small_fs / "f", "w", size=8 * MIB)
    with FileHandle(small_fs / "ok", "w", size=MIB) as f:  # what fits still works
        f.write(rand_bytes(MIB))


def test_bench_io_command_reports_both_directions(tmp_path, capsys):
    from tiertrain.cli import main

    out = tmp_path / "report.md"
    assert (
        main(
            [
                "bench",
                "io",
                "--path",
                str(tmp_path / "a"),
                "--size-gib",
                "0.01",
                "--repeats",
                "1",
                "--no-fio",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = out.read_text()
    assert "| write |" in text and "| read |" in text and "read + crc32c verify" in text
    assert "fio: skipped (--no-fio)" in text
    assert re.search(
        r"Reads and writes at once \(4:3, as the update\): [0-9.]+ GB/s combined \([0-9.]+\); "
        r"[0-9.]+x the time of the same reads and writes one after the other",
        text,
    ), text
    assert not list((tmp_path / "a").iterdir())  # the bench file is removed afterwards


def test_space_is_checked_where_a_directory_goes_meanwhile(tmp_path, monkeypatch):
    """Another process (a rank failing at start) may remove a directory between finding it and
    asking its filesystem: the check goes one level up instead of failing with a traceback."""
    import shutil as sh

    from tiertrain.io import space

    gone = tmp_path / "rank1"
    gone.mkdir()
    real = sh.disk_usage

    def racing(d):
        if os.path.basename(d) == "rank1" and gone.exists():
            gone.rmdir()  # removed after existing_dir found it, before the filesystem is asked
        return real(d)

    monkeypatch.setattr(space.shutil, "disk_usage", racing)
    assert space.free_bytes(str(gone / "params.bin")) > 0 and not gone.exists()  # raced, answered
    gone.mkdir()
    space.check_space([(str(gone / "f.bin"), 1)])  # raced again inside the check: no error
    assert not gone.exists()
    assert space.device_of(str(tmp_path / "x" / "y")) == os.stat(tmp_path).st_dev


def test_a_checksummed_file_saves_its_table_on_a_disk_filled_after_its_start(small_fs):
    """Found from outside: the checksum table was saved through a temporary copy, room never
    claimed at start; a scratch disk filled during the run failed the engines' next save and the
    whole run was lost (the other paths warned at exit). The table's room is claimed with the
    file's, and it is rewritten in place."""
    with FileHandle(small_fs / "f", "w", size=MIB, checksum=True) as f:
        f.write(rand_bytes(MIB))
        fd = os.open(small_fs / "filler", os.O_WRONLY | os.O_CREAT)  # the disk filled by someone else
        try:
            with pytest.raises(OSError):
                while True:
                    os.write(fd, b"\0" * 65536)
        finally:
            os.close(fd)
        f.write(rand_bytes(MIB, seed=1))
    with FileHandle(small_fs / "f", "r", checksum=True) as f:
        out = torch.zeros(MIB, dtype=torch.uint8)
        assert f.verify() == MIB and f.read(out) == MIB and torch.equal(out, rand_bytes(MIB, seed=1))
    assert sorted(os.listdir(small_fs)) == ["f", "f.crc", "filler"]
