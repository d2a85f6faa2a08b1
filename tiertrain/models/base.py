"""A causal LM cut into units: embed, blocks, head (with the loss).

tiertrain never holds a whole model in memory. A ``LayeredModel`` is a skeleton whose
parameters are zero-memory placeholders; the parameter store binds each unit's
parameters to views of a device slot just before the unit runs (``Parameter.data`` is
reassigned; the ``Parameter`` objects, their names and ties never change).

Contract of the unit kinds:
- ``embed(input_ids, positions=None) -> hidden``, which is ``embed.finish(tokens,
  positions)`` of the token embedding ``tokens = getattr(embed, embed.TOKENS)(input_ids)``;
  ``finish`` is affine in ``tokens`` (identity for Llama, positions and dropout for GPTs):
  its gradient does not depend on their values
- ``block(hidden, positions=None, cache=None) -> hidden``: ``positions`` are the tokens'
  positions (``[T]``; None: ``0 .. T-1``), from which position tables (rotary, learned) are
  made inside; the causal mask is the plain one for unpacked sequences; ``cache`` is None (a
  block's ``forward`` takes none: generation calls its ``decode`` with the block's key/value
  cache)
- ``head.logits(hidden) -> logits``, which is ``head.cap_logits(getattr(head,
  head.PROJ)(head.hidden(h)))`` (final norm, the output projection without a bias, then what
  the model's forward does to the logits: a soft cap, a divisor; the identity for most); ``head.loss(logits, targets)
  -> loss`` (mean cross-entropy over the micro-batch's tokens); ``head(hidden, targets)``
  is both
- with a vocabulary cut into pieces (``pieces.py``): ``embed_pieces`` and ``head_pieces``,
  units that own rows of the token matrix and of the output projection

``LayeredModel.plan`` lists the units in execution order with their role (``UnitRef``):
executors walk it instead of doing index arithmetic. Composing the units
(``LayeredModel.forward``) is the plain PyTorch model that parity is measured against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

__all__ = [
    "LayeredModel",
    "WeightSource",
    "UnitRef",
    "materialize_placeholders",
    "is_placeholder",
    "unit_param_names",
    "default_positions",
    "no_cache",
]


def default_positions(x: torch.Tensor) -> torch.Tensor:
    """Positions ``0 .. T-1`` of a ``[B, T, ...]`` batch."""
    return torch.arange(x.shape[1], device=x.device)


def segments(positions: torch.Tensor) -> torch.Tensor:
    """Per-row document numbers of ``[B, T]`` positions that restart at each document (packed
    rows): a new document wherever a position is not its predecessor's plus one (as
    transformers finds packed sequences)."""
    first = positions[:, :1] - 1
    return (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` attention allowed (bool): causal, and within each token's document."""
    seg = segments(positions)
    t = positions.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def no_cache(cache: Any) -> None:
    if cache is not None:
        raise NotImplementedError("a block's forward takes no key/value cache: generation calls its decode()")


@dataclass(frozen=True)
class UnitRef:
    """A unit in execution order: ``index`` in the layout, ``role`` ('embed', 'block',
    'head'), ``block`` its block number (blocks only) and ``module``."""

    index: int
    role: str
    module: nn.Module = field(compare=False, repr=False)
    block: int | None = None
    piece: int | None = None  # vocabulary pieces ('embed_piece', 'head_piece') only


@dataclass(frozen=True)
class WeightSource:
    """Where a unit's initial weights come from.

    ``load(unit_index, names) -> {name: tensor}``: full names, as in ``state_dict()``.
    """

    describe: str
    load: Callable[[int, list[str]], dict[str, torch.Tensor]]
    # the trained adapters that go with these weights (a checkpoint of an adapter run), by name
    adapters: dict[str, torch.Tensor] | None = None
    # the weights are a 4-bit base already dequantized (a QLoRA checkpoint's): not quantized again
    dequantized: bool = False
    # that base's records as stored (``quant``: their QuantLayout; ``read(u, buf)``): read as they are
    records: Any = None
    # the files read beyond the model's own (a checkpoint's weights file) and what names their
    # contents (its CRC32C): a converted copy of these weights depends on them, not on a path as typed
    files: tuple[str, ...] = ()
    identity: str = ""


class LayeredModel(nn.Module):
    """``embed``, ``blocks`` and ``head`` of a causal LM, plus what is needed to load and
    export it. ``units`` lists them in execution order: ``[embed, *blocks, head]``, or,
    with the vocabulary cut, ``[*embed_pieces, embed, *blocks, head, *head_pieces]``."""

    def __init__(self, embed: nn.Module, blocks: list[nn.Module], head: nn.Module, *, kind: str) -> None:
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.kind = kind
        self.hf_model: Any = None  # the Hugging Face model object whose modules these are, if any
        self.hf_config: Any = None
        self.init_unit: Callable[[int, nn.Module, torch.Generator], None] | None = None
        self.embed_pieces = nn.ModuleList()  # vocabulary pieces (pieces.cut_vocab), none if uncut
        self.head_pieces = nn.ModuleList()
        self.row_pieces: dict = {}  # piece parameter name -> pieces.RowPiece
        self.routers: Any = None  # a mixture of experts' auxiliary loss (routers.RouterLoss), where asked for
        # layers cut into sub-layer units (sublayers.py): each block's layer and input width
        self.layer_parts = 1
        self.block_layers: list[int] | None = None
        self.block_widths: list[int] | None = None
        # parameters cut into row ranges (experts): (whole's module, attribute) -> the pieces' (module,
        # attribute); resolved when asked (the parameter objects are replaced by placeholders)
        self.cut_params: dict[tuple[nn.Module, str], list[tuple[nn.Module, str]]] = {}

    @property
    def units(self) -> list[nn.Module]:
        return [*self.embed_pieces, self.embed, *self.blocks, self.head, *self.head_pieces]

    @property
    def n_units(self) -> int:
        return len(self.blocks) + 2 + len(self.embed_pieces) + len(self.head_pieces)

    @property
    def plan(self) -> list[UnitRef]:
        """The units in execution order, with their roles."""
        out = [UnitRef(k, "embed_piece", m, piece=k) for k, m in enumerate(self.embed_pieces)]
        u = len(out)
        out.append(UnitRef(u, "embed", self.embed))
        out += [UnitRef(u + 1 + i, "block", b, i) for i, b in enumerate(self.blocks)]
        u += 1 + len(self.blocks)
        out.append(UnitRef(u, "head", self.head))
        out += [UnitRef(u + 1 + k, "head_piece", m, piece=k) for k, m in enumerate(self.head_pieces)]
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        divisor: int | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed(input_ids, positions)
        for block in self.blocks:
            h = block(h, positions)
        return self.head(h, targets, divisor)

    def param_order(self) -> list[int] | None:
        """The ids of the parameters in the uncut model's order, where the units do not follow it
        (layers cut into sub-layer units: a layer's attention piece holds its input norm, which
        the whole layer lists after its MLP), else None."""
        if self.layer_parts == 1:
            return None
        layers: dict[int, list[nn.Module]] = {}
        for layer, block in zip(self.block_layers or [], self.blocks):
            layers.setdefault(layer, []).append(block)
        units = [*self.embed_pieces, self.embed, *(b.whole for b in (g[0] for g in layers.values())), self.head,
                 *self.head_pieces]  # fmt: skip
        cut = {
            id(getattr(mod, attr)): [getattr(m, a) for m, a in pieces]
            for (mod, attr), pieces in self.cut_params.items()
        }
        seen: dict[int, None] = {}
        for unit in units:
            for p in unit.parameters():
                for q in cut.get(id(p), [p]):  # an expert parameter cut: its ranges in order
                    seen.setdefault(id(q), None)
        return list(seen)

    def layer_of(self, block: int | None) -> int | None:
        """The decoder layer of block unit ``block`` (itself unless layers are cut)."""
        return block if self.block_layers is None or block is None else self.block_layers[block]

    def full_name(self, unit: int, local: str) -> str:
        """The ``state_dict`` name (of the whole ``LayeredModel``) of a unit's parameter."""
        ref = self.plan[unit]
        prefix = {
            "embed_piece": f"embed_pieces.{ref.piece}",
            "head_piece": f"head_pieces.{ref.piece}",
            "block": f"blocks.{self.layer_of(ref.block)}",
        }.get(ref.role, ref.role)
        return f"{prefix}.{local}"


def unit_param_names(model: LayeredModel) -> list[list[tuple[str, nn.Parameter]]]:
    """Per unit, ``(full name, parameter)`` of the parameters that unit owns.

    A parameter shared by two units (tied embeddings) is owned by the first unit in
    execution order; the layout lists the units that borrow it (``UnitLayout.borrows``).
    """
    seen: set[int] = set()
    out = []
    for u, unit in enumerate(model.units):
        own = []
        for name, p in unit.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                own.append((model.full_name(u, name), p))
        out.append(own)
    return out


# torch.nn.init's in-place initialisers the modules' constructors call
_INITIALISERS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip


@contextlib.contextmanager
def skeleton_init() -> Iterator[None]:
    """Module constructors called within skip their default initialisation (``torch.nn.init``'s
    in-place initialisers return the tensor untouched). For skeletons only: their parameters
    are placeholders on ``meta`` whose values come from the weight source. Initialising them
    there would cost no memory, but torch's meta kernels import ``torch._dynamo`` (about 3 s
    of every process's start on this machine). Not thread-safe: build skeletons on one thread.
    Nothing may be imported within that keeps ``torch.nn.init``'s functions (transformers does):
    the built-in models only."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(nn.init, name, _untouched)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _untouched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is a placeholder of ``materialize_placeholders`` (no memory: every stride 0),
    not a view of a slot."""
    return t.dim() > 0 and all(s == 0 for s in t.stride())


def materialize_placeholders(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every (meta) parameter by a zero-memory CPU placeholder of ``dtype``.

    The placeholder is one element expanded to the parameter's shape (stride 0), so a
    model of any size costs nothing until the store binds real views. Shared parameters
    stay shared: each distinct parameter gets one placeholder used by all its owners.
    """
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                ph = torch.zeros((), dtype=dtype).expand(p.shape)
                made[id(p)] = nn.Parameter(ph, requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
