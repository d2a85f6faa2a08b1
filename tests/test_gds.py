"""GPUDirect Storage's logic, on CPU: the device CRC32C against the crc32c package, and the
direct path (file <-> device memory, checksums computed and verified where the data is)
through a backend that emulates kvikio on CPU tensors. The real kvikio runs in stage 6 of the
GPU window (``bench/gpu_window/stage6-gds.sh``) on a GPU."""

import os

import crc32c
import pytest
import torch
from reference import small_config
from test_parity import assert_parity

from tiertrain.device import AsyncCpuDevice
from tiertrain.io import ChecksumError, FileHandle, IOWorkers, StorageError, TruncatedFileError, gds
from tiertrain.io.devcrc import block_crcs
from tiertrain.io.stripe import StripedFile

KIB, MIB = 1 << 10, 1 << 20


class _Done:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class FakeCuFile:
    """kvikio.CuFile's calls on CPU tensors (what its compatibility mode does on a GPU)."""

    calls = {"r": 0, "w": 0}
    read_files: set = set()

    def __init__(self, path: str, writable: bool) -> None:
        self.fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        self.path = str(path)

    def pread(self, buf, size, file_offset):
        FakeCuFile.calls["r"] += 1
        FakeCuFile.read_files.add(os.path.basename(self.path))
        data = os.pread(self.fd, size, file_offset)
        buf.view(torch.uint8)[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return _Done(len(data))

    def pwrite(self, buf, size, file_offset):
        FakeCuFile.calls["w"] += 1
        return _Done(os.pwrite(self.fd, buf.view(torch.uint8)[:size].numpy().tobytes(), file_offset))

    def close(self):
        os.close(self.fd)


@pytest.fixture
def direct():
    """CPU tensors take the direct path, through FakeCuFile; the call counts start at 0."""
    FakeCuFile.calls = {"r": 0, "w": 0}
    FakeCuFile.read_files = set()
    gds.set_backend(FakeCuFile, device_types=("cpu",))
    try:
        yield FakeCuFile.calls
    finally:
        gds.set_backend(None)


@pytest.mark.parametrize(
    "n,block",
    [
        (4 * KIB, 4 * KIB),
        (MIB, MIB),
        (3 * MIB + 12345, MIB),
        (5000, 8 * KIB),
        (1, 4 * KIB),
        (70000, 12 * KIB),
        (0, 4 * KIB),
        (200 * KIB + 3, 64 * KIB),
    ],
)
def test_device_crc_equals_crc32c(n, block):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    want = [crc32c.crc32c(data[i : i + block].numpy().tobytes()) for i in range(0, n, block)]
    assert block_crcs(data, block) == want
    if n >= 8:  # any tensor, read as its bytes
        k = n // 8 * 8
        assert block_crcs(data[:k].view(torch.float64), block) == block_crcs(data[:k], block)


def test_device_crc_sees_one_flipped_bit_anywhere():
    data = torch.randint(0, 256, (64 * KIB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = block_crcs(data, 64 * KIB)[0]
    for pos in (0, 1, 4095, 4096, 30000, 64 * KIB - 1):
        for bit in (0, 7):
            bad = data.clone()
            bad[pos] ^= 1 << bit
            assert block_crcs(bad, 64 * KIB)[0] == crc32c.crc32c(bad.numpy().tobytes()) != base


def test_device_crc_refuses_blocks_that_are_not_whole_pieces():
    with pytest.raises(ValueError, match="multiple of 4096 bytes, got 1000"):
        block_crcs(torch.zeros(10, dtype=torch.uint8), 1000)


def test_direct_writes_and_reads_keep_checksums(tmp_path, direct):
    """Whole blocks go straight through (CRC computed on the device), partial ones through
    staging; the table is the host's: the file verifies on the host path afterwards."""
    size = 5 * 64 * KIB + 1000
    t = torch.randint(0, 256, (size,), dtype=torch.uint8)
    with FileHandle(tmp_path / "f", "w", size=size, checksum=True, checksum_block=64 * KIB, chunk_bytes=128 * KIB) as f:
        f.write(t)
        assert direct["w"] == 3  # chunks [0,128K) [128K,256K) [256K, end): the last ends at the file's end
        back = torch.empty_like(t)
        f.read(back)
        assert torch.equal(back, t) and direct["r"] == 3
        part = torch.empty(100 * KIB, dtype=torch.uint8)
        f.read(part, file_offset=10 * KIB)  # not on block boundaries: staged, verified on the host
        assert torch.equal(part, t[10 * KIB : 110 * KIB]) and direct["r"] == 3
    gds.set_backend(None)
    with FileHandle(tmp_path / "f", "r", checksum=True, checksum_block=64 * KIB) as f:
        assert f.verify() == size


def test_direct_reads_detect_corruption_and_truncation(tmp_path, direct):
    size = 4 * 64 * KIB
    t = torch.randint(0, 256, (size,), dtype=torch.uint8)
    with FileHandle(tmp_path / "f", "w", size=size, checksum=True, checksum_block=64 * KIB) as f:
        f.write(t)
    with open(tmp_path / "f", "r+b") as raw:
        raw.seek(2 * 64 * KIB + 77)
        b = raw.read(1)
        raw.seek(2 * 64 * KIB + 77)
        raw.write(bytes([b[0] ^ 0x10]))
    with FileHandle(tmp_path / "f", "r", checksum=True, checksum_block=64 * KIB) as f:
        with pytest.raises(ChecksumError, match=r"checksum mismatch in .*/f at offset 131072"):
            f.read(torch.empty(size, dtype=torch.uint8))
        assert direct["r"] >= 1
    with FileHandle(tmp_path / "f", "r", checksum=True, checksum_block=64 * KIB) as f:
        os.truncate(tmp_path / "f", size - 4096)  # after the open, which checks the size
        with pytest.raises(TruncatedFileError, match="is truncated"):
            f.read(torch.empty(64 * KIB, dtype=torch.uint8), file_offset=3 * 64 * KIB)


def test_staged_device_copies_run_on_the_io_threads_side_stream(tmp_path, direct, monkeypatch):
    """A request that is not whole checksum blocks goes through pinned staging on an I/O thread;
    its device copies must not run on that thread's default stream, which is the compute
    stream's queue on CUDA: each copy to or from the device tensor is made inside the thread's
    side stream (the write's ordered after the compute), as the device CRC is."""
    import contextlib

    from tiertrain.io import devcrc

    inside, copies = [], []
    real = devcrc.side_stream

    @contextlib.contextmanager
    def spy(t, **kw):
        with real(t, **kw):
            inside.append((t.untyped_storage().data_ptr(), kw.get("after_compute", False)))
            try:
                yield
            finally:
                inside.pop()

    real_copy = torch.Tensor.copy_

    def copy_(dst, src, *a, **kw):
        for dev in (dst, src):
            if dev.untyped_storage().data_ptr() in (t.untyped_storage().data_ptr(), back.untyped_storage().data_ptr()):
                copies.append(
                    (
                        dst is dev,
                        [p for p, _ in inside] == [dev.untyped_storage().data_ptr()],
                        bool(inside) and inside[-1][1],
                    )
                )
        return real_copy(dst, src, *a, **kw)

    monkeypatch.setattr(devcrc, "side_stream", spy)
    t = torch.randint(0, 256, (100 * KIB,), dtype=torch.uint8)
    back = torch.empty_like(t)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with FileHandle(tmp_path / "f", "w", size=256 * KIB, checksum=True, checksum_block=64 * KIB) as f:
        f.write(t, file_offset=10 * KIB)  # not on block boundaries: staged
        f.read(back, file_offset=10 * KIB)
    monkeypatch.undo()
    assert torch.equal(back, t) and direct["w"] == direct["r"] == 0
    writes = [c for c in copies if not c[0]]  # the device tensor copied from (into staging)
    reads = [c for c in copies if c[0]]  # the device tensor copied into
    assert writes and all(on_side and after for _, on_side, after in writes), copies
    assert reads and all(on_side for _, on_side, _ in reads), copies


def test_direct_writes_grow_an_unchecksummed_file(tmp_path, direct):
    """A write through kvikio used to leave the handle's size at 0: the read came back empty."""
    t = torch.randn(3 * MIB // 4 + 7)
    with FileHandle(tmp_path / "g", "w", chunk_bytes=MIB) as f:
        f.write(t, file_offset=4096)
        assert f.size == 4096 + t.numel() * 4
        back = torch.empty_like(t)
        assert f.read(back, file_offset=4096) == t.numel() * 4
    assert torch.equal(back, t) and direct["w"] > 0 and direct["r"] > 0


@pytest.mark.parametrize(
    "paths,size,off", [(2, 3 * 64 * KIB + 5, 0), (3, 10 * 64 * KIB, 64 * KIB), (3, 7 * 64 * KIB, 0)]
)
def test_striped_files_take_device_tensors(tmp_path, direct, paths, size, off):
    """A device tensor is cut into one request per stripe piece; the bytes land where the
    host path puts them (read back through host buffers)."""
    dirs = [str(tmp_path / f"p{i}") for i in range(paths)]
    for d in dirs:
        os.makedirs(d)
    workers = [IOWorkers(d, threads=2, chunk_bytes=128 * KIB) for d in dirs]
    t = torch.randint(0, 256, (size,), dtype=torch.uint8)
    try:
        with StripedFile(
            dirs,
            "s",
            "w",
            workers=workers,
            size=off + size,
            stripe_bytes=64 * KIB,
            checksum=True,
            checksum_block=64 * KIB,
        ) as f:
            f.write(t, file_offset=off)
            back = torch.empty_like(t)
            f.read(back, file_offset=off)
        assert torch.equal(back, t) and direct["w"] >= paths
        gds.set_backend(None)
        with StripedFile(
            dirs, "s", "r", workers=workers, stripe_bytes=64 * KIB, checksum=True, checksum_block=64 * KIB
        ) as f:
            host = bytearray(size)
            f.read(host, file_offset=off)
        assert bytes(host) == t.numpy().tobytes()
    finally:
        for w in workers:
            w.shutdown()


@pytest.mark.slow
def test_training_reads_parameters_straight_into_device_slots(tmp_path, direct):
    """With a device that reads files directly (GPUDirect Storage), the parameter store has no
    staging and its reads land in the slots, checksums verified on the device: the run is
    bit-identical to plain PyTorch, with copies delayed and freed memory poisoned."""
    cfg = small_config(tmp_path, kind="llama", micro_batches=2, steps=2, paths=2)
    tr, _ = assert_parity(cfg, AsyncCpuDevice(delay=0.001, direct=True))
    assert tr.params.pool_bytes == tr.params.slot_bytes  # no staging buffers
    assert "params.bin" in FakeCuFile.read_files  # the parameters came through the direct path


def test_gds_on_without_kvikio_is_refused_at_start(tmp_path):
    from tiertrain.config import ConfigError
    from tiertrain.device.core import _gds_usable

    try:
        import kvikio  # noqa: F401

        pytest.skip("kvikio is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match=r"io.gds='on' but kvikio is not installed"):
        _gds_usable("on")
    assert _gds_usable("auto") is False and _gds_usable("off") is False


def test_a_kvikio_failure_names_the_file(tmp_path, direct):
    class Broken(FakeCuFile):
        def pread(self, buf, size, file_offset):
            raise RuntimeError("cuFileRead failed: CU_FILE_DRIVER_NOT_INITIALIZED")

    gds.set_backend(Broken, device_types=("cpu",))
    with FileHandle(tmp_path / "f", "w", size=64 * KIB) as f:
        f.write(torch.zeros(64 * KIB, dtype=torch.uint8))
        with pytest.raises(
            StorageError,
            match=r"GPUDirect Storage pread of 65536 bytes at offset 0 of .*/f failed: "
            r"cuFileRead failed",
        ):
            f.read(torch.empty(64 * KIB, dtype=torch.uint8))
