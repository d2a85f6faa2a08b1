"""Which ``(block, micro-batch)`` pairs keep their autograd graph from the forward for the
backward (within ``memory.keep_act_mib``) and which are recomputed from their stashed input.

A policy is asked once per pair, in forward order, right after the pair's graph is built,
with the bytes that graph holds, only while the budget still holds that graph (``KeptGraphs``
enforces the budget; a policy chooses among the graphs that fit). Replaceable: ``memory.activations`` names one of
``POLICIES`` (an SSD tier for activations is one more policy at the same seam).

- ``KeepLast`` (default): keep the pairs the backward reaches first. The backward walks the
  blocks in reverse, so the graphs it can use at once are the last ones built; keeping those
  frees the budget early in the backward and leaves the stash (and its spill to SSD) to the
  earlier blocks, whose recompute starts later. The number of pairs the budget holds is
  learned from the first graph (blocks of one model are alike); the budget is never exceeded.
- ``FirstFit``: keep every graph while the budget lasts, in forward order (the first blocks).
- ``RecomputeAll``: keep nothing.
"""

from __future__ import annotations

__all__ = ["ActivationPolicy", "KeepLast", "FirstFit", "RecomputeAll", "POLICIES"]


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


# memory.activations -> its policy
POLICIES: dict[str, type[ActivationPolicy]] = {"keep": KeepLast, "keep-first": FirstFit, "recompute": RecomputeAll}
