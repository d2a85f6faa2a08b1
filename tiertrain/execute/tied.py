"""A tied embedding's gradient summed in plain PyTorch's order over several micro-batches.

Plain gradient accumulation adds, for each micro-batch ``m``, the head's gradient ``h_m``
and the embedding's ``e_m`` of the shared weight first (autograd sums a leaf's incoming
gradients before accumulating them), then accumulates: ``((h_0 + e_0) + (h_1 + e_1)) + ...``.
The layer-major order meets every ``h_m`` (head, all micro-batches) before any ``e_m``
(embedding, last), so letting autograd add into one buffer gives ``((h_0 + h_1) + e_0) + e_1``:
float addition is not associative, and the bits differ.

``e_m`` is zero outside the rows of micro-batch ``m``'s tokens, and adding an exact zero
changes nothing, so only the rows ``R`` of the step's tokens need the plain order; on every
other row both orders sum the same ``h_m`` in the same order. ``TiedRows`` keeps, during
the head's backward, each micro-batch's ``h_m`` on ``R`` (``M x |R| x d`` elements on the
gradients' device: ``bytes_for``), and during the embedding's backward puts ``h_m`` back
on ``R`` before autograd adds ``e_m``, takes ``h_m + e_m`` off and accumulates it in a side
sum, written on ``R`` at the end. Not used with float32 accumulators (``train.grad_accum_dtype``
for bf16 gradients: already within a stated tolerance) nor with a vocabulary cut into pieces
(its own head backward, ``execute/vocab.py``).
"""

from __future__ import annotations

import torch

from ..state.layout import ParamRecord

__all__ = ["TiedRows", "tied_rows", "tied_rows_bytes"]


class TiedRows:
    """The rows of one tied weight's gradient that the step's tokens touch, summed in plain
    order. Call ``begin`` at the step's start, ``head_before``/``head_after`` around each
    micro-batch's head backward, ``embed_before``/``embed_after`` around each micro-batch's
    embedding backward, and ``finish`` before the embedding's gradients are complete."""

    def __init__(self, grad_view) -> None:
        """``grad_view``: a callable giving the tied weight's gradient (``[V, d]``, a view of the
        live buffer) while the embedding's gradient is live."""
        self._grad = grad_view
        self._rows: torch.Tensor | None = None
        self._head: list[torch.Tensor] = []  # h_m on the rows, per micro-batch
        self._sum: torch.Tensor | None = None
        self.peak_bytes = 0  # the most held at once, over the steps (memory tests)

    def _held(self, *more: torch.Tensor | None) -> None:
        held = [x for x in (*self._head, self._sum, *more) if x is not None]
        self.peak_bytes = max(self.peak_bytes, sum(x.numel() * x.element_size() for x in held))

    @staticmethod
    def bytes_for(micro_batches: int, rows: int, width: int, itemsize: int) -> int:
        """Device bytes held from the head's backward to the embedding's: ``M`` copies of the
        rows (the side sum reuses the first's place once it is consumed: at most ``M + 1``)."""
        return (micro_batches + 1) * rows * width * itemsize if micro_batches > 1 else 0

    def begin(self, ids: list[torch.Tensor]) -> None:
        """The step's micro-batches' token ids: their distinct rows are the ones kept."""
        self._rows = torch.unique(torch.cat([x.reshape(-1) for x in ids])).long()  # sync point: the count of rows
        self._head, self._sum = [], None

    def head_before(self) -> None:
        """Zero the rows so that the backward leaves ``h_m`` alone on them."""
        self._grad().index_fill_(0, self._rows, 0.0)

    def head_after(self) -> None:
        self._head.append(self._grad().index_select(0, self._rows))

    def embed_before(self, m: int) -> None:
        """Put ``h_m`` on the rows: the backward then adds ``e_m`` to it, as autograd sums a
        leaf's two incoming gradients."""
        self._grad().index_copy_(0, self._rows, self._head[m])

    def embed_after(self, m: int) -> None:
        both = self._grad().index_select(0, self._rows)  # h_m + e_m
        self._held(both)
        self._head[m] = None  # its memory goes back now
        if self._sum is None:
            self._sum = both
        else:
            self._sum.add_(both)  # as AccumulateGrad adds into an existing .grad

    def finish(self) -> None:
        self._grad().index_copy_(0, self._rows, self._sum)
        self._rows, self._head, self._sum = None, [], None


def _tied(model, layout, accum_dtype) -> tuple[int, int, ParamRecord] | None:
    """(owner unit, record index, record) of the weight the (uncut) head borrows from a
    trained embedding, where no float32 accumulator sums the gradients; else None."""
    head = [r for r in model.plan if r.role == "head"]
    if accum_dtype is not None or len(head) != 1 or any(r.role == "head_piece" for r in model.plan):
        return None
    used = {id(p) for p in model.units[head[0].index].parameters()}
    for owner in layout.units[head[0].index].borrows:
        for k, rec in enumerate(layout.units[owner].params):
            if id(rec.param) in used and rec.param.dim() == 2 and rec.param.requires_grad:
                return owner, k, rec
    return None


def tied_rows(model, grads) -> TiedRows | None:
    """A ``TiedRows`` for ``model``'s head where it borrows a trained embedding's weight and no
    float32 accumulator sums the gradients (``grads``: the ``GradStore``); else None."""
    if grads is None:  # an evaluation's executor: no gradient
        return None
    found = _tied(model, grads.layout, grads.accum_dtype)
    if found is None:
        return None
    owner, k, _ = found
    return TiedRows(lambda: grads.views(owner)[k])


def tied_rows_bytes(model, layout, data, dtype, accum_dtype) -> int:
    """The most bytes a step's ``TiedRows`` holds (``data``: the ``[data]`` section: ``M``
    micro-batches of ``micro_batch_size x seq_len`` tokens): the step's distinct tokens are at
    most ``min(vocabulary, M x tokens)`` rows."""
    found = _tied(model, layout, accum_dtype)
    if found is None:
        return 0
    rows, width = found[2].shape
    m, tokens = data.micro_batches, data.micro_batch_size * data.seq_len
    return TiedRows.bytes_for(m, min(rows, m * tokens), width, dtype.itemsize)
