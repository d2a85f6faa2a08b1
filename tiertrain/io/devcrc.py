"""CRC32C of tensors, computed by torch ops where the tensor lives (a GPU, or the CPU).

GPUDirect Storage reads a file straight into device memory, where the host's crc32c
cannot see it; this computes the same CRC32C per checksum block there, so that checksummed
files keep their verification on the direct path (``FileHandle`` compares the result with
the file's table, exactly as the host path does).

How: CRC32C without its initial value and final xor (``crc0``) is linear over GF(2) and
does not change with leading zero bytes. A block is cut into ``PIECE``-byte pieces; a
piece's ``crc0`` is the xor over its bytes of a per-(position, byte value) table entry
(level 1); the block's ``crc0`` is the xor over its pieces of each piece's ``crc0``
advanced by the zero bytes that follow it, again a per-(piece, byte of the crc, value)
table (level 2). A partial last block is padded with zeros in front. The standard CRC32C
is then ``crc0 ^ crc32c(zeros of the block's length)``. Only gathers and xors: exact on
every device; tested against the crc32c package bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np
import torch

from .checksum import _crc

__all__ = ["block_crcs", "side_stream", "PIECE"]

PIECE = 4096  # bytes per level-1 piece: the level-1 table is PIECE x 256 entries (4 MiB)
_POLY = 0x82F63B78  # CRC32C, reflected
_CHUNK = 4 << 20  # bytes per batch of kernels: 12 bytes of temporaries per byte (int64 index, int32 value)


@functools.lru_cache(maxsize=1)
def _byte_table() -> np.ndarray:
    r = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        r = np.where(r & 1, (r >> 1) ^ np.uint32(_POLY), r >> 1).astype(np.uint32)
    return r


def _zero_bytes(regs: np.ndarray, n: int) -> np.ndarray:
    """The CRC registers ``regs`` after ``n`` more zero bytes."""
    t = _byte_table()
    for _ in range(n):
        regs = (regs >> 8) ^ t[regs & 0xFF]
    return regs


def _apply(cols: np.ndarray, regs: np.ndarray) -> np.ndarray:
    """The GF(2)-linear map whose image of bit ``b`` is ``cols[b]``, applied to ``regs``."""
    out = np.zeros_like(regs)
    for b in range(32):
        out ^= np.where((regs >> b) & 1, cols[b], np.uint32(0)).astype(np.uint32)
    return out


@functools.lru_cache(maxsize=1)
def _level1() -> np.ndarray:
    """``[i, x]``: crc0 of a PIECE-byte piece that is zero but for byte ``x`` at ``i``."""
    out = np.empty((PIECE, 256), dtype=np.uint32)
    out[PIECE - 1] = _byte_table()  # crc0 of the single byte x
    for i in range(PIECE - 2, -1, -1):
        out[i] = _zero_bytes(out[i + 1], 1)
    return out


@functools.lru_cache(maxsize=8)
def _level2(pieces: int) -> np.ndarray:
    """``[j, q, x]``: byte ``q`` = ``x`` of piece ``j``'s crc0, advanced past the pieces
    after it (``pieces - 1 - j`` of them)."""
    step = _zero_bytes(np.uint32(1) << np.arange(32, dtype=np.uint32), PIECE)  # one piece of zeros
    cur = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]).reshape(-1)
    out = np.empty((pieces, 4 * 256), dtype=np.uint32)
    for j in range(pieces - 1, -1, -1):
        out[j] = cur
        cur = _apply(step, cur)
    return out


@functools.lru_cache(maxsize=64)
def _zero_crc(n: int) -> int:
    return _crc.crc32c(bytes(n))


@functools.lru_cache(maxsize=16)
def _tables(device: torch.device, pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.uint32).view(np.int32).reshape(-1)).to(device)

    return dev(_level1()), dev(_level2(pieces))


def _xor_rows(v: torch.Tensor) -> torch.Tensor:
    """The xor of each row of the 2-D ``v``."""
    while v.shape[1] > 1:
        n = v.shape[1]
        if n % 2:
            v = torch.cat([v, torch.zeros_like(v[:, :1])], dim=1)
            n += 1
        v = v[:, : n // 2] ^ v[:, n // 2 :]
    return v[:, 0]


def _crc0(blocks: torch.Tensor, pieces: int) -> torch.Tensor:
    """crc0 of each row of ``blocks`` (uint8, ``pieces * PIECE`` columns), as int32."""
    t1, t2 = _tables(blocks.device, pieces)
    pos = torch.arange(PIECE, device=blocks.device, dtype=torch.int64) * 256
    c = _xor_rows(t1[blocks.reshape(-1, PIECE).long() + pos])  # one crc0 per piece
    q = torch.arange(4, device=blocks.device, dtype=torch.int32) * 8
    byte = ((c[:, None] >> q) & 0xFF).long().reshape(-1, pieces * 4)
    idx = byte + torch.arange(pieces * 4, device=blocks.device, dtype=torch.int64) * 256
    return _xor_rows(t2[idx])


def block_crcs(data: torch.Tensor, block: int) -> list[int]:
    """CRC32C of every ``block``-byte block of ``data`` (the last may be shorter), equal to
    ``crc32c.crc32c`` of each. ``data``: a contiguous tensor on any device, read as bytes;
    ``block``: a multiple of ``PIECE``. Blocks until the values are on the host (a sync
    point on ``data``'s device: callers run it on an I/O thread)."""
    if block <= 0 or block % PIECE:
        raise ValueError(f"checksum block must be a positive multiple of {PIECE} bytes, got {block}")
    flat = data.detach().reshape(-1).view(torch.uint8)
    with side_stream(flat):
        return _block_crcs(flat, block)


_local = threading.local()


def side_stream(t: torch.Tensor, *, after_compute: bool = False) -> contextlib.AbstractContextManager:
    """For work an I/O thread does on ``t``'s device (a CRC, a staged copy): a stream of the
    thread's own, so that it is not queued behind the compute stream (which a thread's default
    stream is). ``after_compute``: ordered after what the device's default stream (the compute)
    has queued so far, for work that reads what the compute produced. Nothing on CPU. The caller
    synchronizes with what it issues there."""
    if not t.is_cuda:
        return contextlib.nullcontext()
    streams = _local.__dict__.setdefault("streams", {})
    if t.device not in streams:
        streams[t.device] = torch.cuda.Stream(t.device)
    s = streams[t.device]
    if after_compute:
        s.wait_stream(torch.cuda.default_stream(t.device))
    return torch.cuda.stream(s)


def _block_crcs(flat: torch.Tensor, block: int) -> list[int]:
    n, pieces = flat.numel(), block // PIECE
    full = n // block
    out: list[int] = []
    per = max(1, _CHUNK // block)
    for b0 in range(0, full, per):
        b1 = min(full, b0 + per)
        c0 = _crc0(flat[b0 * block : b1 * block].view(b1 - b0, block), pieces)
        out += [(int(c) & 0xFFFFFFFF) ^ _zero_crc(block) for c in c0.cpu().tolist()]  # sync point
    tail = n - full * block
    if tail:
        padded = torch.zeros(block, dtype=torch.uint8, device=flat.device)
        padded[block - tail :] = flat[full * block :]  # leading zeros leave crc0 as it is
        out.append((int(_crc0(padded.view(1, block), pieces)[0]) & 0xFFFFFFFF) ^ _zero_crc(tail))
    return out
