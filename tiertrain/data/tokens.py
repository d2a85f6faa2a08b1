"""Token files: a header and a flat array of token ids, read through numpy memmap.

Layout: 64-byte header (magic ``TTTOKENS``, version, item size, token count, vocabulary
size, crc32c of the tokens), then the tokens as little-endian uint16 or uint32.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable

import numpy as np

from ..errors import TiertrainError
from ..io.checksum import crc32c
from ..paths import remove_dead_temporaries

__all__ = ["write_tokens", "read_tokens", "tokens_checksum", "is_token_file", "TokenFileError", "HEADER_BYTES"]

_MAGIC = b"TTTOKENS"
_HEAD = struct.Struct("<8sIIQQI")
HEADER_BYTES = 64


class TokenFileError(TiertrainError, ValueError):
    """A token file is missing, malformed or corrupt."""


def write_tokens(path: str, chunks: Iterable[np.ndarray], vocab_size: int, *, empty: str | None = None) -> int:
    """Write token ids (an iterable of arrays) to ``path``; return the token count. ``empty``:
    the error where there is none (a file of no tokens, which every reader refuses, not made)."""
    dtype = np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")
    remove_dead_temporaries(path)  # a killed earlier writer's
    tmp = f"{path}.tmp{os.getpid()}"
    count, crc = 0, 0
    try:
        with open(tmp, "wb") as f:
            f.write(bytes(HEADER_BYTES))
            for chunk in chunks:
                arr = np.asarray(chunk)
                if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                    raise TokenFileError(f"token ids must be in [0, {vocab_size}), got {arr.min()}..{arr.max()}")
                data = arr.astype(dtype).tobytes()
                crc = crc32c(np.frombuffer(data, dtype=np.uint8), crc)
                f.write(data)
                count += arr.size
            if not count and empty is not None:
                raise TokenFileError(empty)
            f.seek(0)
            f.write(_HEAD.pack(_MAGIC, 1, dtype.itemsize, count, vocab_size, crc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:  # a failed or interrupted write leaves nothing behind
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):  # a full disk, an I/O error
            raise TokenFileError(
                f"writing {path} failed ({exc.strerror or exc}); nothing was written: free space there or write "
                "elsewhere"
            ) from None
        raise
    return count


def is_token_file(path: str) -> bool:
    """Whether ``path`` starts as a token file ``write_tokens`` wrote (its magic)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except OSError:
        return False


def tokens_checksum(path: str) -> int:
    """The CRC32C a token file's header records of its tokens (its content, without reading it)."""
    with open(path, "rb") as f:
        return _HEAD.unpack_from(f.read(HEADER_BYTES))[5]


def read_tokens(path: str, *, verify: bool = False) -> tuple[np.ndarray, int]:
    """The tokens of ``path`` (a read-only memmap) and the vocabulary size."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise TokenFileError(f"token file {path} does not exist; make one with `tiertrain prepare`") from None
    except IsADirectoryError:
        raise TokenFileError(f"{path} is a directory, not a token file; make one with `tiertrain prepare`") from None
    if len(head) < HEADER_BYTES or head[:8] != _MAGIC:
        raise TokenFileError(
            f"{path} is not a tiertrain token file (no TTTOKENS header): give a .txt file or make a "
            "token file with `tiertrain prepare`"
        )
    _, version, itemsize, count, vocab, crc = _HEAD.unpack_from(head)
    dtype = {2: "<u2", 4: "<u4"}.get(itemsize)
    if version != 1 or dtype is None:
        raise TokenFileError(
            f"{path}: unsupported token file version {version} / item size {itemsize}; "
            "make it again with `tiertrain prepare`"
        )
    expected = HEADER_BYTES + count * itemsize
    actual = os.path.getsize(path)
    if actual < expected:
        raise TokenFileError(
            f"{path} is truncated: expected {expected} bytes, found {actual}; make it again with `tiertrain prepare`"
        )
    if actual > expected:
        raise TokenFileError(
            f"{path} has {actual - expected} bytes after its {count} tokens (it was appended to or "
            "damaged); make it again with `tiertrain prepare`"
        )
    if count == 0:
        raise TokenFileError(f"{path} holds no tokens; prepare it from a non-empty text")
    arr = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
    if verify and crc32c(np.frombuffer(arr, dtype=np.uint8)) != crc:
        raise TokenFileError(f"{path}: token data does not match its checksum; the file is corrupt")
    return arr, vocab
