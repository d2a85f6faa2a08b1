"""Flat per-unit layout of parameters.

Every unit's parameters are packed into one flat buffer:

- each parameter starts at a multiple of ``PARAM_ALIGN`` (64) elements. torch's fused
  AdamW treats the last ``n % vector_width`` elements of a tensor differently from the
  rest, so an optimizer chunk may only cut a parameter at a multiple of 64 elements from
  its start to give bit-identical results to updating the whole tensor at once;
- each unit starts at a multiple of ``UNIT_ALIGN`` (2048) elements, so in every state
  file (2- or 4-byte elements) a unit begins on a 4 KiB boundary and can be read and
  written with O_DIRECT straight into aligned buffers; the runtime pads units further, to
  whole checksum blocks (``chunk_align``), so that a unit's record also ends on one.

The same element offsets are used for parameters, gradients, master weights and
optimizer moments; only the element size differs between files.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..models.base import LayeredModel, is_placeholder, unit_param_names
from .quant import quantizable

__all__ = ["PARAM_ALIGN", "UNIT_ALIGN", "ParamRecord", "UnitLayout", "FlatLayout", "segments", "chunk_align"]

PARAM_ALIGN = 64
UNIT_ALIGN = 2048


def chunk_align(record_align: int, dtype: torch.dtype) -> int:
    """Elements at which an optimizer chunk or an engine's slice may start, in a unit whose
    parameters are ``dtype``: a multiple of ``UNIT_ALIGN`` (so of 64 elements from every
    parameter's start: the fused kernel stays exact) that also starts a whole checksum block
    (``record_align`` bytes) in the files of every state (2- or 4-byte elements)."""
    return max(UNIT_ALIGN, record_align // min(dtype.itemsize, 4))


def segments(params, start: int, end: int) -> list:
    """Pieces ``(record, a, b)`` of the parameters (anything with ``offset`` and ``numel``)
    inside elements ``[start, end)``.

    ``start`` must be a multiple of ``PARAM_ALIGN`` so that every cut falls at a multiple of
    64 elements from the start of the parameter it cuts (parameters start on such multiples).
    """
    if start % PARAM_ALIGN:
        raise ValueError(f"chunk start {start} is not a multiple of {PARAM_ALIGN}")
    out = []
    for rec in params:
        a, b = max(start, rec.offset), min(end, rec.offset + rec.numel)
        if a < b:
            out.append((rec, a, b))
    return out


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class ParamRecord:
    """Where one parameter lives inside its unit's flat buffer."""

    name: str
    param: nn.Parameter = field(repr=False, compare=False)
    shape: torch.Size
    offset: int  # elements from the start of the unit
    numel: int
    # a row piece's whole matrix's elements (vocabulary pieces, ranges of experts: what decides
    # whether bitsandbytes keeps 8-bit moments of it); its own numel for a whole parameter
    whole: int = 0

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.numel].view(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    index: int
    params: tuple[ParamRecord, ...]
    numel: int  # padded to UNIT_ALIGN
    offset: int  # elements from the start of the whole layout
    borrows: tuple[int, ...]  # units whose (tied) parameters this unit also uses
    frozen: bool = False  # none of its parameters requires a gradient (train.freeze): never trained

    @property
    def used(self) -> int:
        """Elements that hold parameters (the rest is alignment padding)."""
        return sum(p.numel for p in self.params)

    def fill(self, values: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
        """The unit's flat buffer (``flat``, at least ``numel`` long) from its parameters' tensors
        by name, each checked against the model's shape; the alignment padding zeroed."""
        from ..errors import ConfigError

        flat[: self.numel].zero_()
        for rec in self.params:
            t = values[rec.name]
            if tuple(t.shape) != tuple(rec.shape):
                raise ConfigError(
                    f"weights for {rec.name} have shape {tuple(t.shape)}, the model expects {tuple(rec.shape)}"
                )
            flat[rec.offset : rec.offset + rec.numel].copy_(t.reshape(-1))


class FlatLayout:
    """The flat layout of a ``LayeredModel``: units, their sizes and global offsets."""

    def __init__(self, model: LayeredModel, unit_align: int = UNIT_ALIGN, param_align: int = PARAM_ALIGN) -> None:
        """``unit_align``: elements every unit is padded to (a multiple of ``UNIT_ALIGN``; the
        runtime gives ``chunk_align``, so that with checksums a unit's record ends on a whole
        checksum block: its reads and writes then go straight between the file and the
        caller's buffer, never through a bounce buffer or a read-modify-write).
        ``param_align``: elements every parameter starts on (a multiple of ``PARAM_ALIGN``
        dividing ``unit_align``; 8-bit optimizer states: their 256-element blocks)."""
        if unit_align % UNIT_ALIGN:
            raise ValueError(f"unit_align {unit_align} is not a multiple of {UNIT_ALIGN}")
        if param_align % PARAM_ALIGN or unit_align % param_align:
            raise ValueError(f"param_align {param_align}: not a multiple of {PARAM_ALIGN} dividing {unit_align}")
        owned = unit_param_names(model)
        pieces = getattr(model, "row_pieces", {})
        owner = {id(p): u for u, own in enumerate(owned) for _, p in own}
        units, offset = [], 0
        for u, own in enumerate(owned):
            recs, pos = [], 0
            for name, p in own:
                whole = math.prod(pieces[name].whole_shape) if name in pieces else p.numel()
                recs.append(ParamRecord(name, p, p.shape, pos, p.numel(), whole))
                pos = _up(pos + p.numel(), param_align)
            numel = max(_up(pos, unit_align), unit_align)
            borrows = tuple(sorted({owner[id(p)] for p in model.units[u].parameters()} - {u}))
            # none of the parameters it computes with (its own, or borrowed: a tied head's pieces)
            # requires a gradient: nothing of it is trained (a unit with none at all, an embedding
            # cut into pieces, neither: it has no gradient or update to wait for)
            frozen = not any(p.requires_grad for p in model.units[u].parameters())
            units.append(UnitLayout(u, tuple(recs), numel, offset, borrows, frozen))
            offset += numel
        self.units: list[UnitLayout] = units
        self.total_numel = offset
        self.max_unit_numel = max(x.numel for x in units)
        self.n_params = sum(x.used for x in units)
        # the parameters a 4-bit base quantizes (model.base_dtype 'nf4'/'fp4': quant.QuantLayout)
        self.quantizable = frozenset(quantizable(model))
        # (unit, record) of every parameter in the whole model's order where units do not follow
        # it (layers cut into sub-layer units): the gradient norm sums in that order
        self.norm_order: list[tuple[int, int]] | None = None
        order = model.param_order()
        if order is not None:
            rank = {pid: k for k, pid in enumerate(order)}
            placed = [(unit.index, k, rec) for unit in units for k, rec in enumerate(unit.params)]
            self.norm_order = [(r[0], r[1]) for r in sorted(placed, key=lambda r: rank[id(r[2].param)])]

    def __len__(self) -> int:
        return len(self.units)

    def bind(self, u: int, flat: torch.Tensor) -> None:
        """Point unit ``u``'s own parameters at views of ``flat`` (its slot)."""
        for rec in self.units[u].params:
            rec.param.data = rec.view(flat)

    def bind_grads(self, u: int, flat: torch.Tensor | None) -> None:
        """Make the parameters' ``.grad`` views of ``flat`` (accumulated in place), or unset them.
        Only for parameters bound to a slot: a placeholder lives on the host, and a device
        gradient on it is refused by torch (on CUDA only; here on every device, so CPU runs
        catch it)."""
        for rec in self.units[u].params:
            if flat is not None and is_placeholder(rec.param.data):
                raise RuntimeError(
                    f"a gradient bound to {rec.name} of unit {u}, which is not bound to a slot (a host "
                    "placeholder): write the unit's gradient buffer directly (GradStore.views)"
                )
            rec.param.grad = None if flat is None else rec.view(flat)

    def segments(self, u: int, start: int, end: int) -> list[tuple[ParamRecord, int, int]]:
        return segments(self.units[u].params, start, end)

    def shard(self, u: int, full: torch.Tensor) -> torch.Tensor:
        """This process's share of unit ``u``'s flat buffer ``full``: all of it (one rank; a
        rank's share of a sharded layout is ``dist.shard.ShardLayout.shard``)."""
        return full[: self.units[u].numel]

    @functools.cached_property
    def fingerprint(self) -> str:
        """Every parameter's name, shape and place (unit, offset) in a line: its count, its
        elements and a hash of the rest. Two models whose units pad to the same sizes (a tied
        head against an untied one, renamed modules) read differently here."""
        import hashlib
        import json

        recs = [[u.index, r.name, list(r.shape), r.offset] for u in self.units for r in u.params]
        digest = hashlib.sha256(json.dumps(recs).encode()).hexdigest()[:16]
        return f"{len(recs)} tensors of {self.n_params:,} elements, sha256 {digest}"

    def describe_frozen(self, selectors: list[str]) -> str:
        """The frozen units and their parameters (``train.freeze``), in one line."""
        frozen = [u for u in self.units if u.frozen and u.params]
        n = sum(u.used for u in frozen)
        # the embedding's and the head's units by name: the head's holds the final norm too (its
        # unit's), which 'head' freezes with lm_head (a user freezing lm_head alone expected it trained)
        ends = [(s, u) for s, u in (("embed", self.units[0]), ("head", self.units[-1])) if s in selectors and u.frozen]
        named = "".join(f"; {s}: {', '.join(p.name for p in u.params)}" for s, u in ends)
        return (
            f"frozen (train.freeze = {', '.join(selectors)}): {len(frozen)} of {len(self.units)} units, "
            f"{n / 1e6:.2f} M of {self.n_params / 1e6:.2f} M parameters: read, never trained or written{named}"
        )

    def describe(self) -> str:
        return (
            f"{len(self.units)} units, {self.n_params / 1e6:.2f} M parameters, "
            f"largest unit {self.max_unit_numel / 1e6:.2f} M elements"
        )
