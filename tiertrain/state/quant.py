"""A frozen base kept quantized (``model.base_dtype = 'nf4' | 'fp4' | 'int8'``): bitsandbytes' formats.

What is quantized is what transformers' bitsandbytes integration quantizes when a user loads a
model with ``BitsAndBytesConfig(load_in_4bit=True)`` or ``load_in_8bit=True``: the weight of
every ``nn.Linear`` inside the decoder blocks (not the embedding, not the output head, not norms
or biases).

- 4-bit (``nf4``, ``fp4``): in blocks of 64 values with one scale each (``absmax``), the scales
  themselves quantized to 8 bits in blocks of 256 with ``model.base_double_quant``
  (bitsandbytes' ``bnb_4bit_use_double_quant``). The quantization is bitsandbytes' own
  (``quantize_4bit``), from the weights in the compute dtype, as transformers quantizes the
  weights it loaded in the model's dtype; so is the dequantization (``dequantize_4bit``). On
  CPU, with fp32 compute, ``F.linear`` of the dequantized weight is ``Linear4bit``'s forward
  and backward bit for bit (bitsandbytes dequantizes there too): a LoRA run on a quantized base
  is peft's QLoRA bit for bit.
- ``int8`` (LLM.int8()): each output row's weights to int8 with one fp32 scale (``SCB``, the
  row's absolute maximum), by bitsandbytes' ``int8_vectorwise_quant`` from the weights in
  float16, as ``Int8Params`` quantizes them. Dequantized as ``Linear8bitLt`` does in training
  (``CB * (SCB / 127)`` in the compute dtype, then ``F.linear``: bit for bit on CPU in fp32).
  bitsandbytes' eval-mode kernel quantizes the activations too (int8 matmul, fp16 outliers
  above 6.0), about 0.6% relative away; evaluation and generation here keep the training
  forward.

Layout (``QuantLayout``): a unit of the base is one record of bytes. A unit with a quantized
weight holds, per parameter in the unit's order, either its codes (packed 4-bit, or one byte),
its scales (and with double quantization the scales' own scales and offset), or, for a parameter left as it is,
its bytes in the compute dtype; each piece starts on 64 bytes. A unit with nothing quantized
(the embedding, the head) is the plain unit's bytes. Units end on ``align`` bytes (whole
checksum blocks, as every unit of every state).

A quantized unit is read into the back of its own compute slot and dequantized into the front
(``dequantize_into``): no staging memory beyond one weight's dequantized copy (bitsandbytes'
CPU kernel takes no output buffer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..io import IOFuture
from ..io.align import round_down
from .sources import ParamSource

__all__ = [
    "QUANTIZED",
    "QuantSpec",
    "QuantLayout",
    "ByteShards",
    "DequantSource",
    "quant_spec",
    "require_bitsandbytes",
    "base_storage",
]

QUANTIZED = ("nf4", "fp4", "int8")
BLOCK = 64  # values per scale: bitsandbytes' 4-bit default (transformers' integration never changes it)
BLOCK2 = 256  # scales per scale of the scales (double quantization), bitsandbytes' fixed choice
PIECE_ALIGN = 64  # bytes: every piece of a unit starts here (fp32 views of the scales stay aligned)


def require_bitsandbytes(what: str):
    """bitsandbytes' ``functional`` module, or an error that names ``what`` needs it and the fix."""
    try:
        return _bnb()
    except ImportError as exc:
        from ..config import ConfigError

        raise ConfigError(
            f"{what} needs bitsandbytes (its formats and kernels), which does not import here "
            f"({type(exc).__name__}: {exc}): pip install 'bitsandbytes>=0.50' (or tiertrain[qlora])"
        ) from None


@functools.cache
def _bnb():
    """Imported once (the dequantization calls it per weight, on the path that waits for a unit)."""
    import bitsandbytes.functional as F

    return F


@dataclass(frozen=True)
class QuantSpec:
    """How the base is quantized: ``kind`` ('nf4', 'fp4' or 'int8'), ``double`` (4-bit scales
    quantized too)."""

    kind: str
    double: bool = False

    @property
    def int8(self) -> bool:
        return self.kind == "int8"

    def describe(self) -> str:
        if self.int8:
            return "int8 (bitsandbytes' LLM.int8() weights, one scale a row)"
        return f"{self.kind}{' with double quantization' if self.double else ''} (bitsandbytes, blocks of {BLOCK})"


def quant_spec(model_cfg) -> QuantSpec | None:
    """The spec of ``[model]`` (``base_dtype``, ``base_double_quant``), None for a float base."""
    if model_cfg.base_dtype not in QUANTIZED:
        return None
    return QuantSpec(model_cfg.base_dtype, bool(model_cfg.base_double_quant))


def base_storage(cfg, layout, dtype: torch.dtype, align: int):
    """(the layout a frozen base is stored in, its element dtype) for ``cfg`` computed in ``dtype``
    over ``layout``: the layout itself in ``model.base_dtype`` (the compute dtype unless
    narrower), or a quantized base's ``QuantLayout`` of bytes. What the frozen update path builds,
    the budget places and the cost model reads."""
    from ..device.core import base_dtype_of

    spec = quant_spec(cfg.model)
    if spec is None:
        return layout, base_dtype_of(cfg.model.base_dtype, dtype)
    world = getattr(layout, "world", 1)
    if world > 1:  # a rank's shard (``dist/shard.py``): its share of every unit's record, in bytes
        full = QuantLayout(layout.full, spec, dtype, align * world)
        return ByteShards(full, layout.rank, world, QuantLayout(layout.canonical, spec, dtype, align)), torch.uint8
    return QuantLayout(layout, spec, dtype, align), torch.uint8


@dataclass(frozen=True)
class _Share:
    """A rank's bytes ``[start, end)`` of unit ``index``'s record: as a unit of its own layout
    (``index``, ``numel``) and as a slice of the whole record (``start``, ``end``)."""

    index: int
    start: int
    end: int
    params: tuple = ()
    frozen: bool = True

    @property
    def numel(self) -> int:
        return self.end - self.start


class ByteShards:
    """Rank ``rank``'s share of a quantized base's records (``full``: a ``QuantLayout`` whose
    units, of bytes, are padded to ``world`` x the record alignment): an equal 1/N of every
    unit's bytes, as ``dist/shard.py``'s ``ShardLayout`` shares elements; a layout of its own
    (``units``) and the slices of the whole (``slices``). A unit is gathered whole (bytes) before
    it is dequantized. ``canonical``: the one-rank ``QuantLayout`` checkpoints are written in
    (its pieces at the same offsets, its units padded for one rank)."""

    def __init__(self, full: "QuantLayout", rank: int, world: int, canonical: "QuantLayout") -> None:
        self.units: list[_Share] = []
        for unit in full.units:
            if unit.numel % world:
                raise ValueError(f"unit {unit.index}'s record has {unit.numel} bytes: not {world} equal shards")
            per = unit.numel // world
            self.units.append(_Share(unit.index, rank * per, (rank + 1) * per))
        self.slices = self.units
        self.full, self.rank, self.world, self.canonical = full, rank, world, canonical
        self.total_numel = sum(u.numel for u in self.units)
        self.max_unit_numel = max((u.numel for u in self.units), default=0)

    def __len__(self) -> int:
        return len(self.units)

    def shard(self, u: int, full: torch.Tensor) -> torch.Tensor:
        s = self.units[u]
        return full[s.start : s.end]

    def of_rank(self, rank: int) -> "ByteShards":
        return ByteShards(self.full, rank, self.world, self.canonical)


def same_base(ours: dict, compute_dtype: str, man, where: str) -> None:
    """Refuse to continue a run whose frozen base is kept in another quantized format (``ours``: this
    run's ``[model]`` section; ``man``: the checkpoint's manifest): its records would be read as
    another format's, or found corrupt. Named before any state is read."""

    def fmt(m: dict, dtype: str) -> tuple | None:
        if m.get("base_dtype") not in QUANTIZED:
            return None
        return m["base_dtype"], bool(m.get("base_double_quant")), dtype

    theirs, mine = fmt(man.config.get("model", {}), man.compute_dtype), fmt(ours, compute_dtype)
    if theirs is None and mine is None:
        return
    if theirs is not None and mine is not None and (theirs[:2] == mine[:2]) and theirs[2] in ("", mine[2]):
        return

    def say(f: tuple | None) -> str:
        if f is None:
            return "in its float dtype"
        return f"in {f[0]}{' with double quantization' if f[1] else ''}, made in {f[2] or '?'}"

    from ..config import ConfigError

    raise ConfigError(
        f"{where} keeps its frozen base {say(theirs)}; this run would keep it {say(mine)}: resume with the "
        "model.base_dtype, model.base_double_quant and train.param_dtype it was made with"
    )


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class _Piece:
    """Where one parameter of a unit is in its bytes: ``raw`` (the compute dtype's bytes) or
    quantized (codes, scales, and the scales' scales and offset with double quantization)."""

    rec: Any  # layout.ParamRecord
    quantized: bool
    start: int  # bytes from the unit's start
    codes: int = 0
    scales: int = 0
    scales2: int = 0
    offset: int = 0
    end: int = 0

    @property
    def blocks(self) -> int:
        return -(-self.rec.numel // BLOCK)


@dataclass(frozen=True)
class QuantUnit:
    index: int
    numel: int  # bytes (the region's dtype is uint8), padded to ``align``
    offset: int  # bytes from the start of the whole layout (a checkpoint's file)
    pieces: tuple[_Piece, ...]
    plain: bool  # nothing quantized: the plain unit's bytes (read straight into the slot)


def quantizable(model) -> set[int]:
    """``id`` of every parameter quantized: the weights of the blocks' modules that are exactly
    ``nn.Linear`` (transformers' bitsandbytes integration converts those and not subclasses: a
    Phi-MoE or Llama 4 router stays), less those in the model's ``_keep_in_fp32_modules``."""
    hf = getattr(model, "hf_model", None)
    keep = set(getattr(hf, "_keep_in_fp32_modules", None) or ())
    out = set()
    for block in model.blocks:
        for name, mod in block.named_modules():
            if type(mod) is nn.Linear and not keep & set(name.split(".")):
                out.add(id(mod.weight))
    return out


class QuantLayout:
    """The base's units in ``spec``'s format, laid over ``layout`` (a ``FlatLayout``: its
    ``quantizable`` parameters are quantized) computed in ``dtype``; units padded to ``align`` bytes. ``units[u].numel`` are bytes, so a
    ``TieredRegions`` of ``torch.uint8`` holds them."""

    def __init__(self, layout, spec: QuantSpec, dtype: torch.dtype, align: int) -> None:
        self.spec, self.dtype, self.flat = spec, dtype, layout
        wanted = layout.quantizable
        e = dtype.itemsize
        self.units: list[QuantUnit] = []
        self.quantized_params = 0
        end = 0  # bytes of the units before this one
        for unit in layout.units:
            if not any(id(r.param) in wanted for r in unit.params):
                self.units.append(QuantUnit(unit.index, unit.numel * e, end, (), True))
                end += unit.numel * e
                continue
            pieces, pos = [], 0
            for r in unit.params:
                if id(r.param) not in wanted:
                    pieces.append(_Piece(r, False, pos, end=pos + r.numel * e))
                else:
                    self.quantized_params += r.numel
                    pieces.append(self._quantized_piece(r, pos))
                pos = _up(pieces[-1].end, PIECE_ALIGN)
            size = max(_up(pos, align), align)
            if size > unit.numel * e:
                from ..config import ConfigError

                raise ConfigError(
                    f"model.base_dtype = {spec.kind!r}: unit {unit.index}'s quantized record ({size} bytes) is larger "
                    f"than the unit in {dtype} ({unit.numel * e} bytes), its linear layers too small to quantize; "
                    "use model.base_dtype = 'bfloat16'"
                )
            self.units.append(QuantUnit(unit.index, size, end, tuple(pieces), False))
            end += size
        self.total_numel = end
        self.max_unit_numel = max(u.numel for u in self.units)

    def _quantized_piece(self, r, pos: int) -> _Piece:
        codes = pos
        if self.spec.int8:  # one byte a weight, then one fp32 scale a row
            scales = _up(codes + r.numel, PIECE_ALIGN)
            return _Piece(r, True, pos, codes, scales, end=scales + 4 * r.shape[0])
        nb = -(-r.numel // BLOCK)
        scales = _up(codes + (r.numel + 1) // 2, PIECE_ALIGN)
        if not self.spec.double:
            return _Piece(r, True, pos, codes, scales, end=scales + 4 * nb)
        scales2 = _up(scales + nb, PIECE_ALIGN)
        offset = _up(scales2 + 4 * (-(-nb // BLOCK2)), PIECE_ALIGN)
        return _Piece(r, True, pos, codes, scales, scales2, offset, end=offset + 4)

    def describe(self) -> str:
        n = self.flat.n_params
        # the parameters' own bytes (codes and scales; the whole units are padded to the storage
        # tier's alignment, which on a small model hides the saving)
        e = self.dtype.itemsize
        held = sum(
            sum(r.numel * e for r in self.flat.units[u.index].params)
            if u.plain
            else sum(p.end - p.start for p in u.pieces)
            for u in self.units
        )
        return (
            f"base in {self.spec.describe()}: {self.quantized_params / 1e6:.2f} M of {n / 1e6:.2f} M parameters "
            f"quantized, {held / 2**20:,.1f} MiB against {n * self.dtype.itemsize / 2**20:,.1f} MiB unquantized "
            f"({self.total_numel / 2**20:,.1f} MiB stored in aligned units)"
        )

    def through(self, source):
        """``source`` (a ``WeightSource``) with every unit's weights quantized and dequantized as
        loaded: the base as a run on it computes (forward-only runs, which keep the compute dtype)."""
        from ..models.base import WeightSource

        def load(u: int, names: list[str]) -> dict[str, torch.Tensor]:
            unit = self.flat.units[u]
            values = source.load(u, names)
            flat = torch.zeros(unit.numel, dtype=self.dtype)
            for r in unit.params:
                flat[r.offset : r.offset + r.numel].copy_(values[r.name].reshape(-1))
            out = torch.empty_like(flat)
            self.dequantize_into(u, self.quantize(u, flat), out)
            return {r.name: r.view(out) for r in unit.params}

        return WeightSource(
            describe=f"{source.describe}, in {self.spec.describe()}", load=load, adapters=source.adapters,
            dequantized=True,
        )  # fmt: skip

    # -- bytes <-> weights -----------------------------------------------------------------------------------
    def quantize(self, u: int, flat: torch.Tensor) -> torch.Tensor:
        """Unit ``u``'s bytes from its flat weights ``flat`` (any float dtype: quantized from
        their values in the compute dtype, as transformers quantizes the weights it loaded)."""
        unit = self.units[u]
        flat = flat.to(self.dtype)
        if unit.plain:
            return flat.view(torch.uint8)
        F = require_bitsandbytes(f"model.base_dtype = {self.spec.kind!r}")
        out = torch.zeros(unit.numel, dtype=torch.uint8)
        for p in unit.pieces:
            w = p.rec.view(flat)
            if not p.quantized:
                out[p.start : p.end].copy_(w.reshape(-1).view(torch.uint8))
                continue
            if self.spec.int8:  # as Int8Params: from the weights in float16
                cb, scb, _ = F.int8_vectorwise_quant(w.to(torch.float16).contiguous())
                out[p.codes : p.codes + cb.numel()].copy_(cb.reshape(-1).view(torch.uint8))
                out[p.scales : p.scales + 4 * scb.numel()].copy_(scb.float().view(torch.uint8))
                continue
            q, st = F.quantize_4bit(
                w.contiguous(), blocksize=BLOCK, compress_statistics=self.spec.double, quant_type=self.spec.kind
            )
            out[p.codes : p.codes + q.numel()].copy_(q.view(-1))
            out[p.scales : p.scales + st.absmax.numel() * st.absmax.element_size()].copy_(st.absmax.view(torch.uint8))
            if self.spec.double:
                a2 = st.state2.absmax.float()
                out[p.scales2 : p.scales2 + 4 * a2.numel()].copy_(a2.view(torch.uint8))
                out[p.offset : p.offset + 4].copy_(st.offset.float().reshape(1).view(torch.uint8))
        return out

    def dequantize_into(self, u: int, src: torch.Tensor, out: torch.Tensor) -> None:
        """Unit ``u``'s weights into ``out`` (its slot, the compute dtype) from its bytes ``src``.
        ``src`` may lie inside ``out``'s own bytes, behind the front: the pieces are written front
        to back, and once a piece's destination would reach bytes not yet consumed, the rest of
        ``src`` is copied aside first."""
        unit = self.units[u]
        if unit.plain:
            if src.data_ptr() != out.data_ptr():  # read into the slot itself: nothing to do
                out.view(torch.uint8)[: unit.numel].copy_(src[: unit.numel])
            return
        F = _bnb()  # checked at start (the runtime, quantize)
        raw = out.view(torch.uint8)
        base = src.data_ptr() - raw.data_ptr()  # src's place in out's bytes (overlap check), if inside
        inside = 0 <= base < raw.numel()
        shift = 0  # src's pieces were moved aside: their bytes from ``shift`` on are in ``src``
        e = self.dtype.itemsize
        for p in unit.pieces:
            dst_end = (p.rec.offset + p.rec.numel) * e
            if inside and dst_end > base + p.start:
                src, shift, inside = src[p.start :].clone(), p.start, False
            piece = src[p.start - shift : p.end - shift]
            w = p.rec.view(out)
            if not p.quantized:
                w.view(-1).copy_(piece.view(self.dtype))
                continue
            if self.spec.int8:  # Linear8bitLt's training forward: CB.to(dtype).mul_(SCB / 127), in place
                s = p.scales - p.start
                scb = piece[s : s + 4 * p.rec.shape[0]].view(torch.float32)
                w.copy_(piece[: p.rec.numel].view(torch.int8).view(p.rec.shape))
                w.mul_(scb.unsqueeze(1).mul(1.0 / 127.0))
                continue
            w.copy_(F.dequantize_4bit(self._codes(p, piece), self._state(p, piece)))

    def _codes(self, p: _Piece, piece: torch.Tensor) -> torch.Tensor:
        return piece[: (p.rec.numel + 1) // 2].view(-1, 1)

    def _state(self, p: _Piece, piece: torch.Tensor):
        F = _bnb()  # checked at start (the runtime, quantize)
        s = p.scales - p.start
        if not self.spec.double:
            absmax = piece[s : s + 4 * p.blocks].view(torch.float32)
            return F.QuantState(
                absmax, shape=p.rec.shape, code=_code(self.spec.kind, str(piece.device)), blocksize=BLOCK,
                quant_type=self.spec.kind, dtype=self.dtype,
            )  # fmt: skip
        s2, o = p.scales2 - p.start, p.offset - p.start
        state2 = F.QuantState(
            piece[s2 : s2 + 4 * (-(-p.blocks // BLOCK2))].view(torch.float32), code=_code2(str(piece.device)),
            blocksize=BLOCK2,
            dtype=torch.float32,
        )  # fmt: skip
        return F.QuantState(
            piece[s : s + p.blocks], shape=p.rec.shape, code=_code(self.spec.kind, str(piece.device)), blocksize=BLOCK,
            quant_type=self.spec.kind, dtype=self.dtype, offset=piece[o : o + 4].view(torch.float32)[0], state2=state2,
        )  # fmt: skip


class DequantSource(ParamSource):
    """Units kept quantized, read from ``records`` (a ``TieredRegions`` of the frozen base, or a
    forward-only run's file: ``read(u, buf)``, ``on_host(u)``, ``host_view(u)`` in
    ``QuantLayout`` units): each unit's bytes are read into the back of its slot (at an aligned offset, so O_DIRECT reads into it) and dequantized into its
    front. On CPU that happens once the read is done, on the thread that waits for it, as
    ``_Upcast`` widens; where device memory is separate only the quantized bytes are uploaded
    (``filled``) and the device dequantizes them in its slot when the unit is first bound
    (``finish_on_device``, on the compute stream). A host-resident unit is dequantized from its
    host bytes (on CPU) or copied into the staging's back (separate device). No memory beyond
    the slots and one weight's dequantized copy."""

    file_backed = True

    def __init__(self, records, quant: QuantLayout, dtype: torch.dtype, *, owns: bool = False) -> None:
        """``owns``: ``close`` closes ``records`` too (a forward-only run's copy)."""
        self.region, self.quant, self.dtype, self.owns = records, quant, dtype, owns
        self.on_device = False  # the device dequantizes (``attach``: device memory is separate)

    def attach(self, dev) -> None:
        self.on_device = dev.separate

    @property
    def ordered(self) -> bool:  # type: ignore[override]
        """Loads in the schedule's order alone where the records are gathered from ranks."""
        return bool(getattr(self.region, "ordered", False))

    def can_prefetch(self, u: int) -> bool:
        return True  # never updated

    def on_host(self, u: int) -> bool:
        return False  # its bytes are not the slot's values: always loaded, dequantized

    def host_view(self, u: int) -> torch.Tensor:
        raise RuntimeError("a quantized unit has no host view")

    def loaded_bytes(self, u: int, numel: int, itemsize: int) -> int:
        return self.quant.units[u].numel  # its quantized record

    def _back(self, u: int) -> tuple[int, int]:
        """(byte offset, bytes) of unit ``u``'s quantized record in the back of its slot."""
        q = self.quant.units[u].numel
        return round_down(self.quant.flat.units[u].numel * self.dtype.itemsize - q), q

    def load(self, u: int, out: torch.Tensor, slot: int | None = None) -> IOFuture:
        offset, q = self._back(u)
        buf = out.view(torch.uint8)[offset : offset + q]
        if self.region.on_host(u):
            if self.on_device:
                buf.copy_(self.region.host_view(u))
            else:
                self.quant.dequantize_into(u, self.region.host_view(u), out)
            return IOFuture.completed(q)
        if self.on_device:
            return self.region.read(u, buf)
        return self.region.read(u, buf).then(lambda: self.quant.dequantize_into(u, buf, out))

    def filled(self, u: int) -> list[tuple[int, int]] | None:
        if not self.on_device:
            return None
        offset, q = self._back(u)
        e = self.dtype.itemsize
        return [(offset // e, -(-(offset + q) // e))]

    def close(self) -> None:
        if self.owns:
            self.region.close()

    def finish_on_device(self, u: int, flat: torch.Tensor) -> None:
        if self.on_device:
            offset, q = self._back(u)
            self.quant.dequantize_into(u, flat.view(torch.uint8)[offset : offset + q], flat)


@functools.cache
def _code(kind: str, device: str = "cpu") -> torch.Tensor:
    """bitsandbytes' 4-bit code table of ``kind`` on ``device`` (made once)."""
    return require_bitsandbytes(f"model.base_dtype = {kind!r}").get_4bit_type(kind, device=device)


@functools.cache
def _code2(device: str = "cpu") -> torch.Tensor:
    """bitsandbytes' 8-bit dynamic map of the scales' quantization, on ``device`` (made once)."""
    return require_bitsandbytes("model.base_double_quant").create_dynamic_map(signed=True).to(device)
