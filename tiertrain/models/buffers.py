"""A transformers model's persistent buffers: constants saved with its weights, never trained.

DeepSeek-V3's routers keep their correction bias (``e_score_correction_bias``, which picks the
experts) and Apertus's xIELU activations their ``beta`` and ``eps`` as buffers that
``save_pretrained`` writes and ``from_pretrained`` loads, beside the parameters. tiertrain streams
parameters alone (``FlatLayout``): the buffers stay in the skeleton's modules, set here from the
model directory's files (``load_buffers``: as ``from_pretrained`` sets them; a buffer the files
lack keeps its initial value, said) and written by an export with the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["persistent_buffers", "load_buffers"]

log = logging.getLogger("tiertrain")


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name as the model's state dict has it, buffer) of every persistent buffer of ``model``."""
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in module._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), buf


def load_buffers(
    model: nn.Module,
    keys: dict[str, tuple[int, ...]],
    read: Callable[[str], torch.Tensor],
    prefix: str,
    where: str,
) -> int:
    """Set ``model``'s persistent buffers from the checkpoint tensors ``keys`` (name -> shape),
    read by ``read(key)``; a name with or without the model's ``prefix``. Refused: a shape that
    differs (``where`` names the setting and directory). The number set."""
    missing, n = [], 0
    for name, buf in persistent_buffers(model):
        key = next((k for k in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}") if k in keys), None)
        if key is None:
            missing.append(name)
            continue
        if tuple(keys[key]) != tuple(buf.shape):
            raise ConfigError(
                f"{where}: {key!r} has shape {tuple(keys[key])}, the model expects {tuple(buf.shape)}; the "
                "weights are of another model"
            )
        with torch.no_grad():
            buf.copy_(read(key))
        n += 1
    if missing:  # (from_pretrained says so too: "newly initialized")
        log.warning(
            "%s: %d buffer(s) of the model are not in its files and keep their initial values (first: %s)",
            where,
            len(missing),
            missing[0],
        )
    return n
