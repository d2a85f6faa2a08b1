"""The update path of a frozen model: nothing to update, the parameters alone.

With adapters (``[adapter]``) every unit of the model is frozen: no unit forms a gradient and
none has optimizer state, so the only state is the parameters' backing copy (host memory within
``memory.host_param_mib``, else ``params.bin``), written once at initialisation and then only
read. No gradient files, no master copy, no moments, no update buffers: the scratch space and
memory of a LoRA run on a model of any size are the base's parameters in their dtype
(``model.base_dtype``: narrower than the compute's, each unit upcast as it is loaded).
Chosen by the planner for adapter runs (``update.mode = 'auto'``); the adapters' own update
runs in the trainer (``adapters/train.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..config import Config
from ..io import IOFuture, Storage
from ..io.align import round_down
from ..state.decl import Region, StateDecl
from ..state.layout import FlatLayout
from ..state.quant import ByteShards, DequantSource, QuantLayout, base_storage
from ..state.regions import TieredRegions
from .base import GradSink, ParamSource, Update, UpdateStats
from .baseline import RegionParams

__all__ = ["FrozenUpdate"]

MIB = 1 << 20
OWNER = "update (frozen)"


WIDEN_TAIL = 1 << 20  # elements: below this the rest of a unit is widened through a copy


def widen_in_place(out: torch.Tensor, narrow_offset: int, dtype: torch.dtype) -> None:
    """Widen a unit read in ``dtype`` into the back of ``out``'s own bytes (from byte
    ``narrow_offset``) into ``out``, front to back. Element ``i`` of ``out`` ends at byte
    ``e_out * (i + 1)`` and the narrow elements not yet read start at ``narrow_offset + e_in * i``,
    so each chunk is taken as large as keeps its destination before its source: the chunks
    halve (fp32 from bf16), and the last ``WIDEN_TAIL`` elements go through a small copy."""
    n, e_out, e_in = out.numel(), out.element_size(), dtype.itemsize
    raw = out.view(torch.uint8)
    narrow = raw[narrow_offset : narrow_offset + n * e_in].view(dtype)
    a = 0
    while a < n:
        b = min(n, (narrow_offset + e_in * a) // e_out)
        if n - a <= WIDEN_TAIL or b - a < WIDEN_TAIL // 4:
            out[a:].copy_(narrow[a:].clone())
            return
        out[a:b].copy_(narrow[a:b])  # destination bytes [e_out*a, e_out*b) end before the source's
        a = b


class _Upcast(ParamSource):
    """The frozen model kept in a narrower dtype than the compute's: each unit is read into the
    back half of its own slot (its narrow bytes fit there, at an aligned offset, so O_DIRECT
    reads into it) and widened in place once the read is done (``widen_in_place``, in the thread
    that waits for it: in an I/O thread it took the reads' CPU on 2 cores, measured slower).
    No staging memory beyond the slots. Never zero-copy: a host-resident unit is converted like
    a read one."""

    file_backed = True

    def __init__(self, inner: ParamSource, dtype: torch.dtype) -> None:
        self.inner, self.dtype = inner, dtype

    @property
    def ordered(self) -> bool:  # type: ignore[override]
        """Loads in the schedule's order alone where the units are gathered from ranks."""
        return bool(getattr(self.inner, "ordered", False))

    def on_host(self, u: int) -> bool:
        return False  # its bytes are not the slot's dtype: always loaded, converted

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("a converted unit has no host view")

    def loaded_bytes(self, u: int, numel: int, itemsize: int) -> int:
        return numel * self.inner.dtype.itemsize  # its narrow bytes

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        src = self.inner.dtype
        if self.inner.on_host(u):  # upcast straight from host memory
            out.copy_(self.inner.host_view(u))
            return IOFuture.completed(out.numel() * src.itemsize)
        n = out.numel()
        offset = round_down(n * (out.element_size() - src.itemsize))  # aligned, as the slot's start
        buf = out.view(torch.uint8)[offset : offset + n * src.itemsize].view(src)
        return self.inner.load(u, buf).then(lambda: widen_in_place(out, offset, src))


class _NoGrads(GradSink):
    """No unit of a frozen model has a gradient: anything handed here is a bug."""

    dtype = torch.float32
    file_backed = False

    def on_host(self, u: int) -> bool:
        raise RuntimeError(f"unit {u} handed a gradient, but every unit is frozen")

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError(f"unit {u} handed a gradient, but every unit is frozen")

    def write(self, u: int, src: torch.Tensor):
        raise RuntimeError(f"unit {u} handed a gradient, but every unit is frozen")


class FrozenUpdate(Update):
    name = "frozen"
    # No gradient of the model is formed: initialisation holds the most, a unit in the base's
    # dtype and its source's tensors.
    working_units = 2
    # A step forms no gradient of the base and widens in the slots: its unit steps hold
    # activations only (measured: trimming the heap as if they held two units cost the 2.46 B
    # Llama's LoRA step at a fifth of peft's RSS 11-18%, the pages faulted in afresh).
    step_working_units = 0

    @classmethod
    def fixed_pools(cls, cfg: Config, rt) -> dict[str, int]:
        """None: a narrower model is widened inside the slots (``widen_in_place``)."""
        return {}

    @classmethod
    def declare(
        cls, cfg: Config, layout: FlatLayout, pdtype: torch.dtype, align: int, paths: list[str]
    ) -> list[StateDecl]:
        stored, dtype = base_storage(cfg, layout, pdtype, align)
        return [
            TieredRegions.declare(
                stored,
                "params.bin",
                dtype,
                cfg.memory.host_param_mib * MIB,
                align,
                name="params",
                owner=OWNER,
                checkpointed=True,
                weights=True,
            )
        ]

    def __init__(
        self, cfg: Config, layout: FlatLayout, storage: Storage, pdtype: torch.dtype, *, pin: bool, dev=None
    ) -> None:
        self.cfg, self.layout = cfg, layout
        self.states = self.declare(cfg, layout, pdtype, storage.record_align, storage.paths)
        stored, _ = base_storage(cfg, layout, pdtype, storage.record_align)
        self.shards = stored if isinstance(stored, ByteShards) else None  # a rank's share of the records
        self.quant = stored.full if self.shards is not None else stored if isinstance(stored, QuantLayout) else None
        self._params = TieredRegions(stored, storage, self.states[0], pin=pin)
        params = RegionParams(self._params)
        if self.quant is not None:
            # with ranks the records are gathered whole first (``gather_shards``)
            self.params: ParamSource = DequantSource(self._params, self.quant, pdtype)
        else:
            self.params = params if self._params.dtype == pdtype else _Upcast(params, pdtype)
        self.grads = _NoGrads()
        # initial weights go straight into the base's dtype (a 4-bit base: quantized from the compute dtype's)
        self.init_dtype = pdtype if self.quant is not None else self._params.dtype

    @property
    def narrow_shards(self) -> bool:
        """With ranks, the base is gathered as it is stored (quantized bytes, narrower elements)
        and converted after: ``gather_shards`` wraps its reads, not the trainer's usual wrap."""
        return self.shards is not None or (isinstance(self.params, _Upcast) and getattr(self.layout, "world", 1) > 1)

    def gather_shards(self, group) -> None:
        """The base's reads through ``group``'s gathers, before the conversion: a quantized
        base's records (``ByteShards``) before they are dequantized, a narrower base's units
        before they are widened (the link carries the stored bytes)."""
        if self.shards is not None:
            assert isinstance(self.params, DequantSource)
            self.params.region = group.gather_records(RegionParams(self._params), self.shards)
        else:
            self.params = _Upcast(group.gather_units(RegionParams(self._params), self.layout), self.params.dtype)

    @property
    def init_whole(self) -> bool:
        """``init_unit`` takes whole units (a rank quantizes the unit, then keeps its bytes' share)."""
        return self.shards is not None

    def init_unit(self, u: int, flat32: torch.Tensor) -> None:
        if self.quant is not None:
            record = self.quant.quantize(u, flat32)
            if self.shards is not None:
                record = self.shards.shard(u, record)
            self._params.write(u, record).get()
            return
        d = self._params.dtype
        self._params.write(u, flat32 if flat32.dtype == d else flat32.to(d)).get()

    def step(self, step: int, lr: float, clip_coef: torch.Tensor | None) -> UpdateStats:
        return UpdateStats()

    @contextlib.contextmanager
    def regions(self) -> Iterator[dict[str, Region]]:
        yield {"params": self._params}

    def pools(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._params.close()
