"""Futures returned by non-blocking I/O calls."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Callable, Sequence

__all__ = ["IOFuture", "PositionalIO"]


class IOFuture:
    """The result of a non-blocking ``pread``/``pwrite``: one request split into chunk tasks.

    ``get()`` waits for every chunk and returns the number of bytes transferred; if a chunk
    failed it raises that chunk's error (an ``OSError`` with the original errno and path),
    after all chunks have stopped, so the caller's buffer is never still being written
    when the exception reaches it.
    """

    __slots__ = ("_parts", "_finish", "_result", "_error")

    def __init__(self, parts: Sequence[cf.Future], finish: Callable[[int], int] | None = None) -> None:
        self._parts = list(parts)
        self._finish = finish
        self._result: int | None = None
        self._error: BaseException | None = None

    @classmethod
    def completed(cls, nbytes: int = 0) -> "IOFuture":
        f: cf.Future = cf.Future()
        f.set_result(nbytes)
        return cls([f])

    @classmethod
    def gather(cls, futures: Sequence["IOFuture"]) -> "IOFuture":
        """One future for several requests: ``get()`` returns their bytes added up, after each
        request's finishing step (a ``then``'s work) has run, in the order given."""
        futures = list(futures)
        if not futures:
            return cls.completed(0)
        parts = [p for f in futures for p in f._parts]
        if all(f._finish is None for f in futures):
            return cls(parts)
        return cls(parts, finish=lambda _: sum(f.get() for f in futures))

    def done(self) -> bool:
        return all(p.done() for p in self._parts)

    def then(self, fn: Callable[[], object]) -> "IOFuture":
        """A future over the same chunks whose ``get`` also runs this one's finishing step,
        then ``fn()`` (in the getter's thread, once): work on the bytes read, such as a
        conversion. Use it instead of this one."""
        return IOFuture(self._parts, finish=lambda _: (self.get(), fn())[0])

    def watch(self) -> "IOFuture":
        """A future over the same chunks for a second waiter (another thread): its ``get``
        waits for them and raises their errors, without this future's finishing step (which
        runs once, in the owner's ``get``)."""
        return IOFuture(self._parts)

    def cancel(self) -> bool:
        """Cancel the chunks that have not started. True if none of the request ran."""
        return all([p.cancel() for p in self._parts])

    def get(self, timeout: float | None = None) -> int:
        """Block until done; return bytes transferred or raise the first chunk error."""
        if self._result is not None:
            return self._result
        if self._error is not None:
            raise self._error
        done, pending = cf.wait(self._parts, timeout=timeout)
        if pending:
            raise TimeoutError(f"I/O not finished after {timeout} s ({len(pending)} chunks pending)")
        total = 0
        for p in self._parts:  # in submission order, so the first failing chunk is reported
            if p.cancelled():
                self._error = cf.CancelledError("I/O request was cancelled before it ran")
                raise self._error
            exc = p.exception()
            if exc is not None:
                self._error = exc
                raise exc
            total += p.result()
        if self._finish is not None:
            total = self._finish(total)
        self._result = total
        return total


class PositionalIO:
    """The four positional calls of a file (kvikio's shape), given its ``_io(kind, buf, size,
    file_offset, buf_offset) -> IOFuture``: ``pread``/``pwrite`` return a future, ``read``/
    ``write`` are their blocking one-line wrappers. Offsets and sizes are in bytes; a
    ``size`` of None means the rest of ``buf``."""

    def _io(self, kind: str, buf: Any, size: int | None, file_offset: int, buf_offset: int) -> IOFuture:
        raise NotImplementedError

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0) -> IOFuture:
        """Read ``size`` bytes at ``file_offset`` into ``buf[buf_offset:]`` (bytes of ``buf``).
        Non-blocking: the future's ``get()`` gives the bytes read (fewer at end of file)."""
        return self._io("r", buf, size, file_offset, buf_offset)

    def pwrite(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0) -> IOFuture:
        """Write ``size`` bytes of ``buf[buf_offset:]`` at ``file_offset``. Non-blocking."""
        return self._io("w", buf, size, file_offset, buf_offset)

    def read(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0) -> int:
        """Blocking ``pread``."""
        return self.pread(buf, size, file_offset, buf_offset).get()

    def write(self, buf: Any, size: int | None = None, file_offset: int = 0, buf_offset: int = 0) -> int:
        """Blocking ``pwrite``."""
        return self.pwrite(buf, size, file_offset, buf_offset).get()
