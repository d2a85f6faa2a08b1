"""LoRA on a streamed, frozen base: peft's math, the adapters resident beside the units.

The base model's units stay on their tier and are streamed as always, but frozen (no gradient,
no optimizer step, never written). The adapters are small: they live on the compute device as
ordinary parameters, outside the units, and reach the blocks through forward hooks on the
targeted linear layers. A hook adds what peft's ``lora.Linear`` adds to its base layer's output,
in the same order of operations, so a run is bit for bit peft's on plain PyTorch in fp32:

    out = (base(x) + lora_B(lora_A(dropout(x.to(fp32)))) * (alpha / r)).to(base(x).dtype)

``lora_A`` is initialised Kaiming-uniform (a = sqrt(5)) and ``lora_B`` to zero, as peft does,
from a generator seeded by the run's seed (so step 1's loss is the base model's). Autograd
accumulates the adapters' gradients over the micro-batches in the layer-major backward in the
same order as plain PyTorch's micro-batch-major one (for each adapter, micro-batch 0 first), and
the recomputed forward of a block calls the same hooks.

Adapters are keyed by the full name of the module they sit on (``blocks.3.self_attn.q_proj``);
peft's names for export are made in ``adapters/peft_io.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..config import AdapterConfig, ConfigError
from ..models.base import LayeredModel

__all__ = ["LoRA", "Target", "find_targets", "linear_shape"]

SEED_SALT = 0x10_4A  # the adapters' generator: the run's seed + this (not the base's unit streams)


@dataclass(frozen=True)
class Target:
    """A linear layer that gets an adapter: ``name`` (full, as in the model's state dict
    without ``.weight``), ``module``, and its ``in_features`` / ``out_features``."""

    name: str
    module: nn.Module
    in_features: int
    out_features: int


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear layer (``nn.Linear``, or transformers' ``Conv1D`` whose weight
    is stored transposed); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    w = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor):
        n_in, n_out = w.shape
        return int(n_in), int(n_out)
    return None


def find_targets(model: LayeredModel, names: list[str]) -> list[Target]:
    """The blocks' linear layers whose last name is in ``names`` (empty: every one), in model
    order (block by block, each block's modules in registration order: peft's parameter
    order). Refused, naming what the model has: a name that matches nothing."""
    out: list[Target] = []
    have: dict[str, None] = {}
    for i, block in enumerate(model.blocks):
        for local, module in block.named_modules():
            shape = linear_shape(module)
            if shape is None:
                continue
            last = local.rsplit(".", 1)[-1]
            have[last] = None
            if not names or last in names:
                out.append(Target(f"blocks.{i}.{local}", module, *shape))
    missing = [n for n in names if n not in have]
    if missing or not out:
        raise ConfigError(
            f"adapter.target = {names!r}: {', '.join(map(repr, missing)) or 'nothing'} matches no linear layer of "
            f"this model's blocks; it has {', '.join(have) or 'none'}"
        )
    return out


class _Pair(nn.Module):
    """One adapter, as peft's ``LoraLayer`` holds it: ``lora_A`` (r x in), ``lora_B`` (out x r)."""

    def __init__(self, t: Target, r: int, dropout: float) -> None:
        super().__init__()
        self.lora_A = nn.Linear(t.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, t.out_features, bias=False)
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()


class LoRA(nn.Module):
    """The adapters of one model (``cfg``: the ``[adapter]`` section), on ``device`` in fp32,
    hooked into the model's targeted layers. ``params()`` lists them in peft's order."""

    def __init__(self, model: LayeredModel, cfg: AdapterConfig, *, seed: int, device: torch.device | str) -> None:
        super().__init__()
        self.cfg = cfg
        self.targets = find_targets(model, cfg.target)
        too_big = [t.name for t in self.targets if cfg.rank > min(t.in_features, t.out_features)]
        if too_big:
            t = next(t for t in self.targets if t.name == too_big[0])
            raise ConfigError(
                f"adapter.rank = {cfg.rank} is above the width of {t.name} ({t.in_features} -> {t.out_features}): "
                f"a rank above min(in, out) = {min(t.in_features, t.out_features)} adds nothing; lower it"
            )
        with torch.device("cpu"):
            self.adapters: list[_Pair] = [_Pair(t, cfg.rank, cfg.dropout) for t in self.targets]
        self.pairs = nn.ModuleList(self.adapters)  # registered: .to() and state_dict() see them
        self.reset(seed)
        self.to(device)
        self.scaling = cfg.scaling
        self._hooks = [t.module.register_forward_hook(self._hook(p)) for t, p in zip(self.targets, self.adapters)]

    @property
    def kinds(self) -> list[str]:
        """The targeted layers' last names (peft's ``target_modules``), sorted."""
        return sorted({t.name.rsplit(".", 1)[-1] for t in self.targets})

    def reset(self, seed: int) -> None:
        """peft's initialisation from ``seed``: A Kaiming-uniform (a = sqrt(5)), B zero."""
        g = torch.Generator().manual_seed(seed + SEED_SALT)
        with torch.no_grad():
            for p in self.adapters:
                nn.init.kaiming_uniform_(p.lora_A.weight, a=math.sqrt(5), generator=g)
                nn.init.zeros_(p.lora_B.weight)

    def params(self) -> list[torch.Tensor]:
        """The trainable parameters in peft's order: per target, A then B."""
        return [w for p in self.adapters for w in (p.lora_A.weight, p.lora_B.weight)]

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(target name.lora_A.weight, parameter)`` and B's, per target in model order."""
        for t, p in zip(self.targets, self.adapters):
            yield f"{t.name}.lora_A.weight", p.lora_A.weight
            yield f"{t.name}.lora_B.weight", p.lora_B.weight

    def load_named(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set every adapter from ``tensors`` by ``named()``'s names (a checkpoint's); each one
        must be there with this run's shape."""
        with torch.no_grad():
            for name, p in self.named():
                t = tensors.get(name)
                if t is None or tuple(t.shape) != tuple(p.shape):
                    raise ConfigError(
                        f"the adapter {name} is {'missing' if t is None else f'of shape {tuple(t.shape)}'} in the "
                        f"given adapters; this run's is {tuple(p.shape)} (the [adapter] config they were made with?)"
                    )
                p.copy_(t)

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.params())

    def _hook(self, pair: _Pair) -> Any:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            x = args[0]
            a = pair.lora_A.weight
            if x.dtype != a.dtype:
                x = x.to(a.dtype)
            return (out + pair.lora_B(pair.lora_A(pair.dropout(x))) * self.scaling).to(out.dtype)

        return hook

    def describe(self) -> str:
        n = sum(w.numel() for w in self.params())
        return (
            f"LoRA rank {self.cfg.rank}, alpha {self.cfg.alpha:g}, dropout {self.cfg.dropout:g} on "
            f"{len(self.targets)} layers ({', '.join(self.kinds)}): {n:,} trainable parameters, "
            f"{4 * n / 2**20:.1f} MiB of weights (x4 with gradients and AdamW moments), on the compute device"
        )
