"""Vocabulary pieces: the token embedding and the output head cut into row ranges, each
its own unit, so that slots and buffers are sized by a block and not by a vocabulary-sized
matrix (a 128k x 4096 embedding is 2 GiB in fp32; a Llama block of that width is 0.8 GiB).

A cut model's embed unit keeps what is not the token matrix (GPT's positions, nothing for
Llama) and its head unit the final norm; piece ``k`` of the embedding owns rows
``[start, stop)`` of the token matrix, piece ``k`` of the head the same rows of the output
projection (with tied embeddings it borrows the embedding's piece and owns nothing).

What stays exact, and what does not (measured in tests/test_pieces.py):
- the embedding's forward is a gather, piece by piece: bit-identical; its backward adds
  each token's gradient into its row in token order (``index_add_``), as PyTorch's own
  embedding backward does on CPU: bit-identical there;
- each piece's logits are rows of the whole product: bit-identical;
- the cross-entropy is an online log-sum-exp over pieces, and the head's input gradient a
  sum over pieces: both differ from the whole computation by rounding only (relative
  1e-6 on the loss in fp32; the trained weights of a few steps within 1e-5).

Names: each piece's parameter has its own name (``embed_pieces.3.weight``); ``RowPiece``
maps it to the rows of the whole matrix's name, which is what weight sources and exports
use (a cut model reads and writes the same files as an uncut one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "RowPiece",
    "EmbedPiece",
    "HeadPiece",
    "PiecedEmbedding",
    "PiecedLinear",
    "rows_per_piece",
    "aligned_count",
    "cut_vocab",
    "WholeTensors",
]


@dataclass(frozen=True)
class RowPiece:
    """Rows ``[start, stop)`` of the whole matrix ``whole`` (our name in the uncut model);
    ``module`` is the whole matrix's original module and ``attr`` its attribute there (for its
    Hugging Face name): a vocabulary piece's ``weight``, an expert range's ``gate_up_proj``."""

    whole: str
    start: int
    stop: int
    whole_shape: tuple[int, ...]
    module: nn.Module = field(compare=False, repr=False)
    attr: str = field(default="weight", compare=False)  # the whole matrix's attribute of ``module``


class EmbedPiece(nn.Embedding):
    """Rows ``[start, start + rows)`` of a token embedding."""

    def __init__(self, start: int, rows: int, dim: int, padding_idx: int | None) -> None:
        pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + rows else None
        super().__init__(rows, dim, padding_idx=pad, device="meta")
        self.start = start

    def holds(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` are rows of this piece."""
        return (ids >= self.start) & (ids < self.start + self.num_embeddings)

    def gather_into(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        """``out[i] = weight[ids[i] - start]`` where token ``ids[i]`` is in this piece."""
        mask = self.holds(ids)
        out[mask] = F.embedding(ids[mask] - self.start, self.weight).to(out.dtype)

    def add_grad(self, grad: torch.Tensor, ids: torch.Tensor, dout: torch.Tensor) -> None:
        """``grad[ids[i] - start] += dout[i]`` in token order, for the tokens in this piece; none
        for its padding row (``nn.Embedding``'s ``padding_idx``: the whole embedding's gradient
        leaves that row at zero)."""
        mask = self.holds(ids)
        if self.padding_idx is not None:
            mask &= ids != self.start + self.padding_idx
        grad.index_add_(0, ids[mask] - self.start, dout[mask].to(grad.dtype))


class HeadPiece(nn.Linear):
    """Rows ``[start, start + rows)`` of an output projection (no bias)."""

    def __init__(self, start: int, rows: int, dim: int) -> None:
        super().__init__(dim, rows, bias=False, device="meta")
        self.start = start


class PiecedEmbedding(nn.Module):
    """The whole embedding computed from its pieces (the plain composition of a cut model);
    the pieces are not its submodules (each is its own unit)."""

    def __init__(self, pieces: list[EmbedPiece], dim: int) -> None:
        super().__init__()
        object.__setattr__(self, "pieces", pieces)
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = None
        for p in self.pieces:
            mask = p.holds(ids)
            rows = F.embedding(ids[mask] - p.start, p.weight)
            if out is None:
                out = torch.zeros(*ids.shape, self.dim, dtype=rows.dtype, device=ids.device)
            out = out.index_put((mask,), rows)
        return out


class PiecedLinear(nn.Module):
    """The whole projection computed from its pieces (the plain composition of a cut model)."""

    def __init__(self, pieces: list[nn.Linear]) -> None:
        super().__init__()
        object.__setattr__(self, "pieces", pieces)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(h) for p in self.pieces], dim=-1)


def rows_per_piece(setting: int | None, vocab: int, dim: int, block_numel: int) -> int:
    """Rows of each piece: for at most ``setting`` pieces of equal rows (1: no cut; the
    last may be shorter, and rounding up the rows can leave fewer pieces), or (None) the
    fewest pieces of at most a block's elements each."""
    if setting is not None:
        return -(-vocab // setting)
    if vocab * dim <= block_numel:
        return vocab
    rows = max(1, block_numel // dim)
    return -(-vocab // -(-vocab // rows))  # the same pieces, rows balanced between them


def aligned_count(vocab: int, dim: int, least: int, block: int) -> int | None:
    """The fewest pieces, ``least`` or more, whose rows (``rows_per_piece``'s for that count)
    start every piece on a ``block``-element boundary of the whole ``vocab x dim`` matrix, as
    8-bit optimizer states' blocks need; None where no count up to 8 x ``least`` does."""
    for count in range(least, min(vocab, 8 * least) + 1):
        if rows_per_piece(count, vocab, dim, 0) * dim % block == 0:
            return count
    return None


def cut_vocab(model, rows: int) -> None:
    """Cut ``model``'s token embedding and output projection into pieces of ``rows`` rows
    (in place, on the skeleton: parameters still on the meta device)."""
    embed, head = model.embed, model.head
    whole_emb: nn.Embedding = getattr(embed, embed.TOKENS)
    whole_out: nn.Linear = getattr(head, head.PROJ)
    if whole_out.bias is not None:
        raise ValueError(f"{type(head).__name__}: an output projection with a bias cannot be cut into pieces")
    vocab, dim = whole_emb.weight.shape
    tied = whole_out.weight is whole_emb.weight
    n = math.ceil(vocab / rows)
    emb_pieces, head_pieces = [], []
    for k in range(n):
        a, b = k * rows, min(vocab, (k + 1) * rows)
        e = EmbedPiece(a, b - a, dim, whole_emb.padding_idx)
        h = HeadPiece(a, b - a, dim)
        if tied:
            h.weight = e.weight
        emb_pieces.append(e)
        head_pieces.append(h)
        model.row_pieces[f"embed_pieces.{k}.weight"] = RowPiece(
            f"embed.{embed.TOKENS}.weight", a, b, (vocab, dim), whole_emb
        )
        if not tied:
            model.row_pieces[f"head_pieces.{k}.weight"] = RowPiece(
                f"head.{head.PROJ}.weight", a, b, tuple(whole_out.weight.shape), whole_out
            )
    for owner, attr, plain in (
        (embed, embed.TOKENS, PiecedEmbedding(emb_pieces, dim)),
        (head, head.PROJ, PiecedLinear(head_pieces)),
    ):
        owner._modules.pop(attr)
        object.__setattr__(owner, attr, plain)  # not a submodule: its pieces are units of their own
    model.embed_pieces = nn.ModuleList(emb_pieces)
    model.head_pieces = nn.ModuleList(head_pieces)


class WholeTensors:
    """Collects pieces' rows into whole matrices: ``add(name, tensor)`` returns
    ``[(name, tensor)]`` ready to use (the whole matrix once its last rows came in)."""

    def __init__(self, row_pieces: dict[str, RowPiece]) -> None:
        self.row_pieces = row_pieces
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}

    def add(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        rp = self.row_pieces.get(name)
        if rp is None:
            return [(name, t)]
        whole, filled = self._partial.get(rp.whole) or (torch.empty(rp.whole_shape, dtype=t.dtype), 0)
        whole[rp.start : rp.stop].copy_(t)
        filled += rp.stop - rp.start
        if filled < rp.whole_shape[0]:
            self._partial[rp.whole] = (whole, filled)
            return []
        self._partial.pop(rp.whole, None)
        return [(rp.whole, whole)]
