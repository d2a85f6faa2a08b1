"""tiertrain.io: the storage tier.

Small API in the manner of kvikio: handles are context managers; ``pread``/``pwrite``
are non-blocking and return an ``IOFuture``; ``read``/``write`` are their blocking
forms. Everything that tiertrain moves to and from SSD goes through here, on fixed
pools, with every byte counted.
"""

from .align import ALIGN, aligned_empty, round_up
from .checksum import ChecksumTable
from .errors import ChecksumError, OutOfSpaceError, StorageError, TruncatedFileError
from .future import IOFuture
from .handle import FileHandle
from .pool import BufferPool, PoolBuffer
from .space import check_space, free_bytes, preallocate
from .stats import PathStats, StatsSnapshot
from .storage import Storage
from .stripe import StripedFile
from .workers import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS, IOWorkers

__all__ = [
    "ALIGN",
    "aligned_empty",
    "round_up",
    "BufferPool",
    "PoolBuffer",
    "ChecksumTable",
    "ChecksumError",
    "OutOfSpaceError",
    "StorageError",
    "TruncatedFileError",
    "IOFuture",
    "FileHandle",
    "StripedFile",
    "Storage",
    "IOWorkers",
    "PathStats",
    "StatsSnapshot",
    "check_space",
    "free_bytes",
    "preallocate",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_THREADS",
]
