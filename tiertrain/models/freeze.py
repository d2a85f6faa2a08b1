"""Frozen units (``train.freeze``): parts of the model that are read, never trained.

A frozen unit's parameters do not require gradients: the backward runs through it (the
units before it still get their input gradients) without forming its weights' gradients, the
update skips it, and its parameters are never written. As plain PyTorch with
``requires_grad=False`` on those parameters and the optimizer over the others.

Selectors name units by role, never by position in the plan: ``embed``, ``head``,
``blocks`` (all), ``blocks:N`` (block N, from 0) and ``blocks:A-B`` (A to B, inclusive); a block
is a decoder layer, all its units where layers are cut (``model.layer_pieces``).
"""

from __future__ import annotations

from ..config.sections import FREEZE_SELECTOR, check_freeze
from ..errors import ConfigError
from .base import LayeredModel

__all__ = ["frozen_units", "apply_freeze", "freeze_all"]


def frozen_units(model: LayeredModel, selectors: list[str]) -> set[int]:
    """The indices (in ``model.plan``) of the units ``selectors`` name."""
    check_freeze(selectors)
    by_role: dict[str, list[int]] = {}
    layers: dict[int, list[int]] = {}  # a block is a decoder layer: all its sub-layer units where cut
    for ref in model.plan:
        by_role.setdefault(ref.role, []).append(ref.index)
        if ref.role == "block":
            layers.setdefault(model.layer_of(ref.block) or 0, []).append(ref.index)
    blocks = [layers[k] for k in sorted(layers)]
    out: set[int] = set()
    for s in selectors:
        m = FREEZE_SELECTOR.match(s)
        assert m is not None
        what, a, b = m.group(1), m.group(2), m.group(3)
        if what != "blocks":
            out |= set(by_role[what])
            continue
        lo = 0 if a is None else int(a)
        hi = len(blocks) - 1 if a is None else int(b if b is not None else a)
        if hi >= len(blocks):
            raise ConfigError(
                f"train.freeze: {s!r} names block {hi}, but the model has {len(blocks)} blocks (0 to {len(blocks) - 1})"
            )
        out |= {u for layer in blocks[lo : hi + 1] for u in layer}
    return out


def apply_freeze(model: LayeredModel, selectors: list[str]) -> set[int]:
    """Mark the parameters of the units ``selectors`` name as not requiring gradients; the
    frozen units' indices. Refused: a cut vocabulary (not yet), a tied embedding frozen on one
    side only (the weight is both), every unit frozen (nothing to train)."""
    if not selectors:
        return set()
    if model.row_pieces:
        raise ConfigError(
            "train.freeze with the vocabulary cut into pieces is not supported yet: set model.vocab_pieces=1 "
            "(and memory for the whole embedding), or leave train.freeze empty"
        )
    units = frozen_units(model, selectors)
    embed = next(r.index for r in model.plan if r.role == "embed")
    head = next(r.index for r in model.plan if r.role == "head")
    shared = {id(p) for p in model.units[embed].parameters()} & {id(p) for p in model.units[head].parameters()}
    if shared and (embed in units) != (head in units):
        raise ConfigError(
            "train.freeze: the embedding and the output head share their weight (model.tie_embeddings): "
            "freeze both ('embed', 'head') or neither"
        )
    if len(units) == len(model.plan):
        raise ConfigError("train.freeze: every unit is frozen, nothing is left to train")
    for u in units:
        for p in model.units[u].parameters():
            p.requires_grad_(False)
    return units


def freeze_all(model: LayeredModel) -> set[int]:
    """Every unit frozen (adapters train beside the model, ``adapters/``): the indices of all."""
    for p in model.parameters():
        p.requires_grad_(False)
    return {r.index for r in model.plan}
