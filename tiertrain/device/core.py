"""The compute device: memory, the streams data crosses on, events, and memory figures.

One interface, three implementations, so that callers are written once:

- ``Device`` (CPU): device memory is host memory; copies are plain and complete at once.
- ``CudaDevice``: device memory is separate (``separate``); host buffers that cross are
  page-locked (``pin``); uploads (host -> device) and downloads (device -> host) run on two
  dedicated high-priority streams, ordered after compute by events; a download keeps its
  source alive (``record_stream``) until it has run, so the caching allocator cannot hand
  the memory to the compute stream before the copy reads it.
- ``AsyncCpuDevice`` (tests): CPU memory treated as separate, with copies that complete
  later on a worker thread per stream (after a delay), real events, and memory that is
  given back poisoned (NaN, 0xFF). A missing wait, a missing keep-alive or a buffer reused
  too early then shows as a wrong number on CPU, as it would on a GPU only sometimes.

With ``direct`` (GPUDirect Storage, ``io.gds``), the parameter store reads files straight
into device memory instead of through pinned staging; such reads are not stream-ordered,
so a slot's last use is waited for (``sync``) before a read may overwrite it.

``wait`` orders the compute stream after an event without blocking the host; ``sync``
blocks the host (a sync point; counted in ``syncs``); ``done`` asks without blocking. An
``after`` argument is an event, None (nothing to wait for) or a list of them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

__all__ = ["Device", "CudaDevice", "make_device", "resolve_device", "resolve_dtype", "cpu_has_fast_bf16"]

log = logging.getLogger("tiertrain")


def resolve_device(name: str) -> torch.device:
    from ..config import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = "this PyTorch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"train.device = 'cuda' but {why}; use --train.device=cpu (or 'auto')")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX); without them
    PyTorch's bf16 matrix products on CPU run about 20x slower than fp32 (measured here)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return True  # unknown: say nothing
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def base_dtype_of(name: str | None, compute: torch.dtype) -> torch.dtype:
    """The float dtype a frozen model is kept in (``model.base_dtype``; None, or a quantized base,
    whose units are bytes of their own layout: ``state/quant.py``: the compute dtype)."""
    return getattr(torch, name) if name and name not in ("nf4", "fp4", "int8") else compute


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matrix products on CPU are two orders of magnitude slower than fp32 here
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_fast_bf16():
        log.warning(
            "train.param_dtype = 'bfloat16' on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16): "
            "expect steps about 20x slower than with 'float32'"
        )
    return dtype


class Device:
    """The CPU: device memory is host memory, every copy completes when it is issued."""

    cuda = False  # a CUDA device (RNG of the device, FLOP/s figures)
    separate = False  # device memory is not host memory: data crosses by copies on streams
    pin = False  # host buffers that cross to the device are page-locked
    direct = False  # files read straight into device memory (GPUDirect Storage), no host staging

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.syncs = 0  # host synchronisations so far (``sync`` calls that had to wait)
        # ``sync`` calls on a pending-or-done event: the sync points the schedule asks for,
        # whether or not they waited (a count that does not depend on timing, for tests)
        self.sync_points = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        from ..io import aligned_empty

        return aligned_empty(numel * dtype.itemsize).view(dtype)

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        """A device tensor of ``host``'s shape and dtype (for an upload of it)."""
        return torch.empty_like(host, device=self.device)

    def event(self) -> Any:
        """An event at the compute stream's current position (None: already reached)."""
        return None

    def upload(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Any:
        """Copy host ``src`` into device ``dst`` on the upload stream, after ``after``; the
        event of its completion. ``src`` must stay as it is until then."""
        dst.copy_(src)
        return None

    def upload_new(self, src: torch.Tensor, *, after: Any = None) -> tuple[torch.Tensor, Any]:
        """``src`` (host) in new device memory, by an upload after ``after``: (the tensor, the
        event of its completion). The memory is the upload stream's, so no compute still
        queued on a block just freed can be overwritten by the copy."""
        d = self.empty_like(src)
        return d, self.upload(d, src, after=after)

    def download(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Any:
        """Copy device ``src`` into host ``dst`` on the download stream, after ``after``
        (default: after everything the compute stream has issued); its completion event.
        ``src`` is kept alive until the copy has run."""
        dst.copy_(src)
        return None

    def run_aside(self, fn: Callable[[], object]) -> Any:
        """Run ``fn``'s device work (from any thread) on a stream of its own, not in the compute
        stream's order: the event of its completion. Here at once."""
        fn()
        return None

    def synchronize(self) -> None:
        """Until every copy issued so far has run (before pinned memory may go)."""

    def wait(self, ev: Any) -> None:
        """Order the compute stream after ``ev`` (no host block on CUDA)."""

    def sync(self, ev: Any) -> None:
        """Block the host until ``ev`` has happened. A sync point."""

    def done(self, ev: Any) -> bool:
        return True

    def release(self, t: torch.Tensor, *, after: Any = None) -> None:
        """``t``'s contents are no longer needed (a buffer given back, a slot dropped), once
        ``after`` has happened. The test device poisons it."""

    def peak_bytes(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def check_capacity(
        self,
        needs: dict[str, int],
        fix: str = "lower memory.device_slots, memory.keep_act_mib or memory.optim_device_mib",
    ) -> None:
        """Raise ``ConfigError`` at start when the device cannot hold ``needs`` (bytes by
        what they are for; ``fix``: what to change, in the message). Host memory is the CPU's:
        its budgets are the config's."""

    def close(self) -> None:
        pass


class CudaDevice(Device):
    cuda = separate = pin = True

    def __init__(self, device: torch.device, *, direct: bool = False) -> None:
        super().__init__(device)
        self.direct = direct
        _, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a lower number is a higher priority
        self.up = torch.cuda.Stream(device, priority=high)
        self.down = torch.cuda.Stream(device, priority=high)
        self._aside: torch.cuda.Stream | None = None  # the update of states in device memory (``run_aside``)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def event(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _on(self, stream, after: Any, copy: Callable[[], object]) -> Any:
        for ev in _events(after):
            stream.wait_event(ev)
        with torch.cuda.stream(stream):
            copy()
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def upload(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Any:
        dst.record_stream(self.up)  # dst may be a fresh allocation of the compute stream
        return self._on(self.up, after, lambda: dst.copy_(src, non_blocking=True))

    def upload_new(self, src: torch.Tensor, *, after: Any = None) -> tuple[torch.Tensor, Any]:
        for ev in _events(after):
            self.up.wait_event(ev)
        with torch.cuda.stream(self.up):  # allocated by the upload stream: no queued compute owns the block
            d = torch.empty_like(src, device=self.device)
            d.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(self.up)
        d.record_stream(torch.cuda.current_stream(self.device))  # used, then freed, by the compute stream
        return d, ev

    def run_aside(self, fn: Callable[[], object]) -> Any:
        if self._aside is None:  # made on first use: runs that keep no state on the device make none
            self._aside = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._aside):  # this thread's current stream only
            fn()
        ev = torch.cuda.Event()
        ev.record(self._aside)
        return ev

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.synchronize()

    def download(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Any:
        after = [self.event(), *_events(after)]
        src.record_stream(self.down)  # keep-alive: not reused by the allocator before this copy ran
        return self._on(self.down, after, lambda: dst.copy_(src, non_blocking=True))

    def wait(self, ev: Any) -> None:
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def sync(self, ev: Any) -> None:
        if ev is not None:
            self.sync_points += 1
            if not ev.query():
                self.syncs += 1  # counted: the host had to wait
            # Always synchronize, even when the query said done: PyTorch's CUDA sanitizer models
            # ``synchronize`` as the host's happens-before edge, not a query, and would report a
            # buffer reused after a query alone as a race. On a completed event it returns at once.
            ev.synchronize()

    def done(self, ev: Any) -> bool:
        """Whether ``ev`` has happened, without blocking. When it has, the host synchronizes
        with it (returns at once) so that what the caller then reuses is ordered after it for
        the CUDA sanitizer too (a query is not a synchronization to it)."""
        if ev is None:
            return True
        if not ev.query():
            return False
        ev.synchronize()
        return True

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def check_capacity(
        self,
        needs: dict[str, int],
        fix: str = "lower memory.device_slots, memory.keep_act_mib or memory.optim_device_mib",
    ) -> None:
        from ..config import ConfigError

        free, total = torch.cuda.mem_get_info(self.device)
        need = sum(needs.values())
        if need > 0.9 * free:  # the rest: one micro-batch's activations, the allocator's slack
            parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in needs.items())
            raise ConfigError(
                f"the GPU ({torch.cuda.get_device_name(self.device)}) has {free / 2**30:.2f} GiB free of "
                f"{total / 2**30:.2f} GiB; this run needs {need / 2**30:.2f} GiB there before activations ({parts}): "
                f"{fix}"
            )


def _events(after: Any) -> list:
    """The events of an ``after`` argument (None, one event, or a list with Nones)."""
    if after is None:
        return []
    if isinstance(after, (list, tuple)):
        return [e for e in after if e is not None]
    return [after]


def make_device(name: str, gds: str = "off", *, world: int = 1) -> Device:
    """The device ``train.device`` names (after ``resolve_device``); on CUDA, reading files
    straight into its memory as ``io.gds`` says, with one rank (``world``) only: ranks gather
    each unit over Gloo in host memory, which a direct read into device memory would bypass."""
    if world > 1 and gds == "on":
        from ..config import ConfigError

        raise ConfigError(
            f"io.gds = 'on' with {world} ranks: ranks gather every unit over Gloo in host memory, "
            "which GPUDirect Storage reads into device memory would bypass; use --io.gds=off "
            "(or 'auto', which reads through pinned host memory with ranks)"
        )
    dev = resolve_device(name)
    if dev.type != "cuda":
        return Device(dev)
    return CudaDevice(dev, direct=world == 1 and _gds_usable(gds))


def _gds_usable(mode: str) -> bool:
    from ..config import ConfigError
    from ..io import gds

    if mode == "off":
        return False
    try:
        import kvikio  # noqa: F401
    except ImportError:
        if mode == "on":
            raise ConfigError(
                f"io.gds='on' but kvikio is not installed: pip install {gds.kvikio_package()} "
                "(or carry its wheels to a machine without network: bench/gpu_window/wheels.sh), "
                "or set --io.gds=auto"
            ) from None
        return False
    return gds.enabled()
