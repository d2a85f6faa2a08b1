"""Checkpoint keys -> a transformers model's parameters, by transformers' own conversion mapping.

transformers 5 keeps some parameters in another layout than their checkpoints: a mixture of
experts' experts as 3-D tensors (``mlp.experts.gate_up_proj``, ``[experts, 2 x ff, d]``) where
the checkpoints (and ``save_pretrained``) hold one matrix per expert and projection
(``mlp.experts.3.gate_proj.weight``); some families rename keys. ``from_pretrained`` converts
them with the model's ``WeightConverter``/``WeightRenaming`` list. The units read one
parameter at a time, so this module asks the same list which checkpoint keys make each
parameter and runs the converter's own operations on them (stack, concatenate, ...): the values
are those ``from_pretrained`` gives, bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["Sources", "conversion_plan", "convert", "to_checkpoint"]


@dataclass
class Sources:
    """The checkpoint keys one parameter is made of: ``converter`` None, one key read as it is
    (perhaps renamed); else the converter's keys, each with the source pattern it matched, in
    checkpoint order (experts by number)."""

    converter: Any = None
    keys: list[tuple[str, str]] = field(default_factory=list)


def conversion_plan(hf: Any, keys: list[str]) -> dict[str, Sources]:
    """Which of checkpoint ``keys`` make each parameter of ``hf`` (a model skeleton; keys that
    make none are left out), as ``from_pretrained`` would group them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(hf)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = dict(hf.named_parameters())
    prefix = hf.base_model_prefix
    plan: dict[str, Sources] = {}
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:
            target, pattern = key, None
        if target not in meta:
            continue
        if pattern is None:
            plan.setdefault(target, Sources(None, [(key, key)]))
        else:
            plan.setdefault(target, Sources(by_pattern[pattern])).keys.append((key, pattern))
    return plan


def convert(hf: Any, target: str, sources: Sources, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Parameter ``target`` of ``hf`` made from its checkpoint keys (``read(key)``: one of them)."""
    if sources.converter is None:
        return read(sources.keys[0][0])
    conv = copy.deepcopy(sources.converter)  # a converter collects tensors: one instance per parameter
    for key, pattern in sources.keys:
        conv.add_tensor(target, key, pattern, lambda key=key: read(key))
    out = conv.convert(target, model=hf, config=hf.config)
    value = out.get(target)
    if value is None:
        raise ValueError(f"converting the checkpoint keys of {target} gave {sorted(out)}, not {target}")
    return value[0] if isinstance(value, list) else value


def to_checkpoint(hf: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters of ``hf`` by name (all those one conversion needs: a unit's) in the layout its
    checkpoints have, as ``save_pretrained`` writes them (the conversion reverted: one matrix per
    expert and projection); each its own contiguous tensor (safetensors saves no shared storage)."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.contiguous().clone() for k, v in revert_weight_conversion(hf, tensors).items()}
