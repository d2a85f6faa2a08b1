"""Devices for tests that behave like a GPU where it matters, on CPU: ``AsyncCpuDevice``
(copies complete later on worker threads, real events, released memory poisoned; see
``core.py``) and, in ``lag.py``, the same on a logical clock."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable

import torch

from .core import Device, _events

__all__ = ["AsyncCpuDevice", "poison"]


class _Event:
    """An event of the test device: set by a stream's worker when its copy has run."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def is_set(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class _Mark(_Event):
    """A point of the compute stream (``event()``): compute runs on the calling thread, so it
    has been reached; uploads use it to order themselves after the compute stream."""

    def __init__(self) -> None:
        super().__init__()
        self._done.set()


class _Stream:
    """A worker thread running submitted copies in order, each after its ``after`` event
    and a delay."""

    def __init__(self, name: str, delay: float) -> None:
        self.delay = delay
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._run, name=f"tiertrain-test-{name}", daemon=True)
        self._t.start()

    def submit(self, fn: Callable[[], None], after: Any) -> _Event:
        ev = _Event()
        self._q.put((fn, after, ev))
        return ev

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, after, ev = item
            try:
                for a in _events(after):
                    a.wait()
                if self.delay:
                    time.sleep(self.delay)
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                ev.error = exc
            ev._done.set()

    def close(self) -> None:
        self._q.put(None)
        self._t.join()


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with values no computation produces by accident (NaN; 0xFF bytes)."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.view(torch.uint8).fill_(0xFF) if t.is_contiguous() else t.fill_(-1)


class AsyncCpuDevice(Device):
    """A CPU device for tests that behaves like a GPU where it matters (see the module
    docstring). ``delay``: seconds each copy waits on its stream before it runs."""

    separate = True

    def __init__(self, delay: float = 0.002, *, direct: bool = False) -> None:
        super().__init__(torch.device("cpu"))
        self.delay, self.direct = delay, direct
        self.up, self.down = _Stream("upload", delay), _Stream("download", delay)
        self.waits = 0  # compute-stream waits on an event not yet done (no host sync on a GPU)
        self._compute_owned: set[int] = set()  # storages allocated by the compute stream (empty)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = super().empty(numel, dtype)
        poison(t)  # fresh device memory holds garbage
        self._compute_owned.add(t.untyped_storage().data_ptr())
        return t

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        t = torch.empty_like(host)
        poison(t)
        self._compute_owned.add(t.untyped_storage().data_ptr())
        return t

    def event(self) -> Any:
        return _Mark()

    def upload_new(self, src: torch.Tensor, *, after: Any = None) -> tuple[torch.Tensor, Any]:
        d = torch.empty_like(src)  # the upload stream's memory (as on CUDA): no order needed
        poison(d)
        with self._call():
            return d, self.up.submit(lambda: d.copy_(src), after)

    def _call(self) -> contextlib.AbstractContextManager:
        """Around every call from the host (the logical-clock device ticks here)."""
        return contextlib.nullcontext()

    def upload(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Any:
        # What CUDA (and its sanitizer) refuses: writing, on the upload stream, memory that the
        # compute stream allocated and may still be using, without waiting for a point of it.
        if dst.untyped_storage().data_ptr() in self._compute_owned and not any(
            isinstance(e, _Mark) for e in _events(after)
        ):
            raise RuntimeError(
                "an upload into device memory of the compute stream with no event of the compute "
                "stream in `after`: on CUDA the copy may overwrite what queued kernels still read "
                "(the CUDA sanitizer reports a race); pass after=dev.event() or the buffer's release event"
            )
        with self._call():
            return self.up.submit(lambda: dst.copy_(src), after)

    def download(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Any:
        with self._call():
            return self.down.submit(lambda: dst.copy_(src), after)  # the closure keeps src alive

    def wait(self, ev: Any) -> None:
        with self._call():
            if ev is not None:  # compute runs on the calling thread: waiting is blocking it
                if not ev.is_set():
                    self.waits += 1
                ev.wait()

    def sync(self, ev: Any) -> None:
        with self._call():
            if ev is not None:
                self.sync_points += 1
                if not ev.is_set():
                    self.syncs += 1
                ev.wait()

    def done(self, ev: Any) -> bool:
        with self._call():
            return ev is None or ev.is_set()

    def release(self, t: torch.Tensor, *, after: Any = None) -> None:
        with self._call():
            if after is None:
                poison(t)
            else:  # ordered after the copy that last used it
                self.up.submit(lambda: poison(t), after)

    def synchronize(self) -> None:
        for stream in (self.up, self.down):
            stream.submit(lambda: None, None).wait()

    def close(self) -> None:
        self.up.close()
        self.down.close()
