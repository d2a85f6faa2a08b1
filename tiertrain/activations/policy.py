"""Which ``(block, micro-batch)`` pairs keep their autograd graph from the forward for the
backward (within ``memory.keep_act_mib``), which send it to the storage tier (``offload.py``)
and which are recomputed from their stashed input.

A policy is asked once per pair, in forward order, right after the pair's graph is built,
with the bytes that graph holds, only while the budget still holds that graph (``KeptGraphs``
enforces the budget; a policy chooses among the graphs that fit). Replaceable: ``memory.activations`` names one of
``POLICIES``; activations on the storage tier are one more (``Tiered``, with ``offload.py``).

- ``KeepLast`` (default): keep the pairs the backward reaches first. The backward walks the
  blocks in reverse, so the graphs it can use at once are the last ones built; keeping those
  frees the budget early in the backward and leaves the stash (and its spill to SSD) to the
  earlier blocks, whose recompute starts later. The number of pairs the budget holds is
  learned from the first graph (blocks of one model are alike); the budget is never exceeded.
- ``FirstFit``: keep every graph while the budget lasts, in forward order (the first blocks).
- ``RecomputeAll``: keep nothing.
- ``Tiered`` (``memory.activations = "auto"`` or ``"offload"`` with pairs to offload): in
  forward order, the first pairs are recomputed, the next ``offload`` pairs go to the storage
  tier, the last ``keep`` pairs are kept: the backward needs the kept ones first, then reads
  the offloaded ones back while it computes, and recomputes the earliest. The counts are
  planned at start (``cost/choose.py``: the file space is claimed then).
"""

from __future__ import annotations

__all__ = ["ActivationPolicy", "KeepLast", "FirstFit", "RecomputeAll", "Tiered", "POLICIES", "policy_for"]


class ActivationPolicy:
    """Decides, pair by pair, whether a graph is kept (True) or dropped for recompute."""

    def begin_step(self, blocks: int, micro_batches: int, budget: int) -> None:
        self.blocks, self.micro_batches, self.budget = blocks, micro_batches, budget

    @property
    def wants_graphs(self) -> bool:
        """False: no graph will ever be kept (the forward need not record them)."""
        return self.budget > 0

    def keep(self, block: int, micro_batch: int, nbytes: int, kept_bytes: int) -> bool:
        raise NotImplementedError

    def offload(self, block: int, micro_batch: int) -> bool:
        """Asked before the pair's forward: True sends its saved tensors to the storage tier."""
        return False

    def slot(self, block: int, micro_batch: int) -> int:
        """An offloaded pair's record in the file."""
        raise NotImplementedError


class FirstFit(ActivationPolicy):
    def keep(self, block: int, micro_batch: int, nbytes: int, kept_bytes: int) -> bool:
        return True  # every graph the budget still holds (KeptGraphs enforces the budget)


class KeepLast(ActivationPolicy):
    def begin_step(self, blocks: int, micro_batches: int, budget: int) -> None:
        super().begin_step(blocks, micro_batches, budget)
        self.first_kept: int | None = None  # forward index of the first pair to keep

    def keep(self, block: int, micro_batch: int, nbytes: int, kept_bytes: int) -> bool:
        pairs = self.blocks * self.micro_batches
        if self.first_kept is None:
            fit = self.budget // max(nbytes, 1)
            self.first_kept = max(0, pairs - fit)
        return block * self.micro_batches + micro_batch >= self.first_kept


class RecomputeAll(ActivationPolicy):
    @property
    def wants_graphs(self) -> bool:
        return False

    def keep(self, block: int, micro_batch: int, nbytes: int, kept_bytes: int) -> bool:
        return False


class Tiered(ActivationPolicy):
    def __init__(self, keep_pairs: int, offload_pairs: int) -> None:
        self.keep_pairs, self.offload_pairs = keep_pairs, offload_pairs

    def begin_step(self, blocks: int, micro_batches: int, budget: int) -> None:
        super().begin_step(blocks, micro_batches, budget)
        pairs = blocks * micro_batches
        self.first_kept = pairs - min(pairs, self.keep_pairs)
        self.first_offloaded = max(0, self.first_kept - self.offload_pairs)

    @property
    def wants_graphs(self) -> bool:
        return self.budget > 0 and self.keep_pairs > 0

    def _index(self, block: int, micro_batch: int) -> int:
        return block * self.micro_batches + micro_batch

    def keep(self, block: int, micro_batch: int, nbytes: int, kept_bytes: int) -> bool:
        return self._index(block, micro_batch) >= self.first_kept

    def offload(self, block: int, micro_batch: int) -> bool:
        return self.first_offloaded <= self._index(block, micro_batch) < self.first_kept

    def slot(self, block: int, micro_batch: int) -> int:
        return self._index(block, micro_batch) - self.first_offloaded


def policy_for(activations: str, keep_pairs: int = 0, offload_pairs: int = 0) -> ActivationPolicy:
    """The policy of ``memory.activations`` once planned: ``keep_pairs`` the budget holds,
    ``offload_pairs`` on the storage tier (``auto`` / ``offload`` only)."""
    if activations in ("auto", "offload") and offload_pairs > 0:
        return Tiered(keep_pairs, offload_pairs)
    return POLICIES.get(activations, KeepLast)()


# memory.activations -> its policy (without offloaded pairs)
POLICIES: dict[str, type[ActivationPolicy]] = {"keep": KeepLast, "keep-first": FirstFit, "recompute": RecomputeAll}
