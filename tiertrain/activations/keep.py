"""Autograd graphs kept from the forward for the backward ("keep" policy, as in TBA).

By default the backward recomputes every ``(block, micro-batch)`` from its stashed input.
Within ``memory.keep_act_mib`` the executor instead keeps the graph the forward built,
so the backward runs it directly: no recompute, the same tensors plain PyTorch saves.

Parameters are the one thing not kept. The unit's parameters live in a device slot that
is reused for other units between the forward and the backward (and refetched for the
backward, unchanged within the step), so a saved tensor lying in a bound unit's flat
buffer (a weight, or a view of it such as ``weight.t()``) is packed as a reference
``(unit, element offset, size, stride)``; unpacking takes the same view of wherever the
unit is bound when the backward runs. Everything else stays as autograd saved it.

Memory: the bytes of the distinct storages a graph saves, counted as it is built. Whether
a graph is kept is the activation policy's choice (``policy.py``), asked with those bytes
once the graph exists and only if it fits: the kept total never exceeds ``keep_act_mib``. A
graph that is not kept is dropped at once (its block is then recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["KeptGraphs", "UnitViews"]


@dataclass(frozen=True)
class _ParamRef:
    unit: int
    offset: int  # elements from the unit's flat buffer start
    size: tuple[int, ...]
    stride: tuple[int, ...]


class UnitViews:
    """Saved tensors that lie in a bound unit's flat parameter buffer, packed as references
    to the unit and unpacked as the same view of wherever the unit is bound then (shared by
    the kept and the offloaded graphs: parameters are never copied with activations)."""

    def __init__(self, bound: Callable[[int], torch.Tensor]) -> None:
        self.bound = bound
        self._ranges: list[tuple[int, int, int, torch.Tensor]] = []  # bound units: (u, first, end byte address, flat)

    def enter(self, units: tuple[int, ...]) -> None:
        """The units a graph about to be built uses (looked up once per graph, not per tensor)."""
        flats = [(u, self.bound(u)) for u in units]
        self._ranges = [(u, f.data_ptr(), f.data_ptr() + f.numel() * f.element_size(), f) for u, f in flats]

    def exit(self) -> None:
        self._ranges = []

    def ref(self, t: torch.Tensor) -> _ParamRef | None:
        p = t.data_ptr()
        for u, base, end, flat in self._ranges:
            if base <= p < end and t.device == flat.device and t.dtype == flat.dtype:
                return _ParamRef(u, (p - base) // flat.element_size(), tuple(t.size()), tuple(t.stride()))
        return None

    def view(self, r: _ParamRef) -> torch.Tensor:
        flat = self.bound(r.unit)
        return flat.as_strided(r.size, r.stride, flat.storage_offset() + r.offset)


@dataclass
class _Graph:
    x: torch.Tensor  # the block input, requires grad
    out: torch.Tensor  # the block output, with its graph
    nbytes: int


class KeptGraphs:
    def __init__(self, budget_bytes: int, bound: Callable[[int], torch.Tensor]) -> None:
        """``bound(u)``: unit ``u``'s flat parameter buffer where it is bound right now."""
        self.budget = budget_bytes
        self.bound = bound
        self.views = UnitViews(bound)
        self.kept_bytes = 0
        self.peak_bytes = 0
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._seen: set[int] = set()
        self._counted = 0

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._graphs

    # -- hooks ------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        ref = self.views.ref(t)
        if ref is not None:
            return ref
        st = t.untyped_storage()
        if st.data_ptr() not in self._seen:  # views of one storage count once
            self._seen.add(st.data_ptr())
            self._counted += st.nbytes()
        # Never the tensor itself: when it is the op's own output, the output would hold its
        # grad_fn, which would hold the output, a cycle that no graph dropped over the budget
        # (never run backward) frees. A detached alias shares storage and version counter.
        return t.detach()

    def _unpack(self, obj):
        return self.views.view(obj) if isinstance(obj, _ParamRef) else obj

    # -- forward / backward ---------------------------------------------------------------------------
    def forward(
        self,
        key: tuple[int, int],
        units: tuple[int, ...],
        fn: Callable,
        x: torch.Tensor,
        keep: Callable[[int, int], bool],
    ) -> tuple[torch.Tensor, bool]:
        """Run ``fn(x)`` keeping its graph under ``key``; returns the output (detached) and
        whether the graph was kept. ``keep(nbytes, kept_bytes)`` decides once the graph is
        built (False: it is dropped, the caller recomputes it later). ``units``: those whose
        parameters ``fn`` uses (bound now)."""
        x = x.detach().requires_grad_()
        self.views.enter(units)
        self._seen, self._counted = set(), 0
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = fn(x)
        finally:
            self.views.exit()
            self._seen = set()
        nbytes = self._counted
        if self.kept_bytes + nbytes > self.budget or not keep(nbytes, self.kept_bytes):
            return out.detach(), False  # the graph is freed with ``out``
        self._graphs[key] = _Graph(x, out, nbytes)
        self.kept_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.kept_bytes)
        return out.detach(), True

    def backward(self, key: tuple[int, int], grad_out: torch.Tensor) -> torch.Tensor:
        """Back-propagate ``grad_out`` through the kept graph ``key`` (its units bound now,
        gradients bound); returns the gradient of its input and frees the graph."""
        g = self._graphs.pop(key)
        torch.autograd.backward(g.out, grad_out)
        self.kept_bytes -= g.nbytes
        return g.x.grad

    def clear(self) -> None:
        self._graphs.clear()
        self.kept_bytes = 0
